"""The parameter server's event loop: one ROUTER socket, one thread, one request at a time.

Every request is decoded and validated before it touches any state; a bad one gets an ERROR
reply and is logged with its header, and the loop keeps serving. All state (store, policy,
membership) is changed on this thread only, so nothing needs a lock.

Lifecycle: bind -> wait for `--workers` registrations (pulls that arrive earlier are held) ->
train until the policy says the run is over -> final evaluation, checkpoint and summary ->
answer every worker's next request with STOP -> exit.
"""

import logging
import time
from typing import Any

import torch
import zmq

from common.data import load_split, steps_per_epoch
from common.errors import ProtocolError, PSError, RequestRejected
from common.job import JobSpec
from common.protocol import (
    Error,
    Leave,
    Message,
    Pull,
    Push,
    PushAck,
    Register,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.checkpoint import load_checkpoint, save_checkpoint
from psserver.config import ServerConfig
from psserver.evaluation import Evaluation, evaluate
from psserver.membership import Membership, WorkerRecord
from psserver.policies import AsyncPolicy, make_policy
from psserver.report import TrainingMeter, build_summary, write_json
from psserver.store import ParameterStore

log = logging.getLogger("ps.server")
POLL_MS = 200


class ParameterServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        source = config.data_source()
        train_size = len(load_split(source, train=True, limit=config.train_limit))
        self.test_set = load_split(source, train=False, limit=config.test_limit)
        self.store = ParameterStore(
            config.model, config.seed, config.lr, config.momentum, config.weight_decay
        )
        self.job = JobSpec(
            mode=config.mode,
            model=config.model,
            dataset=config.dataset,
            world_size=config.workers,
            batch_size=config.batch_size,
            seed=config.seed,
            train_limit=config.train_limit,
            train_size=train_size,
            steps_per_epoch=steps_per_epoch(train_size, config.workers, config.batch_size),
            epochs=config.epochs,
            max_steps=config.max_steps,
            num_params=self.store.num_params,
            num_buffers=self.store.num_buffers,
        )
        self.policy = make_policy(
            config.mode, self.store, self.job, config.epochs, config.max_steps
        )
        self.membership = Membership(config.workers)
        self.meter = TrainingMeter()
        self._held_pulls: list[WorkerRecord] = []
        self._evaluated_epochs = 0
        self._last_eval: tuple[int, Evaluation] | None = None
        if config.resume:
            self._resume()
        self.context = zmq.Context()
        self.socket = self._bind()

    def _bind(self) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # Nothing legitimate is bigger than one flat tensor plus a header.
        socket.setsockopt(zmq.MAXMSGSIZE, 4 * self.store.num_params + (1 << 20))
        try:
            socket.bind(self.config.bind)
        except zmq.ZMQError as exc:
            socket.close()
            raise PSError(
                f"cannot bind {self.config.bind}: {exc}; pick a free port or another address"
            ) from None
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "listening on %s: %s mode, %s, %d workers, %d steps per epoch, batch %d per worker",
            endpoint,
            self.config.mode,
            self.config.model,
            self.config.workers,
            self.job.steps_per_epoch,
            self.config.batch_size,
        )
        if self.config.endpoint_file is not None:
            self.config.endpoint_file.write_text(endpoint + "\n")
        return socket

    def _resume(self) -> None:
        assert self.config.checkpoint_dir is not None
        state = load_checkpoint(self.config.checkpoint_dir)
        saved = state["config"]
        for key in ("model", "mode", "workers", "batch_size", "dataset", "train_limit", "seed"):
            if saved.get(key) != getattr(self.config, key):
                raise PSError(
                    f"cannot resume: the checkpoint was made with {key}={saved.get(key)!r}, this "
                    f"run has {key}={getattr(self.config, key)!r}; use the same options"
                )
        self.store.load_state_dict(
            {"model": state["model"], "optimizer": state["optimizer"], "version": state["step"]}
        )
        self.policy.restore(self.store.version)
        self._evaluated_epochs = self.policy.completed_epochs()
        log.info("resumed from step %d (epoch %d)", self.store.version, self._evaluated_epochs)

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            while not self.policy.finished():
                self._serve_once()
            self.meter.finished = time.monotonic()
            summary = self._finish()
            self._drain()
            return summary
        finally:
            self.socket.close(linger=0)
            self.context.term()

    def _serve_once(self) -> None:
        if not self.socket.poll(POLL_MS):
            return
        frames = self.socket.recv_multipart(copy=False)
        identity, payload = frames[0].bytes, frames[1:]
        header_preview = bytes(payload[0].buffer[:200]) if payload else b""
        try:
            self._handle(identity, decode([f.buffer for f in payload]))
        except (ProtocolError, RequestRejected) as exc:
            code = exc.code if isinstance(exc, RequestRejected) else "bad-message"
            log.warning("rejected a request (%s): %s; header %r", code, exc, header_preview)
            self._send(identity, Error(code=code, message=str(exc)))
        except Exception as exc:  # a bug must not take the whole job down
            log.exception("internal error while handling a request; header %r", header_preview)
            self._send(identity, Error(code="internal", message=f"server error: {exc}"))

    def _send(self, identity: bytes, message: Message) -> None:
        self.socket.send_multipart([identity, *encode(message)], copy=False)

    def _handle(self, identity: bytes, message: Message) -> None:
        if isinstance(message, Register):
            self._on_register(identity, message)
        elif isinstance(message, Pull):
            self._on_pull(self.membership.lookup(message.worker_id, identity))
        elif isinstance(message, Push):
            self._on_push(self.membership.lookup(message.worker_id, identity), message)
        elif isinstance(message, Leave):
            self.membership.leave(
                self.membership.lookup(message.worker_id, identity), message.reason
            )
            self._send(identity, Stop("left the job"))
        else:
            raise RequestRejected(
                "unexpected-message", f"a server does not accept {type(message).__name__}"
            )

    # ---- requests --------------------------------------------------------------------------

    def _on_register(self, identity: bytes, request: Register) -> None:
        theirs = request.fingerprints.get(self.config.model)
        if theirs != self.store.fingerprint:
            raise RequestRejected(
                "model-mismatch",
                f"the worker builds {self.config.model} with fingerprint {theirs}, the server "
                f"with {self.store.fingerprint}; install the same release on both",
            )
        record = self.membership.register(identity, request)
        self._send(identity, Welcome(record.worker_id, record.rank, self.job.to_dict()))

    def _on_pull(self, worker: WorkerRecord) -> None:
        if not self.membership.complete:
            worker.ready = True
            self._held_pulls.append(worker)  # answered once every worker is ready
            if not self.membership.complete:
                return
            log.info("all %d workers are ready; training starts", self.config.workers)
            self.meter.start()
            held, self._held_pulls = self._held_pulls, []
            for waiting in held:
                self._send_weights(waiting)
            return
        self._send_weights(worker)

    def _send_weights(self, worker: WorkerRecord) -> None:
        assignment = self.policy.next_assignment(worker.worker_id)
        if assignment is None:
            self._send_stop(worker, "this worker's share of the training is done")
            return
        worker.assignment = (assignment.epoch, assignment.batch)
        version, params, buffers = self.store.snapshot()
        self._send(
            worker.identity,
            Weights(
                version,
                assignment.epoch,
                assignment.batch,
                worker.rank,
                self.job.world_size,
                params,
                buffers,
            ),
        )

    def _on_push(self, worker: WorkerRecord, push: Push) -> None:
        self._validate_push(worker, push)
        result = self.policy.on_push(worker.worker_id, push)
        worker.assignment = None
        worker.samples += push.samples
        worker.pushes += 1
        self.meter.record_push(push.samples, push.loss_sum, push.correct)
        for worker_id in result.acknowledged:
            acked = self.membership.workers[worker_id]
            self._send(acked.identity, PushAck(self.store.version, result.staleness))
        if result.updates:
            self._after_update()

    def _validate_push(self, worker: WorkerRecord, push: Push) -> None:
        expected = {"grads": self.job.num_params, "buffers": self.job.num_buffers}
        for name, numel in expected.items():
            tensor = getattr(push, name)
            if tensor.numel() != numel or tensor.dtype != torch.float32:
                raise RequestRejected(
                    "wrong-shape",
                    f"{name} must be {numel} float32 values for {self.config.model}, got "
                    f"{tensor.numel()} {tensor.dtype}",
                )
        if worker.assignment != (push.epoch, push.batch):
            raise RequestRejected(
                "unexpected-batch",
                f"worker {worker.worker_id} pushed epoch {push.epoch} batch {push.batch}, but "
                f"was assigned {worker.assignment}; pull before pushing",
            )
        if push.samples < 1 or push.samples > self.job.batch_size:
            raise RequestRejected(
                "bad-samples", f"samples must be 1..{self.job.batch_size}, got {push.samples}"
            )
        if not bool(torch.isfinite(push.grads).all()):
            raise RequestRejected(
                "non-finite", f"worker {worker.worker_id} pushed NaN or Inf gradients; dropped"
            )

    def _after_update(self) -> None:
        version = self.store.version
        self.meter.maybe_log(version, self.policy.completed_epochs())
        every = self.config.checkpoint_every
        if self.config.checkpoint_dir is not None and every and version % every == 0:
            self._save_checkpoint()
        while self._evaluated_epochs < self.policy.completed_epochs():
            self._evaluated_epochs += 1
            self._evaluate(f"epoch {self._evaluated_epochs}")

    def _send_stop(self, worker: WorkerRecord, reason: str) -> None:
        self._send(worker.identity, Stop(reason))
        worker.told_to_stop = True

    # ---- the end ---------------------------------------------------------------------------

    def _evaluate(self, label: str) -> Evaluation:
        if self._last_eval is not None and self._last_eval[0] == self.store.version:
            return self._last_eval[1]
        started = time.monotonic()
        result = evaluate(self.store.model, self.test_set, torch.device(self.config.eval_device))
        self._last_eval = (self.store.version, result)
        self.meter.record_evaluation(self._evaluated_epochs, self.store.version, result)
        log.info(
            "%s (step %d): test accuracy %.4f, test loss %.4f on %d images (%.1f s)",
            label,
            self.store.version,
            result.accuracy,
            result.loss,
            result.samples,
            time.monotonic() - started,
        )
        return result

    def _save_checkpoint(self) -> None:
        assert self.config.checkpoint_dir is not None
        state = self.store.state_dict()
        path = save_checkpoint(
            self.config.checkpoint_dir,
            {
                "model": state["model"],
                "optimizer": state["optimizer"],
                "step": self.store.version,
                "epoch": self.policy.completed_epochs(),
                "fingerprint": state["fingerprint"],
                "config": self.config.to_dict(),
            },
        )
        log.info("checkpoint at step %d written to %s", self.store.version, path)

    def _finish(self) -> dict[str, Any]:
        self.meter.maybe_log(self.store.version, self.policy.completed_epochs(), force=True)
        final = self._evaluate("final")
        if self.config.checkpoint_dir is not None:
            self._save_checkpoint()
        staleness = (
            self.policy.staleness_summary() if isinstance(self.policy, AsyncPolicy) else None
        )
        workers = [
            {
                "worker_id": w.worker_id,
                "rank": w.rank,
                "name": w.name,
                "device": w.device,
                "pushes": w.pushes,
                "samples": w.samples,
            }
            for w in self.membership.workers.values()
        ]
        summary = build_summary(
            config=self.config.to_dict(),
            meter=self.meter,
            final=final,
            global_steps=self.store.version,
            epochs=self.policy.completed_epochs(),
            workers=workers,
            staleness=staleness,
        )
        if self.config.summary is not None:
            write_json(self.config.summary, summary)
            log.info("summary written to %s", self.config.summary)
        log.info(
            "training done: %d steps, test accuracy %.4f, %.1f img/s over %.1f s",
            self.store.version,
            final.accuracy,
            summary["images_per_second"],
            summary["wall_seconds"],
        )
        return summary

    def _drain(self) -> None:
        """Tell every worker to stop: answer its next request (or a held one) with STOP."""
        for worker in self._held_pulls:
            self._send_stop(worker, "training is over")
        deadline = time.monotonic() + self.config.stop_grace
        while not self.membership.all_told_to_stop() and time.monotonic() < deadline:
            if not self.socket.poll(POLL_MS):
                continue
            frames = self.socket.recv_multipart()
            identity = frames[0]
            try:
                message = decode(frames[1:])
                worker_id = getattr(message, "worker_id", None)
                if worker_id in self.membership.workers:
                    self.membership.workers[worker_id].told_to_stop = True
            except ProtocolError:
                pass
            self._send(identity, Stop("training is over"))
        missing = [w.worker_id for w in self.membership.workers.values() if not w.told_to_stop]
        if missing:
            log.warning("workers %s did not ask again before shutdown; they will time out", missing)
