"""`ps-bench`: measure this system on your own machines, like iperf for parameter servers."""
