"""What the leader trains, built from its config: the parameter store, the gradient buckets,
the job as workers see it, the update policy, and the test set it evaluates on.

The training set is loaded only to count it (the job's epochs are cut from its size); the
workers load their own copies.

What it is not: the server. Sockets, follower shards, checkpoints and the loop are wired
around these parts by psserver.server; nothing here talks to anyone.
"""

import dataclasses
import logging

from common.catalog import load_test_set, load_training_set
from common.data import ImageSet
from common.job import JobSpec
from common.sharding import shard_bucket_bounds
from psserver.config import ServerConfig
from psserver.policies import UpdatePolicy, make_policy
from psserver.store.optimizer import spec_from_config
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


@dataclasses.dataclass(frozen=True)
class LeaderJob:
    store: ParameterStore
    job: JobSpec
    policy: UpdatePolicy
    test_set: ImageSet


def build_job(config: ServerConfig) -> LeaderJob:
    """The store (from the seed; a --resume loads the checkpoint into it later), the job with
    its buckets, and the policy that trains it."""
    source = config.data_source()
    train_size = len(load_training_set(source, config.train_limit))
    test_set = load_test_set(source, config.test_limit)
    store = ParameterStore(
        config.model,
        config.seed,
        spec_from_config(config),
        sparse=config.compress.startswith("topk"),
        num_shards=config.num_shards,
    )
    sizes = [p.numel() for p in store.model.parameters()]
    # Top-k gradients travel whole: their entries are chosen over the whole vector.
    bucket_numel = 0 if store.sparse else config.bucket_numel
    buckets = shard_bucket_bounds(sizes, store.shard_bounds, bucket_numel)
    if bucket_numel:
        log.info(
            "gradient buckets of about %.3g MB: %s per shard",
            config.bucket_size_mb,
            ", ".join(str(len(cuts) - 1) for cuts in buckets),
        )
    job = config.job_spec(
        train_size,
        store.num_params,
        store.num_buffers,
        store.shard_bounds,
        buckets[0],
        tuple(buckets[1:]),
    )
    policy = make_policy(
        config.mode,
        store,
        job,
        config.epochs,
        config.max_steps,
        config.min_workers,
        config.step_timeout,
        config.staleness,
        config.staleness_lr,
    )
    return LeaderJob(store, job, policy, test_set)
