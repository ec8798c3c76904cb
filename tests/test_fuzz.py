"""Fuzzing a live server: twenty thousand random and mutated messages from several sockets.

Every message must get exactly one reply, and the reply must be the one a local `decode` of the
same frames predicts: `bad-message` for frames the decoder refuses (and for a Register whose
process identity is empty or too long), `model-mismatch` or WELCOME for a Register,
`unknown-worker` for a request with a guessed token, `unexpected-message` for a server-to-worker
type, STATUS_REPLY for a STATUS. Nothing may be an `internal` error.
Afterwards a real worker trains to the end beside the fake workers the valid Registers created
(they never pull and die after 2 s).

The generator is seeded (SEED): a failure names the message index, and rerunning reproduces it.
"""

import collections
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch
import zmq

from common.catalog import all_fingerprints
from common.errors import ProtocolError
from common.wire.protocol import (
    PROTOCOL_VERSION,
    SHARD,
    WIRE_DTYPES,
    Commit,
    Error,
    Heartbeat,
    HeartbeatAck,
    Leave,
    Message,
    MessageType,
    Pull,
    Push,
    PushAck,
    PushReady,
    Register,
    Roster,
    Status,
    StatusReply,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.coordinator.admission import MAX_PROCESS_CHARS
from tests.harness import Cluster

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

SEED = 20240611
MESSAGES = 20_000
SOCKETS = 8
WINDOW = 48  # messages in flight per socket before its replies are read
REPLY_TIMEOUT_MS = 20_000
LENET_PARAMS = 129_068  # checked against the WELCOME's job description below

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 255, 256, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1]
INTERESTING_INTS += [2**63 - 1, -(2**63), 2**64 - 1]
INTERESTING_FLOATS = [0.0, -0.0, 1.5, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324]
TEXT = "abcxyz019 _-.:%{}\n\t\0éü☃\U0001f600€"
# Raw msgpack that no packer produces: nesting past the decoder's and Python's recursion
# limits, strings that are not UTF-8, non-string map keys, lengths far beyond the frame.
RAW_VALUES = [
    b"\x91" * 1000 + b"\xc0",  # a list in a list ... 1000 deep
    b"\x91" * 2000 + b"\xc0",
    b"\x81\xa1k" * 900 + b"\xc0",  # maps 900 deep
    b"\xa2\xff\xfe",  # str with invalid UTF-8
    b"\x81\x01\x02",  # map with an int key
    b"\x81\xc0\x02",  # map with a nil key
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G elements
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 G entries
    b"\xd4\x01\x00",  # fixext1
    b"\xd5\xff\x00\x00",  # timestamp ext with an impossible length
    b"\xd6\xff\x00\x00\x00\x01",  # a valid timestamp
    b"\xca\x7f\xc0\x00\x00",  # float32 NaN
    b"\xc1",  # the one reserved byte
    b"",  # nothing at all
]


@dataclass
class Case:
    index: int
    label: str
    frames: list[bytes]
    expected: set[str]  # acceptable reply outcomes, e.g. {"error:bad-message"}


class Fuzzer:
    """Makes fuzz messages and predicts the server's reply to each with a local decode."""

    def __init__(self, seed: int, fingerprints: dict[str, str], num_params: int) -> None:
        self.rng = random.Random(seed)
        self.fingerprints = fingerprints
        self.num_params = num_params
        self.tokens: dict[int, str] = {}  # fake workers our valid Registers created
        self.decoder_crashes: list[str] = []  # decode raised something else than ProtocolError

    # ---- random values ---------------------------------------------------------------------

    def text(self, longest: int = 40) -> str:
        return "".join(self.rng.choice(TEXT) for _ in range(self.rng.randint(0, longest)))

    def value(self, depth: int = 0) -> Any:
        kind = self.rng.randrange(10 if depth < 3 else 7)
        if kind == 0:
            return None
        if kind == 1:
            return self.rng.random() < 0.5
        if kind == 2:
            return self.rng.choice([*INTERESTING_INTS, self.rng.randint(-1000, 1000)])
        if kind == 3:
            return self.rng.choice([*INTERESTING_FLOATS, self.rng.uniform(-1e6, 1e6)])
        if kind == 4:
            return self.rng.choice([self.text(), "x" * self.rng.randint(100, 5000)])
        if kind == 5:
            return self.rng.randbytes(self.rng.randint(0, 64))
        if kind == 6:
            ext = msgpack.ExtType(self.rng.randint(0, 127), self.rng.randbytes(4))
            return self.rng.choice([ext, msgpack.Timestamp(self.rng.randint(0, 2**32), 0)])
        if kind in (7, 8):
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        keys = [self.text(8) if self.rng.random() < 0.7 else self.rng.randbytes(3) for _ in "ab"]
        return {key: self.value(depth + 1) for key in keys}

    def worker_id(self) -> int:
        if self.tokens and self.rng.random() < 0.4:
            return self.rng.choice(list(self.tokens))
        return self.rng.choice([*INTERESTING_INTS[:-1], self.rng.randint(1, 2000)])

    def token(self) -> str:
        """Never a real token (a mutation could pair it with its worker's id): random hex,
        empty, non-ASCII, long."""
        choices = [
            self.rng.randbytes(16).hex(),
            "",
            self.text(),
            "ö" * 32,
            "a" * self.rng.randint(33, 20_000),
        ]
        return self.rng.choice(choices)

    def tensor(self, numel: int | None = None) -> torch.Tensor:
        if numel is None:
            numel = self.rng.choice(
                [0, 1, 2, 3, self.num_params - 1, self.num_params + 1, self.rng.randint(4, 999)]
            )
        dtype = self.rng.choice(list(WIRE_DTYPES.values()))
        return torch.zeros(numel, dtype=dtype)

    # ---- messages --------------------------------------------------------------------------

    def valid_message(self) -> tuple[str, Message]:
        rng = self.rng
        kind = rng.choice(list(MessageType))
        if kind is MessageType.REGISTER and rng.random() < 0.3:  # a follower shard's
            ints = [rng.choice(INTERESTING_INTS) for _ in range(2)]
            register = Register(
                shard=ints[0] or 1, num_shards=ints[1], endpoint=self.text(),
                fingerprints=self.fingerprints, proof=rng.choice(["", self.token()]),
            )  # fmt: skip
            return "shard-register", register
        if kind is MessageType.REGISTER:
            fingerprints = dict(self.fingerprints)
            if rng.random() < 0.3:
                fingerprints["lenet"] = rng.choice(["0" * 16, "", self.text()])
            pid = rng.choice(INTERESTING_INTS)
            process = rng.choice([rng.randbytes(8).hex(), self.text(), "", "f" * 65])
            register = Register(self.text(), self.text(), self.text(), pid, process, fingerprints)
            return "register", register
        if kind is MessageType.PULL:
            ints = [rng.choice(INTERESTING_INTS) for _ in range(3)]
            shard = rng.choice([0, 0, 0, ints[0]])  # another shard's: refused as such
            pull = Pull(self.worker_id(), self.token(), ints[1], shard, ints[2], rng.random() < 0.5)
            return "pull", pull
        if kind is MessageType.HEARTBEAT:
            return "heartbeat", Heartbeat(self.worker_id(), self.token())
        if kind is MessageType.LEAVE:
            return "leave", Leave(self.worker_id(), self.token(), self.text())
        if kind is MessageType.PUSH:
            full = rng.random() < 0.1  # the right size: only the token is wrong
            grads = torch.zeros(self.num_params) if full else self.tensor()
            ints = [rng.choice(INTERESTING_INTS) for _ in range(5)]
            push = Push(
                worker_id=self.worker_id(),
                token=self.token(),
                version=ints[0],
                epoch=ints[1],
                batch=ints[2],
                samples=ints[3],
                loss_sum=rng.choice(INTERESTING_FLOATS),
                correct=ints[4],
                grads=grads,
                grad_indices=torch.empty(0, dtype=torch.int32),
                buffers=self.tensor(rng.choice([0, 0, 1, 5])),
                parts=rng.choice([0, 0, 0, rng.choice(INTERESTING_INTS)]),
                shard=rng.choice([0, 0, 0, rng.choice(INTERESTING_INTS)]),
                # A bucket's PUSH is never answered; -1 (and garbage below it) is.
                bucket=rng.choice([-1, -1, -1, rng.randint(-3, 3)]),
            )
            return "push", push
        if kind is MessageType.WELCOME and rng.random() < 0.3:  # a follower shard's
            welcome = Welcome(
                shard=1, leader_token=self.token(), slice_wait=1.0, max_staged=1,
                params=self.tensor(), momentum=self.tensor(),
            )  # fmt: skip
            return "shard-welcome", welcome
        if kind is MessageType.WELCOME:
            return "welcome", Welcome(1, self.token(), 1.0, {"mode": self.value()})
        if kind is MessageType.WEIGHTS:
            ints = [rng.choice(INTERESTING_INTS) for _ in range(7)]
            weights = Weights(
                *ints[:5], rng.random() < 0.5, self.tensor(), self.tensor(), rng.random() < 0.5,
                ints[5], ints[6], self.tensor(),
            )  # fmt: skip
            return "weights", weights
        if kind is MessageType.PUSH_ACK:
            ack = PushAck(rng.randint(0, 9), rng.randint(0, 9), rng.random() < 0.5, 1)
            return "push-ack", ack
        if kind is MessageType.STOP:
            return "stop", Stop(self.text())
        if kind is MessageType.ERROR:
            return "error", Error(self.text(), self.text())
        if kind is MessageType.STATUS:
            return "status", Status()
        if kind is MessageType.STATUS_REPLY:
            return "status-reply", StatusReply({"step": self.value()})
        return self.shard_message(kind) or ("heartbeat-ack", HeartbeatAck(rng.randint(0, 9)))

    def shard_message(self, kind: MessageType) -> tuple[str, Message] | None:
        """The sharding messages, which an unsharded server must refuse one by one."""
        rng, ints = self.rng, [self.rng.choice(INTERESTING_INTS) for _ in range(4)]
        if kind is MessageType.COMMIT and rng.random() < 0.5:  # the plan of a sync step
            plan = [[self.worker_id(), self.token(), ints[2]]]
            return "commit-plan", Commit(self.token(), ints[0], [], ints[3], 1.0, *ints[1:3], plan)
        if kind is MessageType.COMMIT:
            entries = [[self.worker_id(), self.token(), *ints]]
            return "commit", Commit(self.token(), ints[0], entries, ints[1], rng.random())
        if kind is MessageType.PUSH_READY:
            return "push-ready", PushReady(self.worker_id(), self.token())
        if kind is MessageType.ROSTER:
            return "roster", Roster(self.token(), [self.worker_id(), ints[0]], ints[1])
        return None

    def random_frames(self) -> list[bytes]:
        rng = self.rng
        frames = []
        for _ in range(rng.randint(1, 4)):
            size = rng.choice([0, 1, rng.randint(2, 64), rng.randint(64, 4096)])
            prefix = rng.choice([b"", b"\x84", b"\x84\xa1v\x01", b"\x84\xa4type"])
            frames.append((prefix + rng.randbytes(size))[: max(size, len(prefix))])
        return frames

    def next_case(self, index: int) -> Case:
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            label, frames = "random-frames", self.random_frames()
        elif roll < 0.22 and len(self.tokens) > 1:
            # Real tokens are only ever sent intact. With its own worker's id, a heartbeat is
            # acknowledged and a leave obeyed, unless that fake worker was already declared
            # dead (2 s of silence) or left; with another worker's id, nothing is accepted.
            worker_id, other = rng.sample(sorted(self.tokens), 2)
            token = self.tokens[worker_id]
            kind = rng.random()
            if kind < 0.5:
                label, message = "heartbeat-valid", Heartbeat(worker_id, token)
                expected = {"heartbeat-ack", "error:unknown-worker"}
            elif kind < 0.7:
                label, message = "leave-valid", Leave(worker_id, token, self.text())
                expected = {"stop", "error:unknown-worker"}
            else:
                label = "another-workers-token"
                message = rng.choice([Pull(other, token), Heartbeat(other, token)])
                expected = {"error:unknown-worker"}
            return Case(index, label, [bytes(f) for f in encode(message)], expected)
        else:
            label, message = self.valid_message()
            frames = [bytes(f) for f in encode(message)]
            if rng.random() < 0.8:
                names = []
                for _ in range(rng.choice([1, 1, 1, 2, 3])):
                    name, mutate = rng.choice(MUTATIONS)
                    frames = mutate(self, frames)
                    names.append(name)
                label += "+" + "+".join(names)
        return Case(index, label, frames, self.predict(frames))

    def predict(self, frames: list[bytes]) -> set[str]:
        try:
            message = decode(frames)
        except ProtocolError:
            return {"error:bad-message"}
        except Exception as exc:  # decode must raise ProtocolError, nothing else
            self.decoder_crashes.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return {"error:bad-message"}
        if isinstance(message, Register) and message.form == SHARD:
            return {"error:bad-shard"}  # this server runs without shards
        if isinstance(message, Register):
            if not 0 < len(message.process) <= MAX_PROCESS_CHARS:
                return {"error:bad-message"}  # names no process: refused before anything else
            ok = message.fingerprints.get("lenet") == self.fingerprints["lenet"]
            return {"welcome"} if ok else {"error:model-mismatch"}
        if isinstance(message, Status):
            return {"status-reply"}
        if isinstance(message, Push) and message.bucket >= 0:
            return {NO_REPLY}  # a bucket is never answered; a known worker hears at its PUSH
        if isinstance(message, Pull) and message.shard != 0:
            return {"error:wrong-shard"}  # whoever sends it: it is for another server
        if isinstance(message, (Pull, Push, PushReady, Heartbeat, Leave)):
            # Real tokens are only ever sent intact (above), never in a fuzzed message.
            assert message.token not in self.tokens.values(), "fuzzer sent a real token"
            return {"error:unknown-worker"}
        return {"error:unexpected-message"}


# ---- mutations: each takes frames and returns new frames ---------------------------------


def flip_bytes(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    header = bytearray(frames[0])
    for _ in range(f.rng.randint(1, 4)):
        if header:
            header[f.rng.randrange(len(header))] ^= 1 << f.rng.randrange(8)
    return [bytes(header), *frames[1:]]


def truncate_header(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    return [frames[0][: f.rng.randrange(len(frames[0]) + 1)], *frames[1:]]


def resize_tensor_frame(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    if len(frames) < 2:
        return [*frames, f.rng.randbytes(f.rng.randint(0, 16))]
    i = f.rng.randrange(1, len(frames))
    frames = list(frames)
    if f.rng.random() < 0.5:
        frames[i] = frames[i][: f.rng.randrange(len(frames[i]) + 1)]
    else:
        frames[i] += bytes(f.rng.choice([1, 2, 4, 7]))
    return frames


def drop_frame(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    if len(frames) < 2:
        return [b""]
    frames = list(frames)
    del frames[f.rng.randrange(len(frames))]
    return frames


def duplicate_frame(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    i = f.rng.randrange(len(frames))
    return [*frames[: i + 1], frames[i], *frames[i + 1 :]]


def extra_frame(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    return [*frames, f.rng.randbytes(f.rng.choice([0, 1, 8, 100]))]


def swap_frames(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    f.rng.shuffle(frames)
    return frames


def _header(frames: list[bytes]) -> dict | None:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:  # an earlier mutation broke it: nothing to edit
        return None
    return header if isinstance(header, dict) else None


def _edit_header(f: Fuzzer, frames: list[bytes], edit: Callable[[dict], None]) -> list[bytes]:
    header = _header(frames)
    if header is None:
        return flip_bytes(f, frames)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _field_owner(f: Fuzzer, header: dict) -> dict | list:
    """The header itself, its body, or one of its tensor specs."""
    owners: list[dict | list] = [header]
    if isinstance(header.get("body"), dict) and header["body"]:
        owners += [header["body"]] * 3
    if isinstance(header.get("tensors"), list):
        owners += [s for s in header["tensors"] if isinstance(s, list) and s]
    return f.rng.choice(owners)


def replace_field(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    def edit(header: dict) -> None:
        owner = _field_owner(f, header)
        if isinstance(owner, dict) and owner:
            owner[f.rng.choice(list(owner))] = f.value()
        elif isinstance(owner, list) and owner:
            owner[f.rng.randrange(len(owner))] = f.value()

    return _edit_header(f, frames, edit)


def delete_or_add_field(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    def edit(header: dict) -> None:
        owner = _field_owner(f, header)
        if isinstance(owner, dict) and owner and f.rng.random() < 0.5:
            del owner[f.rng.choice(list(owner))]
        elif isinstance(owner, dict):
            owner[f.rng.choice([f.text(8), f.rng.randbytes(2)])] = f.value()
        elif owner and f.rng.random() < 0.5:
            owner.pop()
        else:
            owner.append(f.value())

    return _edit_header(f, frames, edit)


def wrong_version(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    versions = [0, PROTOCOL_VERSION + 1, -1, 2**64 - 1, 1.0, "1", True, None, [1], b"\x01"]

    def edit(header: dict) -> None:
        header["v"] = f.rng.choice(versions)

    return _edit_header(f, frames, edit)


def wrong_type(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    types = [0, 14, 99, -1, 2**63 - 1, 3.0, "3", True, None, *range(1, 14)]

    def edit(header: dict) -> None:
        header["type"] = f.rng.choice(types)

    return _edit_header(f, frames, edit)


def splice_raw(f: Fuzzer, frames: list[bytes]) -> list[bytes]:
    """Pack the header by hand with one value replaced by raw msgpack bytes."""
    header = _header(frames)
    if header is None:
        return truncate_header(f, frames)
    raw = f.rng.choice(RAW_VALUES)
    into_body = isinstance(header.get("body"), dict) and header["body"] and f.rng.random() < 0.6
    target = header["body"] if into_body else header
    key = f.rng.choice(list(target)) if target else None

    def pack(mapping: dict) -> bytes:
        packer = msgpack.Packer(use_bin_type=True)
        out = packer.pack_map_header(len(mapping))
        for k, v in mapping.items():
            out += packer.pack(k)
            if mapping is target and k == key:
                out += raw
            elif mapping is header and k == "body" and into_body:
                out += pack(v)
            else:
                out += packer.pack(v)
        return out

    return [pack(header), *frames[1:]]


MUTATIONS = [
    ("flip", flip_bytes),
    ("truncate-header", truncate_header),
    ("resize-tensor", resize_tensor_frame),
    ("drop-frame", drop_frame),
    ("duplicate-frame", duplicate_frame),
    ("extra-frame", extra_frame),
    ("swap-frames", swap_frames),
    ("replace-field", replace_field),
    ("replace-field", replace_field),
    ("replace-field", replace_field),
    ("delete-or-add-field", delete_or_add_field),
    ("wrong-version", wrong_version),
    ("wrong-type", wrong_type),
    ("splice-raw", splice_raw),
    ("splice-raw", splice_raw),
]


NO_REPLY = "no-reply"


def outcome(reply: Message) -> str:
    if isinstance(reply, Error):
        return f"error:{reply.code}"
    names = {
        Welcome: "welcome",
        HeartbeatAck: "heartbeat-ack",
        Stop: "stop",
        StatusReply: "status-reply",
    }
    return names.get(type(reply), type(reply).__name__)


def fuzz(
    context: zmq.Context, endpoint: str, fuzzer: Fuzzer, count: int
) -> tuple[collections.Counter[str], list[str]]:
    """Send `count` fuzz cases over SOCKETS sockets, a window at a time; check every reply."""
    sockets = []
    for _ in range(SOCKETS):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        sockets.append(socket)
    outcomes: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    sent = 0
    try:
        while sent < count:
            in_flight: list[list[Case]] = [[] for _ in sockets]
            for _ in range(min(SOCKETS * WINDOW, count - sent)):
                case = fuzzer.next_case(sent)
                in_flight[sent % SOCKETS].append(case)
                sockets[sent % SOCKETS].send_multipart(case.frames)
                sent += 1
            # A DEALER hears the server's replies in the order it sent the requests.
            for socket, cases in zip(sockets, in_flight, strict=True):
                for case in cases:
                    if case.expected == {NO_REPLY}:
                        outcomes[NO_REPLY] += 1
                        continue
                    if not socket.poll(REPLY_TIMEOUT_MS):
                        raise AssertionError(
                            f"no reply within {REPLY_TIMEOUT_MS} ms to fuzz message "
                            f"{case.index} ({case.label}), expected {case.expected}"
                        )
                    reply = decode(socket.recv_multipart())
                    got = outcome(reply)
                    outcomes[got] += 1
                    if isinstance(reply, Welcome):
                        fuzzer.tokens[reply.worker_id] = reply.token
                        assert reply.job["num_params"] == fuzzer.num_params, reply.job
                    if got not in case.expected:
                        detail = reply.message if isinstance(reply, Error) else reply
                        wrong.append(
                            f"message {case.index} ({case.label}): expected {case.expected}, "
                            f"got {got}: {str(detail)[:300]}; header {case.frames[0][:120]!r}"
                        )
        for socket in sockets:
            assert not socket.poll(200), "a reply arrived that no message asked for"
    finally:
        for socket in sockets:
            socket.close(linger=0)
    return outcomes, wrong


def test_server_answers_every_fuzzed_message_and_still_trains(
    cluster: Cluster, zmq_context: zmq.Context, record_property: Callable[[str, Any], None]
) -> None:
    summary_path = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        "--mode",
        "sync",
        "--model",
        "lenet",
        "--workers",
        "1",
        "--max-workers",
        "100000",  # valid fuzzed Registers add fake workers
        "--worker-timeout",
        "2",  # ... which never pull and are declared dead after 2 s
        "--train-limit",
        "256",
        "--batch-size",
        "32",
        "--test-limit",
        "100",
        "--summary",
        str(summary_path),
    )
    fuzzer = Fuzzer(SEED, all_fingerprints(), LENET_PARAMS)

    # An oversized message is dropped by ZeroMQ (MAXMSGSIZE) before the server sees it: it is
    # sent on its own socket (ZeroMQ closes that connection) and must get no reply.
    flooder = zmq_context.socket(zmq.DEALER)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect(endpoint)
    oversized = [bytes(encode(Pull(1, "x"))[0]), bytes(4 * LENET_PARAMS + (1 << 20) + 1)]
    flooder.send_multipart(oversized)

    started = time.monotonic()
    outcomes, wrong = fuzz(zmq_context, endpoint, fuzzer, MESSAGES)
    seconds = time.monotonic() - started
    replies = sum(outcomes.values())
    print(
        f"fuzzed {MESSAGES} messages from {SOCKETS} sockets in {seconds:.1f} s "
        f"({MESSAGES / seconds:.0f}/s), {replies} replies: {dict(outcomes.most_common())}"
    )
    record_property("fuzz_messages", MESSAGES)
    record_property("fuzz_seconds", round(seconds, 2))
    assert not flooder.poll(200), "the oversized message got a reply"
    flooder.close(linger=0)

    problems = []
    if fuzzer.decoder_crashes:
        crashes = collections.Counter(fuzzer.decoder_crashes)
        problems.append(f"decode raised something other than ProtocolError: {dict(crashes)}")
    if wrong:
        problems.append(f"{len(wrong)} unexpected replies, e.g.:\n" + "\n".join(wrong[:10]))
    assert not problems, f"fuzz seed {SEED}: " + "\n".join(problems)
    assert replies == MESSAGES
    assert outcomes["welcome"] > 0 and outcomes["error:bad-message"] > MESSAGES // 2, outcomes

    # The job still runs: one real worker trains its epoch (256 / 32 = 8 steps) to the end.
    worker = cluster.start_worker(endpoint)
    cluster.wait(worker, timeout=90)
    cluster.wait(server, timeout=60)
    summary = json.loads(summary_path.read_text())
    assert summary["global_steps"] == 8
    stderr = server.stderr()
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-4000:]
