"""Serving requests on a shard's ROUTER socket: pushes, pulls, their checks and flow control."""
