"""The local API over a Unix socket: the server and its client sessions, the
operations table, the socket itself and who may use it (peer credentials)."""
