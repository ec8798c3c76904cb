"""A worker's connection to the job's shards: registration, requests, waits, heartbeat, flow
control."""
