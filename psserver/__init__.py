"""The parameter server: master weights, optimizer, update policies and the ZeroMQ loop."""
