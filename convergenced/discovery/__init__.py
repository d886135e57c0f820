"""Peer discovery: where candidate peer addresses ("contacts") come from.

One shared configuration serves a whole fleet: instead of every node's file listing
every peer, a ``[discovery]`` table names where to find them (static seeds, a DNS name,
an SRV name, a file an orchestrator keeps up to date). A contact is only a candidate:
whoever dials it still verifies the peer's identity.

- `convergenced.discovery.contacts`: sans-IO (no trio, no sockets, no clock): the
  `Contact` value, address and contacts-file parsing, the ``[discovery]`` table.
- `convergenced.discovery.sources`: the trio adapter that asks DNS and reads the file.

This module imports neither on purpose: importing `contacts` (as the configuration
loader does) must not pull trio in through the package.
"""
