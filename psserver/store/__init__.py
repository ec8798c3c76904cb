"""A shard's parameter store: master weights, buffers, the optimizer, and the weights in flight."""
