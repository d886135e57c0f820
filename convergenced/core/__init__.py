"""The sans-IO protocol core.

Nothing in this package does I/O, reads a clock, or imports trio or socket (a test
enforces it). The daemon, the simulator and the tests all drive the same objects:
feed them facts and bytes, take back bytes and events.
"""
