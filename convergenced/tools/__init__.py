"""Development and demonstration tooling, never imported by the daemon.

`cluster` writes and runs loopback clusters (`convergenced cluster`, the test harness,
the benchmarks); `demo` is `convergenced demo`.
"""
