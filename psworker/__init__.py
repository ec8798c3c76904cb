"""The worker: pull weights, compute a gradient on its shard, push it; one device each."""
