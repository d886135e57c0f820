"""`convergenced demo`: a crash in the middle of a checkpoint, and why convergence wins.

On embedded defaults, with no configuration and no framework, the demo

1. writes a 3-node loopback cluster (mutual TLS, as `convergenced cluster` does) into a
   temporary directory and starts one real ``convergenced run`` process per node;
2. runs a small deterministic data-parallel training job, one rank per node (a linear
   model whose weights are sharded across the ranks, stepping in lockstep through an
   all-gather), each rank checkpointing its shard every few steps with
   `convergenced.integrations.files`: to its node's local ``nvme`` tier, then, by a
   lagging background uploader, to a shared ``s3`` tier, committing each to its own
   daemon and collecting garbage as it goes;
3. kills node-3's trainer while it is writing its shard of a checkpoint, and its daemon
   with SIGKILL; the other ranks lose their collective and the "launcher" stops them;
4. restarts node-3's daemon, relaunches every rank as recovery generation 1: each asks
   its own daemon for the restore point, restores its own shard of that epoch, and
   trains to the end;
5. checks that the final weights equal an uninterrupted reference run bit for bit, and
   what a ``latest`` marker (written by rank 0 after its own save) would have restored
   at the crash.

It prints live progress (per node and domain the newest epoch, each node's restore
point, the skew), where Prometheus can scrape the daemons, and a one-line verdict;
``--json`` prints a final JSON object. Exit 0 when everything verified, 1 otherwise,
130 on Ctrl-C. Everything it started is stopped and its directory removed at the end.

The package, along those ideas: `options` (the command line and its checks), `nodes`
(the daemons of the demo's cluster), `trainer` (the toy model, the collective, the crash
plan and the trainer threads), `console` (the event lines and the live progress line),
`story` (the run and its checks), `result` (what it found) and `command` (the command:
verdict and exit code). Run it as
``convergenced demo`` or ``python -m convergenced.tools.demo``.
"""

from __future__ import annotations

from convergenced.tools.demo.command import main, run_demo
from convergenced.tools.demo.options import DESCRIPTION, HELP, Options, add_arguments
from convergenced.tools.demo.result import DemoResult
from convergenced.tools.demo.trainer import (
    NODES,
    init_shard,
    loss,
    pack,
    reference_run,
    train_step,
    unpack,
)

__all__ = [
    "DESCRIPTION",
    "HELP",
    "NODES",
    "DemoResult",
    "Options",
    "add_arguments",
    "init_shard",
    "loss",
    "main",
    "pack",
    "reference_run",
    "run_demo",
    "train_step",
    "unpack",
]
