"""Peer links over TCP: the sessions that drive a `Link` each, the hub they share,
dialling with backoff, and the TLS transport."""
