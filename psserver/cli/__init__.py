"""The server side's command lines: ps-server, ps-local, ps-status, ps-keys, ps-plot."""
