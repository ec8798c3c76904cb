"""The wire: the message protocol, CURVE security, handshakes and endpoints."""
