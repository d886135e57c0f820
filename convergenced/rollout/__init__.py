"""Staged rollouts of drivers, firmware and OS images, gated by the epoch handshake.

`plan` reads a rollout plan and cuts it into waves; `driver` walks the waves, one
node at a time through its own daemon (the drain gate with ``--version``, the
upgrade hook, the version report, the acknowledgement), and keeps an audit trail in
each node's log; `command` is ``convergenced rollout``.
"""
