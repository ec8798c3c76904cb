"""The weights ZeroMQ is still sending, zero-copy: the snapshot slots that async pulls are
sent from, and the ranges of the live weights in flight (sync mode, streamed buckets).

A zero-copy send reads its tensor on ZeroMQ's I/O thread after the call returns, so a slot is
refilled only once its sends are done, and an update of the live weights first waits for the
sends that overlap its range. A peer that stops reading (a stalled or hostile client) must not
hold the server for ever: a slot it holds is given up on after SEND_WAIT_S, and a wait for it
gives up after that long too.

What this is not: the weights themselves or the optimizer (psserver.store.parameters), nor the
socket (psserver.serving.socket).
"""

import dataclasses
import logging
import time

import torch
import zmq

log = logging.getLogger("ps.server")
SEND_WAIT_S = 2.0
SNAPSHOT_SLOTS = 3  # copies of the weights that async pulls may be sent from at once
# Slots given up on because a peer stopped reading their sends (a stalled or hostile client):
# replaced by fresh ones, freed by ZeroMQ whenever those sends end. At most this many at once.
RETIRED_SLOTS = 3


@dataclasses.dataclass
class SnapshotSlot:
    """A reusable copy of the weights of one version, and the sends still reading it."""

    version: int
    tensors: list[torch.Tensor]
    trackers: list[zmq.MessageTracker]
    filled: float = 0.0  # time.monotonic() when it took this version

    def busy(self) -> bool:
        return any(not tracker.done for tracker in self.trackers)


class WeightSends:
    """The sends reading one store's weights: from a snapshot slot, or from the live tensor."""

    def __init__(self) -> None:
        # A few fixed slots, reused once ZeroMQ is done with them, so memory does not grow
        # with the number of workers (nor page-faults).
        self._slots: list[SnapshotSlot] = []
        self._last_slot: SnapshotSlot | None = None
        self._in_flight: list[tuple[int, int, zmq.MessageTracker]] = []  # [lo, hi) sent
        self._retired: list[SnapshotSlot] = []  # see RETIRED_SLOTS
        # Waits for a stalled peer's sends that gave up: each held the loop for up to
        # SEND_WAIT_S, unable to read heartbeats, so the caller excuses the silence after.
        self.stalled_waits = 0
        self._warned_stall = 0.0  # when it was last said (once per timeout is enough)

    def slot(self, version: int, sources: list[torch.Tensor]) -> SnapshotSlot | None:
        """A slot holding `sources` at `version` (shared by every pull of it), filled now if
        none does; None when every slot is still being sent."""
        slot = next((s for s in self._slots if s.version == version), None)
        if slot is None:
            slot = next((s for s in self._slots if not s.busy()), None)
            if slot is not None:
                for copy, source in zip(slot.tensors, sources, strict=True):
                    copy.copy_(source)
            elif len(self._slots) < SNAPSHOT_SLOTS or self._retire_stalled_slot():
                slot = SnapshotSlot(-1, [source.clone() for source in sources], [])
                self._slots.append(slot)
            else:
                return None
            slot.version, slot.trackers, slot.filled = version, [], time.monotonic()
        self._last_slot = slot
        return slot

    def forget_slots(self) -> None:
        """The weights changed under every slot (a resume): none may be sent again."""
        self._slots, self._last_slot = [], None

    def _retire_stalled_slot(self) -> bool:
        """Give up on the oldest slot busy for over SEND_WAIT_S (its sends go to a peer that
        stopped reading), so that the other workers' pulls do not wait for ever; at most
        RETIRED_SLOTS at once. Whether one was given up on."""
        self._retired = [slot for slot in self._retired if slot.busy()]
        oldest = min(self._slots, key=lambda slot: slot.filled)
        if len(self._retired) >= RETIRED_SLOTS or time.monotonic() - oldest.filled < SEND_WAIT_S:
            return False
        stalled_s = time.monotonic() - oldest.filled
        log.warning(
            "a copy of the weights (step %d) is still being sent after %.0f s: a worker stopped "
            "reading; a fresh copy takes its place", oldest.version, stalled_s,
        )  # fmt: skip
        self._slots.remove(oldest)
        self._retired.append(oldest)
        return True

    def track(self, trackers: list[zmq.MessageTracker], lo: int, hi: int, live: bool) -> None:
        """Sends of what the last `slot` gave, or (`live`, or no slot yet) of [lo, hi) of the
        live weights."""
        if live or self._last_slot is None:
            self._in_flight.extend((lo, hi, tracker) for tracker in trackers)
        else:
            self._last_slot.trackers.extend(trackers)

    def wait(self, lo: int, hi: int, timeout_s: float, deadline: float | None) -> None:
        """Block until ZeroMQ has finished with every live send that overlaps [lo, hi), for at
        most `timeout_s`, or until `deadline` (time.monotonic()) when several waits share one
        budget."""
        pending = [t for t in self._in_flight if not t[2].done]
        self._in_flight = [t for t in pending if t[1] <= lo or t[0] >= hi]  # not ours
        waited = [tracker for start, stop, tracker in pending if start < hi and stop > lo]
        if not waited:
            return
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        for tracker in waited:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                # A stalled peer: its weights may change mid-send; its gradient will be late
                # and dropped, so the torn copy is never applied.
                if not self.stalled_waits or time.monotonic() - self._warned_stall > timeout_s:
                    log.warning(
                        "weights still in flight to a stalled worker after %.1f s", timeout_s
                    )
                    self._warned_stall = time.monotonic()
                self.stalled_waits += 1
                return
