"""Live status, Prometheus metrics, the step log and the run summary."""
