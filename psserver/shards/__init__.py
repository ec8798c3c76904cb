"""Server sharding: the follower shards, and the leader's side of them."""
