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

**A launch with another member map.** A relaunch may run on other hosts (a spare
replaced a dead one, the job shrank or grew). Its ranks then declare a new
*membership* of the stream: the spec with the hosts it has now and ``membership`` =
the launch's generation (PROTOCOL.md section 8.1). Whether the map changed is decided
once, by the rank that asks for the generation, and handed to the others with it, so
that every rank declares the same spec: a `Launch` is those two numbers. The
functions that take the spec build it:

* `shared_launch`: over a process group, like `shared_generation` (what
  `TorchCheckpointer` does when given the spec rather than the stream's name);
* `solo_launch`: a stream of one rank;
* `new_launch`: the two numbers, for code that shares them its own way; every rank
  then declares ``launch.spec(SPEC)``.

The asking rank keeps the membership its node declared when the map is the same (a
plain relaunch, nothing changes), and takes the generation as the membership when the
map differs, when its node holds no declaration of the stream while another node does
(it is a spare, or it lost its state), or when a member declared a newer membership
than its node knows (a launch that died half way through declaring one).

This module imports torch only inside `shared_generation` and `shared_launch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from convergenced.core.local_api_codec import ApiError
from convergenced.core.spec import StreamSpec
from convergenced.integrations.errors import CheckpointError


class GenerationSource(Protocol):
    """What these functions need of a client (`convergenced.client.Client` has it)."""

    def state(self, stream: str) -> dict[str, Any]: ...

    def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]: ...


class LaunchSource(GenerationSource, Protocol):
    """What the launch functions need of a client: it also declares."""

    def declare(self, spec: StreamSpec | Mapping[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


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
    if not _distributed():
        return solo_generation(client, stream, timeout)
    (generation,) = _from_rank_0(
        lambda: (new_generation(client, stream, timeout),), 1, group,
        f"stream {stream!r}: rank 0 of the process group got no new recovery generation",
    )  # fmt: skip
    return generation


# -- launches: the generation and the membership ----------------------------------------


def as_spec(spec: StreamSpec | Mapping[str, Any]) -> StreamSpec:
    """``spec`` as a `StreamSpec` (the local API's map form, as ``declare`` takes it,
    is parsed).

    Raises:
        SpecError: naming the field that is wrong.
    """
    return spec if isinstance(spec, StreamSpec) else StreamSpec.from_wire(spec)


@dataclass(frozen=True)
class Launch:
    """What every rank of one launch must use: hand both numbers to every rank."""

    generation: int
    """The recovery generation every rank restores."""
    membership: int
    """The ``membership`` every rank declares: the generation itself when the launch
    declares a new member map, else the membership declared before."""

    def __post_init__(self) -> None:
        for name in ("generation", "membership"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"Launch.{name}: {value!r} is not a non-negative integer")
        if self.membership > self.generation:
            raise ValueError(
                f"Launch: membership {self.membership} above generation {self.generation}"
            )

    def spec(self, spec: StreamSpec | Mapping[str, Any]) -> StreamSpec:
        """``spec`` as this launch declares it: its name, members, policy, retention and
        shared domains, with this launch's membership (whatever ``spec`` says).

        Raises:
            SpecError: ``spec`` is not a valid spec.
        """
        s = as_spec(spec)
        return StreamSpec.create(s.name, dict(s.members), s.policy, s.retention,
                                 shared=s.shared, membership=self.membership)  # fmt: skip


def _held_spec(client: GenerationSource, stream: str) -> StreamSpec | None:
    """The spec of ``stream`` this node holds (None: not declared here)."""
    try:
        return StreamSpec.from_wire(client.state(stream)["spec"])
    except ApiError as exc:
        if exc.reason != "unknown_stream":
            raise
        return None


def new_launch(
    client: LaunchSource, spec: StreamSpec | Mapping[str, Any], timeout: float | None = None
) -> Launch:
    """A new launch of ``spec``'s stream, decided on one rank: hand it to the others.

    Asks this rank's daemon for a new generation (`new_generation`) and decides the
    membership every rank declares: the one this node declared, when it holds the
    stream with the same member map (it then declares ``spec`` here, a no-op that
    fails when a member already declared a newer membership: then a new one); the
    generation otherwise (a new map, or this node holds no declaration of the stream:
    a spare, or a node that lost its state; a first launch gets 0 and 0). Every rank
    then declares ``launch.spec(spec)`` and restores ``launch.generation``.

    Raises:
        SpecError: ``spec`` is not a valid spec.
        ApiError: see `new_generation`; reason ``spec_conflict`` when this node holds
            the stream with another policy, retention or shared domains.
    """
    s = as_spec(spec)
    held = _held_spec(client, s.name)
    if held is None and not client.status().get("peers"):
        # A daemon without peers hears of the stream from nobody, and one that started
        # without a log answers next_generation for a stream it has not declared only
        # once it heard from a peer: declare it (nothing can conflict) and ask then.
        client.declare(Launch(0, 0).spec(s))
        held = _held_spec(client, s.name)
    generation = new_generation(client, s.name, timeout)
    if held is None or held.members != s.members:
        return Launch(generation, generation)
    same = Launch(generation, held.membership)
    try:
        # The same map under the membership this node holds: nothing changes, unless
        # a member is on a newer membership already (a launch that died declaring it
        # half way): then every rank moves on to this launch's.
        client.declare(same.spec(s))
    except ApiError as exc:
        if exc.reason != "membership_superseded":
            raise
        return Launch(generation, generation)
    return same


def solo_launch(
    client: LaunchSource, spec: StreamSpec | Mapping[str, Any], timeout: float | None = None
) -> Launch:
    """`new_launch`, for a stream of one rank, which needs to share it with nobody.

    Raises:
        CheckpointError: ``spec`` has more than one rank.
        SpecError, ApiError: see `new_launch`.
    """
    s = as_spec(spec)
    ranks = sum(len(r) for _, r in s.members)
    if ranks != 1:
        raise CheckpointError(
            f"stream {s.name!r} has {ranks} ranks, and every rank must declare and restore "
            "the same launch: one rank asks new_launch and hands it to the others (pass it "
            "as launch=), or let TorchCheckpointer share it over the process group"
        )
    return new_launch(client, s, timeout)


def shared_launch(
    client: LaunchSource,
    spec: StreamSpec | Mapping[str, Any],
    *,
    group: Any = None,
    timeout: float | None = None,
) -> Launch:
    """A new launch, decided by rank 0 of ``group`` (`new_launch`) and broadcast.

    Every rank of the process group calls it (a collective, as `shared_generation`);
    without an initialized process group this is `solo_launch`. Every rank must pass
    the same ``spec`` (its members: the hosts of this launch).

    Raises:
        SpecError: ``spec`` is not a valid spec (on every rank, before the broadcast).
        CheckpointError: rank 0 got no launch (rank 0 itself raises its error).
        ApiError, DaemonUnreachable: on rank 0, from its daemon.
    """
    s = as_spec(spec)
    if not _distributed():
        return solo_launch(client, s, timeout)

    def ask() -> tuple[int, int]:
        launch = new_launch(client, s, timeout)
        return launch.generation, launch.membership

    generation, membership = _from_rank_0(
        ask, 2, group, f"stream {s.name!r}: rank 0 of the process group got no new launch"
    )
    return Launch(generation, membership)


# -- one broadcast -------------------------------------------------------------------------


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _from_rank_0(
    ask: Callable[[], tuple[int, ...]], size: int, group: Any, failed: str
) -> tuple[int, ...]:
    """``ask()`` on rank 0 of ``group``, broadcast to every rank: one broadcast of
    ``size + 1`` integers, the first saying whether rank 0 got an answer."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    device = "cpu" if "gloo" in backend or not torch.cuda.is_available() else "cuda"
    box = torch.zeros(size + 1, dtype=torch.int64, device=device)  # (ok, values...)
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            values = ask()
            box[0] = 1
            for i, value in enumerate(values, start=1):
                box[i] = value
        except Exception as exc:  # every rank must reach the broadcast, or they hang
            failure = exc
    dist.broadcast(box, group=group, group_src=0)
    if failure is not None:
        raise failure
    ok, *got = (int(v) for v in box.tolist())
    if not ok:
        raise CheckpointError(f"{failed} from its daemon (its own error says why)")
    return tuple(got)
