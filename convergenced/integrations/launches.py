"""The recovery generation of a launch: asked by one rank, shared by all of them.

Every rank of a job must ask for the restore point of the same recovery generation,
and a relaunched job must use one that no member has resolved (an older launch's
generation keeps its final answer, an old epoch, or is closed). A launcher's restart
counter does not do: ``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT`` and a
JobSet's attempt all start again at 0 with every new launch. So one rank asks its
daemon for a new generation (``next_generation`` in the local API: a number above
every generation any member resolved or closed) and hands it to the others:

* `shared_generation`: over the job's ``torch.distributed`` process group (group rank
  0 asks, one broadcast of two integers, the others wait for it); what
  `TorchCheckpointer.restore` does when given no generation;
* `solo_generation`: a job of a single rank asks for itself (refused when the stream
  has more ranks: each would open its own generation and restore its own epoch);
* `new_generation`: just the number, for code that shares it its own way (a
  launcher script, another framework's broadcast).

This module imports torch only inside `shared_generation`.
"""

from __future__ import annotations

from typing import Any, Protocol

from convergenced.integrations.errors import CheckpointError


class GenerationSource(Protocol):
    """What these functions need of a client (`convergenced.client.Client` has it)."""

    def state(self, stream: str) -> dict[str, Any]: ...

    def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]: ...


def new_generation(client: GenerationSource, stream: str, timeout: float | None = None) -> int:
    """A recovery generation of ``stream`` that no member has resolved or closed.

    Every rank of the launch must then use this same number: hand it to them.

    Raises:
        ApiError: kind ``timeout`` when the daemon, restarted without its state, has
            not heard from its peers within ``timeout`` seconds; ``rejected`` for an
            unknown stream.
    """
    return int(client.next_generation(stream, timeout)["generation"])


def solo_generation(client: GenerationSource, stream: str, timeout: float | None = None) -> int:
    """`new_generation`, for a stream of one rank, which needs to share it with nobody.

    Raises:
        CheckpointError: the stream has more than one rank.
        ApiError: see `new_generation`.
    """
    members = client.state(stream)["spec"]["members"]
    ranks = sum(len(r) for r in members.values())
    if ranks != 1:
        raise CheckpointError(
            f"stream {stream!r} has {ranks} ranks, and every rank must restore the same "
            "recovery generation: one rank asks next_generation and hands the number to "
            "the others (TorchCheckpointer.restore does it over the process group), or "
            "pass the generation explicitly"
        )
    return new_generation(client, stream, timeout)


def shared_generation(
    client: GenerationSource, stream: str, *, group: Any = None, timeout: float | None = None
) -> int:
    """A new generation, asked by rank 0 of ``group`` and broadcast to its other ranks.

    Every rank of the process group calls it (it is a collective); rank 0 asks its own
    daemon. Without an initialized process group this is `solo_generation`. With
    NCCL the broadcast runs on the current CUDA device (``torch.cuda.set_device``
    first); ``group`` may name a gloo group instead.

    Args:
        group: the process group (None: the default one).

    Raises:
        CheckpointError: rank 0 got no generation (rank 0 itself raises its error).
        ApiError, DaemonUnreachable: on rank 0, from its daemon.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return solo_generation(client, stream, timeout)
    backend = str(dist.get_backend(group))
    device = "cpu" if "gloo" in backend or not torch.cuda.is_available() else "cuda"
    box = torch.zeros(2, dtype=torch.int64, device=device)  # (ok, generation)
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0], box[1] = 1, new_generation(client, stream, timeout)
        except Exception as exc:  # every rank must reach the broadcast, or they hang
            failure = exc
    dist.broadcast(box, group=group, group_src=0)
    if failure is not None:
        raise failure
    ok, generation = (int(v) for v in box.tolist())
    if not ok:
        raise CheckpointError(
            f"stream {stream!r}: rank 0 of the process group got no new recovery "
            "generation from its daemon (its own error says why)"
        )
    return generation
