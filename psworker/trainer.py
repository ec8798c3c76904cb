"""The worker loop: register, then pull weights -> compute a gradient -> push, until STOP.

The worker holds no training state of its own: the server says which epoch and batch to
compute and which shard (rank of world size) to draw it from. Parameters, gradients and
BatchNorm buffers live in flat tensors on the worker's device (see `common.model.flat`), so a pull
is one host-to-device copy and a push one device-to-host copy.

When the server forgets the worker (it restarted, or declared the worker dead) the worker
registers again and carries on; when asked to shut down (SIGTERM, Ctrl-C) it finishes the
current step and leaves the job politely.
"""

import dataclasses
import logging
import math
import threading
import time
from pathlib import Path

import torch
from torch import nn

from common.catalog import load_training_set
from common.compression import CompressionSpec, GradientCompressor
from common.cpu_share import CpuShare
from common.data import DataSource, ImageSet
from common.device import device_failure
from common.errors import DataError, DeviceError, PSError, ServerError, TrainingDiverged
from common.job import JobSpec
from common.metrics import MetricsWriter, RateWindow
from common.model.flat import FlatModel
from common.wire.protocol import Stop, Weights
from psworker.batches import BatchPicker, planned_steps, planned_sync_steps
from psworker.connection import (
    MAX_REREGISTRATIONS,
    Connection,
    Interrupted,
    RequestFailed,
    Session,
    model_of,
    new_process_identity,
)
from psworker.progress import Progress, StepTally
from psworker.pusher import GradientPusher, NonFiniteGradient, OutgoingStep

log = logging.getLogger("ps.worker")


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    tally: StepTally
    stop_reason: str
    by_signal: bool = False  # it left because of a shutdown signal, not a STOP from the server


class Worker:
    def __init__(
        self,
        connection: Connection,
        device: torch.device,
        source: DataSource,
        name: str,
        progress_mode: str = "auto",
        step_delay: float = 0.0,
        log_dir: Path | None = None,
        overlap: bool = True,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.connection, self.device, self.source = connection, device, source
        self.cpu_share = cpu_share  # its CPU threads, counted again as roles come and go
        self.overlap = overlap  # send gradient buckets and shard slices during backward
        self.name, self.progress_mode, self.step_delay = name, progress_mode, step_delay
        self.log_dir = log_dir  # per-step metrics, see common.metrics
        self.shutdown = threading.Event()  # set by a signal handler: leave after this step
        # Who this process is to the server, the same in every registration: a worker it
        # forgot and that registers again is still one worker (psserver.status.report).
        self.process = new_process_identity()

    def run(self) -> WorkerResult:
        try:
            session = self.connection.register(self.name, self.device, self.process)
        except Interrupted:  # a signal before the server answered: nothing to leave
            return WorkerResult(StepTally(), "shut down by a signal before joining", by_signal=True)
        if isinstance(session, Stop):
            return WorkerResult(StepTally(), session.reason)
        job = session.job
        try:
            model, flat = model_of(job, self.device)
            train = self._load_training_set(job)
        except PSError as exc:
            self.connection.leave(str(exc))
            raise
        except RuntimeError as exc:  # the device: a GPU that is full, say
            raise self._device_failed(exc) from None
        return self._train(session, model, flat, train)

    def _device_failed(self, exc: RuntimeError) -> DeviceError:
        """Leave the job over a failure of this worker's device, and say what to do; any other
        RuntimeError is a bug, raised again as it is, traceback and all."""
        failure = device_failure(exc, self.device)
        if failure is None:
            raise exc
        self.connection.leave(str(failure))
        return failure

    def _diverged(self, reply: Weights, what: str) -> TrainingDiverged:
        """Leave the job, so that no sync step waits for this worker, and say why it stops.

        A loss that is not finite on finite weights (the server refuses anything else) means
        the weights have diverged; every worker trains the same ones, so going on, or
        pushing the step again, cannot help."""
        where = f"epoch {reply.epoch}, batch {reply.batch} (weights version {reply.version})"
        self.connection.leave(f"training diverged on {where}: {what}")
        return TrainingDiverged(
            f"training diverged on {where}: {what}. Every worker trains the same weights, "
            "so this one stops; the server stops the job when its own test loss is not "
            "finite either. The usual cause is a learning rate too high for the batch: "
            "start again with a lower --lr (an option of ps-server, or ps-local)"
        )

    def _load_training_set(self, job: JobSpec) -> ImageSet:
        if self.source.dataset != job.dataset:
            if job.dataset == "fashion-mnist" and self.source.data_dir is None:
                raise DataError(
                    "the server trains on fashion-mnist: give this worker --data-dir DIR with "
                    "the files in DIR/FashionMNIST/raw (add --download to fetch them)"
                )
            self.source = DataSource(job.dataset, self.source.data_dir, self.source.download)
        data = load_training_set(self.source, job.train_limit)
        if len(data) != job.train_size:
            raise DataError(
                f"this worker's training set has {len(data)} images, the server's "
                f"{job.train_size}; point both at the same data"
            )
        # The whole set goes to the device once; a batch is then an index, not a copy.
        return ImageSet(data.images.to(self.device), data.labels.to(self.device))

    def _train(
        self, session: Session, model: nn.Module, flat: FlatModel, train: ImageSet
    ) -> WorkerResult:
        job = session.job
        progress = Progress(self.progress_mode, planned_steps(job), f"worker {session.worker_id}")
        # The file keeps the first id, also if the worker registers again under another.
        metrics = MetricsWriter(
            self.log_dir, "worker", session.worker_id, job={"mode": job.mode, "model": job.model}
        )
        rate = RateWindow()
        batches = BatchPicker(job, self.device)
        tally = StepTally()
        forgotten = 0  # "unknown-worker" answers since the last step this worker trained
        compressor = GradientCompressor(
            CompressionSpec.parse(job.compress), job.num_params, self.device
        )
        connection = self.connection
        connection.attach(flat)
        pusher = GradientPusher(job, model, flat, compressor, connection, self.overlap)
        try:
            while True:
                if self.shutdown.is_set():
                    self.connection.leave("shut down by a signal")
                    return WorkerResult(
                        tally, "left the job after a shutdown signal", by_signal=True
                    )
                if self.cpu_share is not None:
                    self.cpu_share.recount()
                pushed = False  # whether this step's gradient went out, for take_back
                computing: Weights | None = None  # the pulled weights this step trains on
                try:
                    started = time.perf_counter()
                    reply = connection.pull()
                    if isinstance(reply, Stop):
                        return WorkerResult(tally, reply.reason)
                    indices, computing = batches.pick(reply), reply
                    if job.mode == "sync":  # the position is the job's: count the job's steps
                        progress.set_total(planned_sync_steps(job, reply))
                    pulled = time.perf_counter()
                    loss, loss_sum, correct = self._forward(model, flat, train, indices)
                    if not math.isfinite(loss_sum):  # nothing of it is pushed
                        raise self._diverged(reply, f"the loss is {loss_sum}")
                    if self.step_delay:
                        time.sleep(self.step_delay)  # fault injection: play a straggler
                    outgoing = OutgoingStep(
                        session.worker_id, session.token, reply, len(indices), loss_sum,
                        correct, flat.buffers.cpu(),
                    )  # fmt: skip
                    pushed = True
                    pusher.backward_and_push(loss, outgoing)
                    computed = time.perf_counter()
                    ack = pusher.finish()
                except NonFiniteGradient as exc:  # nothing of it, or no more of it, went out
                    assert computing is not None
                    mean_loss = loss_sum / len(indices)
                    what = f"the loss is finite ({mean_loss:.4g}), but {exc}"
                    raise self._diverged(computing, what) from None
                except RuntimeError as exc:  # out of memory on the GPU, say
                    raise self._device_failed(exc) from None
                except Interrupted as exc:  # a signal during a held pull, or a silent follower
                    log.info("%s; leaving the job", exc)
                    self.connection.leave("shut down by a signal")
                    return WorkerResult(
                        tally, "left the job after a shutdown signal", by_signal=True
                    )
                except RequestFailed as exc:
                    if exc.code == "incomplete-push":  # parts were lost with a connection
                        log.warning("%s; computing the step again", exc)
                        continue
                    if exc.code == "non-finite" and computing is not None:  # finite loss
                        raise self._diverged(computing, str(exc)) from None
                    if exc.code != "unknown-worker":
                        raise
                    log.warning("%s; registering again", exc)
                    forgotten += 1
                    if forgotten > MAX_REREGISTRATIONS:
                        raise ServerError(
                            f"the server forgot this worker {forgotten} times in a row, each "
                            "time before it could train a step; check the server's log"
                        ) from None
                    if pushed:  # the server that took it is gone: top-k keeps what it sent
                        compressor.take_back()
                    try:
                        renewed = connection.register_again(
                            self.name, self.device, self.process, forgotten, self.shutdown
                        )
                    except Interrupted:  # the old registration is gone: nothing to leave
                        return WorkerResult(
                            tally,
                            "shut down by a signal while registering again",
                            by_signal=True,
                        )
                    if isinstance(renewed, Stop):
                        return WorkerResult(tally, renewed.reason)
                    # A restarted server may have another number of shards.
                    session, job = renewed, renewed.job
                    pusher.close()
                    connection.attach(flat)
                    pusher = GradientPusher(job, model, flat, compressor, connection, self.overlap)
                    continue
                if isinstance(ack, Stop):
                    return WorkerResult(tally, ack.reason)
                acked = time.perf_counter()
                metrics.write(
                    "step",
                    ack.version,  # the server's version after this push: ps-plot's x axis
                    reply.epoch,
                    batch=reply.batch,
                    version=reply.version,  # the weights the gradient was computed on
                    samples=len(indices),
                    train_loss=loss_sum / len(indices),
                    train_accuracy=correct / len(indices),
                    images_per_s=rate.add(len(indices)),
                    compute_s=computed - pulled,  # forward and backward (and overlapped sends)
                    comm_s=(pulled - started) + (acked - computed),  # pull, and push not hidden
                    step_time_s=acked - started,
                    staleness=ack.staleness,
                    applied=ack.applied,
                )
                if not ack.applied:
                    compressor.take_back()  # top-k: what it sent stays in the residual
                    log.info(
                        "gradient for step %d was dropped: it came after the step closed, or "
                        "its epoch ended early (too few workers left)",
                        reply.version,
                    )
                    continue
                tally.add(ack.version, len(indices))
                forgotten = 0
                progress.update(
                    tally.position(job.mode, ack.version), reply.epoch, reply.batch,
                    len(indices), loss_sum,
                )  # fmt: skip
        finally:
            pusher.close()
            connection.detach()
            progress.close()
            metrics.close()

    def _forward(
        self, model: nn.Module, flat: FlatModel, train: ImageSet, indices: torch.Tensor
    ) -> tuple[torch.Tensor, float, int]:
        """The loss to call backward on, and the batch's summed loss and correct count."""
        images, labels = train.images[indices], train.labels[indices]  # (B, 1, 28, 28), (B,)
        flat.zero_grad()
        logits = model(images)  # (B, 10)
        loss = nn.functional.cross_entropy(logits, labels)
        correct = (logits.argmax(dim=1) == labels).sum()
        # .item() is a device sync point; the push needs the gradient on the host anyway, and
        # the leader's push (sent first with overlap) carries these numbers.
        return loss, loss.item() * len(indices), int(correct.item())
