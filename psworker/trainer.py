"""The worker loop: register, then pull weights -> compute a gradient -> push, until STOP.

The worker holds no training state of its own: the server says which epoch and batch to
compute, and the worker draws it from its DistributedSampler-style shard. Parameters,
gradients and BatchNorm buffers live in flat tensors on the worker's device (see
`common.flat`), so a pull is one host-to-device copy and a push one device-to-host copy.
"""

import dataclasses
import logging
import os
import socket

import torch
from torch import nn

from common.data import DataSource, ImageSet, batch_slice, load_split, shard_indices
from common.errors import DataError, PSError, ServerError
from common.flat import FlatModel
from common.job import JobSpec
from common.models import all_fingerprints, build_model
from common.protocol import Leave, Pull, Push, PushAck, Register, Stop, Weights, Welcome
from psworker.client import ServerConnection
from psworker.progress import Progress

log = logging.getLogger("ps.worker")


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    steps: int
    samples: int
    stop_reason: str


class Worker:
    def __init__(
        self,
        connection: ServerConnection,
        device: torch.device,
        source: DataSource,
        name: str,
        progress_mode: str = "auto",
    ) -> None:
        self.connection, self.device, self.source = connection, device, source
        self.name, self.progress_mode = name, progress_mode

    def run(self) -> WorkerResult:
        welcome = self.connection.request(
            Register(
                self.name, socket.gethostname(), str(self.device), os.getpid(), all_fingerprints()
            )
        )
        if isinstance(welcome, Stop):
            return WorkerResult(0, 0, welcome.reason)
        if not isinstance(welcome, Welcome):
            raise ServerError(f"expected WELCOME after registering, got {type(welcome).__name__}")
        job = JobSpec.from_dict(welcome.job)
        log.info(
            "registered as worker %d, rank %d/%d: %s %s, batch %d, %s on %s",
            welcome.worker_id,
            welcome.rank,
            job.world_size,
            job.mode,
            job.model,
            job.batch_size,
            job.dataset,
            self.device,
        )
        try:
            model = build_model(job.model).to(self.device)
            model.train()
            flat = FlatModel(model)
            if (flat.num_params, flat.num_buffers) != (job.num_params, job.num_buffers):
                raise ServerError(
                    f"the server's {job.model} has {job.num_params} parameters, this worker's "
                    f"{flat.num_params}; install the same release on both"
                )
            train = self._load_training_set(job)
        except PSError as exc:
            self._leave(welcome.worker_id, str(exc))
            raise
        return self._train(welcome, job, model, flat, train)

    def _leave(self, worker_id: int, reason: str) -> None:
        """Give the rank back so that another worker can take it; best effort."""
        try:
            self.connection.request(Leave(worker_id, reason))
        except PSError as exc:
            log.warning("could not tell the server that this worker leaves: %s", exc)

    def _load_training_set(self, job: JobSpec) -> ImageSet:
        if self.source.dataset != job.dataset:
            if job.dataset == "fashion-mnist" and self.source.data_dir is None:
                raise DataError(
                    "the server trains on fashion-mnist: give this worker --data-dir DIR with "
                    "the files in DIR/FashionMNIST/raw (add --download to fetch them)"
                )
            self.source = DataSource(job.dataset, self.source.data_dir, self.source.download)
        data = load_split(self.source, train=True, limit=job.train_limit)
        if len(data) != job.train_size:
            raise DataError(
                f"this worker's training set has {len(data)} images, the server's "
                f"{job.train_size}; point both at the same data"
            )
        # The whole set goes to the device once; a batch is then an index, not a copy.
        return ImageSet(data.images.to(self.device), data.labels.to(self.device))

    def _train(
        self, welcome: Welcome, job: JobSpec, model: nn.Module, flat: FlatModel, train: ImageSet
    ) -> WorkerResult:
        worker_id = welcome.worker_id
        total = job.epochs * job.steps_per_epoch
        if job.max_steps is not None:
            per_worker = (
                job.max_steps if job.mode == "sync" else -(-job.max_steps // job.world_size)
            )
            total = min(total, per_worker)
        progress = Progress(self.progress_mode, total, f"rank {welcome.rank}")
        shard_epoch, shard = -1, torch.empty(0, dtype=torch.long)
        steps = samples = 0
        try:
            while True:
                reply = self.connection.request(Pull(worker_id))
                if isinstance(reply, Stop):
                    return WorkerResult(steps, samples, reply.reason)
                if not isinstance(reply, Weights):
                    raise ServerError(f"expected WEIGHTS, got {type(reply).__name__}")
                flat.params.copy_(reply.params)
                flat.buffers.copy_(reply.buffers)
                if reply.epoch != shard_epoch:
                    shard_epoch = reply.epoch
                    shard = shard_indices(
                        job.train_size, reply.epoch, job.seed, reply.rank, reply.world_size
                    ).to(self.device)
                indices = batch_slice(shard, reply.batch, job.batch_size)
                loss_sum, correct = self._compute_gradient(model, flat, train, indices)
                ack = self.connection.request(
                    Push(
                        worker_id,
                        reply.version,
                        reply.epoch,
                        reply.batch,
                        len(indices),
                        loss_sum,
                        correct,
                        flat.grads.cpu(),
                        flat.buffers.cpu(),
                    )
                )
                steps, samples = steps + 1, samples + len(indices)
                progress.update(reply.epoch, reply.batch, len(indices), loss_sum)
                if isinstance(ack, Stop):
                    return WorkerResult(steps, samples, ack.reason)
                if not isinstance(ack, PushAck):
                    raise ServerError(f"expected PUSH_ACK, got {type(ack).__name__}")
        finally:
            progress.close()

    def _compute_gradient(
        self, model: nn.Module, flat: FlatModel, train: ImageSet, indices: torch.Tensor
    ) -> tuple[float, int]:
        images, labels = train.images[indices], train.labels[indices]  # (B, 1, 28, 28), (B,)
        flat.zero_grad()
        logits = model(images)  # (B, 10)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()  # fills flat.grads through the per-parameter views
        correct = (logits.argmax(dim=1) == labels).sum()
        # .item() is a device sync point; the push needs the gradient on the host anyway.
        return loss.item() * len(indices), int(correct.item())


def run_worker(
    endpoint: str,
    device: torch.device,
    source: DataSource,
    name: str,
    timeout_s: float,
    progress_mode: str,
) -> WorkerResult:
    connection = ServerConnection(endpoint, timeout_s)
    try:
        return Worker(connection, device, source, name, progress_mode).run()
    except PSError:
        raise
    finally:
        connection.close()
