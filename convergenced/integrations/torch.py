"""Epoch-aware PyTorch checkpoints on top of `convergenced.integrations.files`.

A `TorchCheckpointer` turns a training job's state (the model's, optimizer's and
scheduler's ``state_dict()``, the torch, Python and, when installed, NumPy RNG states,
and a small ``extra`` mapping such as the data-loader position) into one
``torch.save`` blob, and hands it to a `CheckpointStore`: the store writes this rank's
shard durably to the fast local tier, commits it to this node's daemon, uploads it to
the remote tier in the background, restores the agreed restore point with fallback to
the other tier, and collects garbage exactly where the daemon says it is safe. Nothing
here touches files itself.

In a ``torch.distributed`` job, each rank builds its own checkpointer on a client of
its own node's daemon and saves its own shard (the full replica under DDP: each rank
keeps its own RNG states). There is no collective on the save path: a rank that dies
mid-save leaves the others' saves intact, and the daemons agree on the newest epoch
every rank finished. After a restart every rank asks for the restore point of a new
recovery generation: a checkpointer given the stream's spec has rank 0 ask its daemon
for one when it is created, and broadcasts it over the process group with the
membership to declare (`convergenced.integrations.launches.shared_launch`), so a
relaunch needs no counter from the launcher (torchrun's restart count starts again at
0 with every new launch, and reusing it gets an older launch's answer), and a relaunch
on other hosts (a spare in place of a dead host, fewer or more hosts) declares its new
member map by itself: the spec lists the hosts of this launch::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from convergenced.client import Client
    from convergenced.integrations.files import NoRestorePointError, Tier
    from convergenced.integrations.torch import TorchCheckpointer

    SPEC = {  # this launch's hosts: node id -> the ranks it hosts
        "name": "job",
        "members": {"gpu-1": [0, 1], "gpu-2": [2, 3]},
        "policy": {"mode": "any", "domains": ["nvme", "s3"]},
        "shared": ["s3"],  # readable from any host: a rank that moves keeps it
    }
    dist.init_process_group("gloo")  # or nccl
    rank = dist.get_rank()
    client = Client()  # this node's daemon ($CONVERGENCED_SOCKET)
    ckpt = TorchCheckpointer(  # a collective: declares SPEC for this launch
        client, SPEC, rank, Tier("nvme", "/nvme/ckpt"), Tier("s3", "/mnt/bucket/ckpt")
    )
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)
    try:
        epoch, extra = ckpt.restore(
            model=model, optimizer=optimizer, scheduler=scheduler, timeout=300
        )
        start = extra["step"]
    except NoRestorePointError:
        start = 0  # nothing every rank can restore: start fresh
    for step in range(start, steps):
        train_one_step(step)
        if (step + 1) % every == 0:
            ckpt.save(
                step + 1, model=model, optimizer=optimizer, scheduler=scheduler,
                extra={"step": step + 1},
            )
            ckpt.gc()
    ckpt.close()  # waits for the uploads

**Format.** The store's shard holds two named parts: ``meta``, a JSON object
(``format`` ``convergenced.torch/1``, stream, rank, epoch, torch version, components)
readable without torch, and ``state``, the ``torch.save`` of a dict with the keys
``model``, ``optimizer``, ``scheduler`` (each present when saved), ``rng`` and
``extra``. A model wrapped in ``DistributedDataParallel`` or ``DataParallel`` is saved
and restored through its ``.module``, so the keys carry no ``module.`` prefix and a
checkpoint loads with or without the wrapper.

**Loading.** `TorchCheckpointer.restore` loads with ``torch.load(weights_only=True)``:
tensors, the state dicts of torch's modules, optimizers and LR schedulers, the RNG
states (NumPy's are stored as plain lists) and an ``extra`` of plain values
(numbers, strings, lists, tuples, dicts, tensors) all load without unpickling
arbitrary code. An ``extra`` or a custom scheduler holding other objects needs either
``torch.serialization.add_safe_globals([...])`` for those classes or, for checkpoints
you trust, ``restore(..., weights_only=False)``.

**Daemon restarts.** Training goes on through a restart of the daemon: a `save` made
while it is down waits for it (within the client's reconnect bound), and the store
commits again the shards its tiers hold, after verifying them, when it opens and after
reconnecting to a daemon that restarted (see `convergenced.integrations.files`).

**Guarantees.** `restore` loads exactly the agreed epoch of the generation (the store
reads nothing else, and the embedded metadata is checked again) or raises before
touching the model. A checkpoint whose embedded epoch, stream or rank disagrees with
its shard header is refused as a mixed-epoch load (`MixedEpochError`), as is
`load_states` over shards of several epochs.

This module imports torch only when a checkpointer is created or a state is loaded
(``pip install 'convergenced[torch]'``); importing `convergenced.integrations` never
imports it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType, TracebackType
from typing import Any, NamedTuple, Protocol, TypedDict, Unpack, cast

from convergenced.core.spec import StreamSpec
from convergenced.integrations.errors import (
    CheckpointError,
    CorruptShardError,
    MixedEpochError,
    NoRestorePointError,
    RestorePointLostError,
    ShardUnavailableError,
)
from convergenced.integrations.files import (
    CheckpointStore,
    DaemonClient,
    Deleted,
    StorageTier,
    Tier,
)
from convergenced.integrations.launches import Launch, shared_generation, shared_launch
from convergenced.integrations.shards import Shard, load_consistent

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CorruptShardError",
    "MixedEpochError",
    "NoRestorePointError",
    "RestorePointLostError",
    "ShardUnavailableError",
    "Stateful",
    "StoreOptions",
    "Tier",
    "TorchCheckpointer",
    "TorchRestored",
    "load_states",
]

FORMAT = "convergenced.torch/1"
"""The ``format`` of the ``meta`` part of every shard this module writes."""

_COMPONENTS = ("model", "optimizer", "scheduler")


class Stateful(Protocol):
    """What can be checkpointed: ``torch.nn.Module``, optimizers, LR schedulers, a
    ``GradScaler``, or anything else with ``state_dict``/``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class StoreOptions(TypedDict, total=False):
    """Keyword arguments passed on to `CheckpointStore`."""

    upload_delay: float | Callable[[int], float]
    """Seconds each upload takes on top of the copy (or a function of the epoch)."""


class TorchRestored(NamedTuple):
    """What `TorchCheckpointer.restore` returns."""

    epoch: int
    """The agreed restore point that was loaded."""
    extra: dict[str, Any]
    """The ``extra`` mapping saved with it (the data-loader position...)."""


def _require_torch() -> None:
    """Say how to get torch when it is missing (each function imports it itself)."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(
            "convergenced.integrations.torch needs PyTorch: pip install 'convergenced[torch]'"
        )


def _unwrap(model: Stateful) -> Stateful:
    """The module inside a ``DistributedDataParallel`` or ``DataParallel`` wrapper."""
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel | DataParallel):
        inner: Stateful = model.module
        return inner
    return model


# -- RNG states -----------------------------------------------------------------------------


def _numpy() -> ModuleType | None:
    """NumPy if it is installed (it is optional, and untyped here: Any at this boundary)."""
    if importlib.util.find_spec("numpy") is None:
        return None
    return importlib.import_module("numpy")


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    # torch.cuda.is_initialized is unannotated; it returns a bool. Save the CUDA
    # generators only where CUDA is in use: never initialise it just for this.
    cuda_initialized = cast(Callable[[], bool], torch.cuda.is_initialized)
    if torch.cuda.is_available() and cuda_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        # Plain values, so that weights_only loading needs no NumPy globals.
        state["numpy"] = (str(name), [int(k) for k in keys], int(pos), int(has_gauss), cached)
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)  # on other hardware, the CUDA RNGs stay as they are
    numpy = _numpy()
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state(
            (name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, float(cached))
        )


# -- encoding -------------------------------------------------------------------------------


def _encode(
    stream: str,
    rank: int,
    epoch: int,
    components: Mapping[str, Stateful | None],
    extra: Mapping[str, Any] | None,
) -> dict[str, bytes]:
    import torch

    state: dict[str, Any] = {}
    for name, obj in components.items():
        if obj is not None:
            state[name] = (_unwrap(obj) if name == "model" else obj).state_dict()
    state["rng"] = _rng_state()
    state["extra"] = dict(extra or {})
    buf = io.BytesIO()
    torch.save(state, buf)
    meta = {
        "format": FORMAT,
        "stream": stream,
        "rank": rank,
        "epoch": epoch,
        "torch": str(torch.__version__),
        "components": [name for name in _COMPONENTS if name in state],
    }
    return {
        "meta": json.dumps(meta, sort_keys=True).encode(),
        "state": buf.getvalue(),
    }


def _decode(
    shard: Shard, *, map_location: Any = "cpu", weights_only: bool = True
) -> dict[str, Any]:
    """The state dict saved in ``shard``, after checking its embedded metadata.

    Raises:
        CorruptShardError: not a shard of this module's format.
        MixedEpochError: the embedded epoch, stream or rank is not the shard's.
    """
    payload = shard.payload
    if not isinstance(payload, dict) or set(payload) != {"meta", "state"}:
        raise CorruptShardError(shard.path, f"not a {FORMAT} checkpoint (parts meta, state)")
    try:
        meta = json.loads(payload["meta"])
    except ValueError as exc:
        raise CorruptShardError(shard.path, f"meta is not JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptShardError(shard.path, f"meta format is not {FORMAT!r}")
    found = (meta.get("stream"), meta.get("rank"), meta.get("epoch"))
    if found != (shard.stream, shard.rank, shard.epoch):
        raise MixedEpochError(
            f"{shard.path or 'shard'}: refusing to load a state saved as stream "
            f"{found[0]!r} rank {found[1]} epoch {found[2]} from the shard of stream "
            f"{shard.stream!r} rank {shard.rank} epoch {shard.epoch}",
            {shard.rank: found[2] if isinstance(found[2], int) else -1},
        )
    import torch

    try:
        state = torch.load(
            io.BytesIO(payload["state"]), map_location=map_location, weights_only=weights_only
        )
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
        hint = (
            " (weights_only: allow its classes with torch.serialization.add_safe_globals, "
            "or pass weights_only=False for a checkpoint you trust)"
            if weights_only
            else ""
        )
        raise CheckpointError(
            f"{shard.path or 'shard'}: cannot load the torch state of epoch {shard.epoch}: "
            f"{exc}{hint}"
        ) from exc
    if not isinstance(state, dict) or "rng" not in state or "extra" not in state:
        raise CorruptShardError(shard.path, "the torch state lacks rng or extra")
    return state


def load_states(
    shards: Iterable[Shard],
    *,
    epoch: int | None = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> dict[int, dict[str, Any]]:
    """The saved state dicts of several ranks' shards, ``{rank: state}``, all of one epoch.

    For tools (evaluation, resharding) that read several ranks' checkpoints; the
    shards come from `CheckpointStore.read` (``checkpointer.store.read(epoch, rank)``).
    Each state has the keys ``model``, ``optimizer``, ``scheduler`` (those saved),
    ``rng`` and ``extra``.

    Raises:
        MixedEpochError: the shards are of different epochs or streams (or not of
            ``epoch``), a rank appears twice, or a state inside a shard was saved as
            another epoch.
        CorruptShardError, CheckpointError: a shard is not a loadable checkpoint.
    """
    shards = list(shards)
    load_consistent(shards, epoch=epoch)
    return {
        s.rank: _decode(s, map_location=map_location, weights_only=weights_only) for s in shards
    }


# -- the checkpointer -----------------------------------------------------------------------


class TorchCheckpointer:
    """One rank's torch checkpoints of one stream, on a `CheckpointStore`.

    Example (one process; see the module docstring for a ``torch.distributed`` job)::

        ckpt = TorchCheckpointer(Client(), "job", 0, Tier("nvme", "/tmp/ckpt"))
        ckpt.save(10, model=model, optimizer=opt, extra={"step": 10})
        epoch, extra = ckpt.restore(model=model, optimizer=opt)  # a new generation
        ckpt.close()

    The checkpointer is thread-safe as far as the store is; use it as a context
    manager or call `close`.
    """

    def __init__(
        self,
        client: DaemonClient,
        stream: str | StreamSpec | Mapping[str, Any],
        rank: int,
        local: StorageTier,
        remote: StorageTier | None = None,
        *,
        group: Any = None,
        launch: Launch | None = None,
        **store_kwargs: Unpack[StoreOptions],
    ) -> None:
        """A checkpointer for ``rank`` of ``stream``.

        Given the stream's spec, creating it is a collective of ``group`` (as creating
        a ``DistributedDataParallel`` is): rank 0 asks its daemon for a new launch
        and broadcasts it (`convergenced.integrations.launches.shared_launch`), then
        every rank declares the spec for it, with the membership it says, and opens
        its store, which commits what its tiers hold (a rank on a new host finds its
        shards in the shared remote tier); `restore` then restores the launch's
        generation.

        Args:
            client: a client of this rank's own node's daemon.
            stream: the stream's spec (a `StreamSpec`, or the map ``declare`` takes)
                with the member map of this launch, the same on every rank; or the
                stream's name, declared on the daemon beforehand.
            rank: this process's rank (``torch.distributed.get_rank()``).
            local: the fast tier, written synchronously by `save`: this host's own.
            remote: the slow tier, filled by the store's background uploader; every
                host may share it.
            group: the process group that shares the launch and new generations
                (None: the default group; a single process without one opens its
                own, on a stream of one rank).
            launch: the launch to declare the spec for, when the job shares it its own
                way (then creating the checkpointer is no collective).
            store_kwargs: passed on to `CheckpointStore` (``upload_delay``).

        Raises:
            ImportError: torch is not installed.
            CheckpointError: rank 0 got no launch from its daemon.
            SpecError, ApiError, DaemonUnreachable: see `CheckpointStore`.
        """
        _require_torch()
        if not isinstance(stream, str) and launch is None:
            launch = shared_launch(client, stream, group=group)
        self.group = group
        """The process group that shares new generations."""
        self.store = CheckpointStore(
            client, stream, rank, local, remote, launch=launch, **store_kwargs
        )
        """The underlying store (paths, `CheckpointStore.read`, `CheckpointStore.flush`...)."""
        self.store.times_saves = False  # `save` times the encoding too
        self.restored_from: str | None = None
        """The domain the last `restore` read its shard from."""
        self.generation: int | None = None
        """The recovery generation the last `restore` asked for."""

    @property
    def stream(self) -> str:
        """The stream this checkpointer saves to."""
        return self.store.stream

    @property
    def rank(self) -> int:
        """The rank this checkpointer saves for."""
        return self.store.rank

    def save(
        self,
        epoch: int,
        *,
        model: Stateful,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Shard:
        """Save this rank's state as ``epoch`` and commit it to this node's daemon.

        Captures the states of ``model`` (unwrapped from DDP), ``optimizer`` and
        ``scheduler``, the RNG states as they are now (save at the point of the loop
        where a resumed run continues, so it draws the same numbers), and ``extra``
        (the data-loader position, say ``{"step": s, "sample_index": i}``). Returns once
        the shard is fsynced on the local tier and the daemon acknowledged the commit;
        the upload to the remote tier follows in the background. No collective.

        An epoch the daemon retired is not counted again (``committed`` false in the
        shard returned; see `CheckpointStore.save`).

        Raises:
            ApiError: the daemon refused the commit (unknown stream, unknown rank...).
            DaemonUnreachable: the daemon cannot be reached.
            OSError: the local write failed (nothing was committed).
        """
        components = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        with self.store.save_timer.timing():  # reported for the overhead figure
            payload = _encode(self.stream, self.rank, epoch, components, extra)
            return self.store.save(epoch, payload)

    def restore(
        self,
        generation: int | None = None,
        *,
        model: Stateful,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        timeout: float | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
        group: Any = None,
    ) -> TorchRestored:
        """Load the agreed restore point of a recovery generation into the objects given.

        Every rank of the job calls it, with the same ``generation`` (the answer comes
        once every member asked). Restores the model, the optimizer and scheduler when
        given, and the RNG states; returns the epoch and ``extra``. The checkpoint is
        read and verified in full before anything is modified.

        Args:
            generation: the recovery generation; None (the default): the launch's,
                when the checkpointer was given the stream's spec; else a new one,
                asked by rank 0 of ``group`` and broadcast to the other ranks
                (`convergenced.integrations.launches.shared_generation`, a
                collective), so every launch gets one no earlier launch resolved. An
                explicit number must be the same on every rank and new for each
                launch (a launcher's restart counter is not: it starts again at 0).
            timeout: seconds to wait for every member to ask.
            map_location: as for ``torch.load`` (default ``"cpu"``;
                ``load_state_dict`` copies to the parameters' devices).
            weights_only: as for ``torch.load``; see the module docstring.
            group: the process group that shares a new generation (None: the
                checkpointer's).

        Raises:
            NoRestorePointError: no epoch is restorable on every member: start fresh.
            RestorePointLostError, ShardUnavailableError: the agreed epoch is gone or
                unreadable in every tier (its copies were retracted): restart as a newer
                generation, whose restore point is an older intact epoch.
            MixedEpochError: the state inside the shard was saved as another epoch.
            CheckpointError: the shard is not a loadable torch checkpoint, or lacks the
                state of an ``optimizer`` or ``scheduler`` given.
            ApiError: see `CheckpointStore.agreed_epoch`.
        """
        if generation is None and self.store.launch is not None:
            generation = self.store.launch.generation
        elif generation is None:
            generation = shared_generation(self.store.client, self.stream,
                                           group=self.group if group is None else group,
                                           timeout=timeout)  # fmt: skip
        self.generation = generation
        epoch = self.store.agreed_epoch(generation, timeout)
        shard = self.store.read(epoch)  # local, else remote; broken copies retracted
        if shard.epoch != epoch:  # read() verified it; keep the promise explicit
            raise MixedEpochError(
                f"read epoch {shard.epoch} for the restore point {epoch}", {self.rank: epoch}
            )
        state = _decode(shard, map_location=map_location, weights_only=weights_only)
        components = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        for name, obj in components.items():
            if obj is not None and name not in state:
                raise CheckpointError(
                    f"stream {self.stream!r} rank {self.rank} epoch {epoch}: the checkpoint "
                    f"has no {name} state"
                )
        _unwrap(model).load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.restored_from = shard.domain
        return TorchRestored(epoch, dict(state["extra"]))

    def gc(self) -> list[Deleted]:
        """Delete this rank's shards the daemon says are safe to delete (see
        `CheckpointStore.gc`)."""
        return self.store.gc()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the uploads queued so far (see `CheckpointStore.flush`)."""
        self.store.flush(timeout)

    def close(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Stop the uploader, by default after the pending uploads (see
        `CheckpointStore.close`). The client stays open: it is the caller's."""
        self.store.close(flush=flush, timeout=timeout)

    def __enter__(self) -> TorchCheckpointer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush=t is None)
