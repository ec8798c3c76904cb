"""Shared pieces of the parameter-server system: wire protocol, models, data, config.

Nothing here imports from `psserver` or `psworker`; both roles depend on this package.
"""
