"""What a PyTorch Distributed Checkpoint (DCP) step directory holds, and whether it is whole.

`torch.distributed.checkpoint.save` writes one directory per checkpoint. Each rank
writes its data files, ``__<rank>_<n>.distcp``; then the metadata, which maps every
saved item to ``(file, offset, length)``:

- **global metadata** (``use_collectives=True``, the default): the coordinator writes
  one ``.metadata`` for the whole world, once every rank's ``write_data`` returned;
- **per-rank metadata** (``use_collectives=False``): every rank writes its own
  ``__<rank>.metadata`` naming only its own files, and nothing names the world.

DCP and torchtitan look only for a metadata file: DCP's ``_metadata_exists`` checks
``.metadata`` or rank 0's ``__0.metadata``, torchtitan loads the highest ``step-N``
holding ``.metadata``. Neither checks that the files the metadata names are there and
long enough, nor, with per-rank metadata, that every rank of the saving world wrote
its own. `dcp_step_complete` does both, so a rank of a new world can verify a step
before committing it (PROTOCOL.md 8.1), and a watcher can tell a whole step from a
torn one.

**The saving world.** Global metadata references every rank's files, so a step with
it is complete for its world whatever that was. Per-rank metadata cannot say how many
ranks saved: pass ``world=`` when you know it; otherwise it is inferred as one more
than the highest rank that left a metadata or data file, which cannot see a highest
rank that died before writing anything (`DcpCompleteness.world_inferred` says so).

**Trust.** DCP's metadata is a pickle, as DCP itself reads it: only point these
functions at checkpoint directories you trust.

Paths are local directories or fsspec URLs (``s3://bucket/run/step-10``, any
``scheme://``); torch is imported only when metadata is read.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from convergenced.integrations.dcp_storage import DcpStorage
from convergenced.integrations.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "GLOBAL_METADATA",
    "DcpCompleteness",
    "DcpFile",
    "DcpLayoutError",
    "StepDir",
    "dcp_step_complete",
    "file_rank",
    "rank_metadata_name",
    "read_dcp_metadata",
]

GLOBAL_METADATA = ".metadata"
"""The name of the global metadata file (``use_collectives=True``)."""

_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_RANK_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_PREFIX = re.compile(r"^__(\d+)_")

Layout = Literal["global", "per_rank", "none"]
StepDir = str | os.PathLike[str]


def rank_metadata_name(rank: int) -> str:
    """The name of rank ``rank``'s own metadata file (``use_collectives=False``)."""
    return f"__{rank}{GLOBAL_METADATA}"


def file_rank(name: str) -> int | None:
    """The rank that wrote a file of a step directory, from its name.

    ``__3_0.distcp`` and ``__3.metadata`` are rank 3's; ``.metadata`` is the
    coordinator's (rank 0 in `torch.distributed.checkpoint.save`), given as 0; any
    other name gives None.
    """
    if name == GLOBAL_METADATA:
        return 0
    m = _RANK_METADATA.match(name) or _RANK_PREFIX.match(name)
    return int(m.group(1)) if m else None


class DcpLayoutError(CheckpointError):
    """A step directory's metadata is missing or unreadable."""

    def __init__(self, step_dir: StepDir, why: str) -> None:
        super().__init__(f"{os.fspath(step_dir)}: {why}")
        self.step_dir = os.fspath(step_dir)
        self.why = why


@dataclass(frozen=True)
class DcpFile:
    """One file a step's metadata references (or a metadata file itself)."""

    name: str
    """The name inside the step directory."""
    rank: int | None
    """The rank that wrote it (`file_rank`)."""
    needed: int
    """The bytes it must hold at least: the end of the last item stored in it."""
    present: int | None
    """The bytes it holds, or None when it is missing."""

    @property
    def ok(self) -> bool:
        """Present with at least `needed` bytes."""
        return self.present is not None and self.present >= self.needed


@dataclass(frozen=True)
class DcpCompleteness:
    """The verdict of `dcp_step_complete` on one step directory."""

    step_dir: str
    ok: bool
    """Loadable by the world that saved it: every metadata file and every file they
    reference is present and long enough."""
    layout: Layout
    """``global`` (``.metadata``), ``per_rank`` (``__<r>.metadata`` only) or ``none``."""
    saving_world: int | None
    """The number of ranks that saved the step (None when nothing says)."""
    world_inferred: bool
    """`saving_world` was inferred from the files present, not given (per-rank
    metadata only; see the module docstring)."""
    files: tuple[DcpFile, ...]
    """The metadata files and the data files they reference, by name."""
    size_bytes: int
    """The bytes those files hold on storage."""
    problems: list[str] = field(default_factory=list)
    """Why the step is not complete, one line each (empty when `ok`)."""

    def rank_files(self, rank: int) -> tuple[DcpFile, ...]:
        """The files rank ``rank`` wrote (its data files, and its metadata file: the
        global one for the coordinator, rank 0)."""
        return tuple(f for f in self.files if f.rank == rank)


def _load_metadata(storage: DcpStorage, name: str) -> Metadata:
    import torch.distributed.checkpoint.metadata as md  # the classes the pickle names

    try:
        data = storage.read(name)
    except FileNotFoundError as exc:
        raise DcpLayoutError(storage.where, f"no {name}") from exc
    except OSError as exc:
        raise DcpLayoutError(storage.where, f"{name}: unreadable: {exc}") from exc
    try:
        metadata = pickle.loads(data)  # DCP's own format (see Trust above)
    except Exception as exc:  # a torn or foreign file: any unpickling error
        raise DcpLayoutError(
            storage.where, f"{name}: unreadable ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, md.Metadata):
        raise DcpLayoutError(storage.where, f"{name}: not DCP metadata ({type(metadata).__name__})")
    return metadata


def read_dcp_metadata(step_dir: StepDir, *, rank: int | None = None) -> Metadata:
    """The metadata DCP's loader would read in ``step_dir`` on rank ``rank``.

    The global ``.metadata`` when there is one; otherwise the per-rank
    ``__<rank>.metadata`` (rank 0's when ``rank`` is None, the one DCP's
    ``_metadata_exists`` looks at).

    Raises:
        DcpLayoutError: neither file exists, or the one there is unreadable.
    """
    storage = DcpStorage(step_dir)
    names = storage.files()
    if names is None:
        raise DcpLayoutError(step_dir, "no such directory")
    if GLOBAL_METADATA in names:
        return _load_metadata(storage, GLOBAL_METADATA)
    own = rank_metadata_name(0 if rank is None else rank)
    if own in names:
        return _load_metadata(storage, own)
    raise DcpLayoutError(step_dir, f"no {GLOBAL_METADATA} and no {own}")


def _referenced(metadata: Metadata) -> dict[str, int]:
    """File name -> the end of the last item the metadata stores in it."""
    needed: dict[str, int] = {}
    storage_data: Mapping[Any, Any] = metadata.storage_data or {}
    for info in storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str):
            continue  # a storage layer of another kind: nothing we can check
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    return needed


def dcp_step_complete(step_dir: StepDir, *, world: int | None = None) -> DcpCompleteness:
    """Whether ``step_dir`` can be loaded by the world that saved it.

    Complete means: the metadata is readable, and every file it references exists
    with at least ``offset + length`` bytes for each item stored in it; with per-rank
    metadata, moreover, every rank ``0 .. world-1`` of the saving world has its
    metadata (and no rank at or above ``world`` left any file, which would mean a
    larger world saved it). ``world`` is only needed with per-rank metadata (see the
    module docstring); with global metadata it is checked against the ranks whose
    files the metadata references.

    It never raises for what the directory holds: a missing directory, missing or
    torn metadata and short files are `DcpCompleteness.problems`.

    Raises:
        ValueError: ``world`` is given and not positive.
    """
    if world is not None and world < 1:
        raise ValueError(f"world must be positive, got {world}")
    storage = DcpStorage(step_dir)
    where = storage.where
    names = storage.files()
    if names is None:
        return DcpCompleteness(where, False, "none", world, False, (), 0, ["no such directory"])
    problems: list[str] = []
    needed: dict[str, int] = {}
    if GLOBAL_METADATA in names:
        layout: Layout = "global"
        meta_names = [GLOBAL_METADATA]
    else:
        meta_names = sorted(
            (n for n in names if _RANK_METADATA.match(n)), key=lambda n: file_rank(n) or 0
        )
        layout = "per_rank" if meta_names else "none"
    for name in meta_names:
        needed[name] = names[name]
        try:
            metadata = _load_metadata(storage, name)
        except DcpLayoutError as exc:
            problems.append(exc.why)
            continue
        for ref, end in _referenced(metadata).items():
            needed[ref] = max(needed.get(ref, 0), end)

    seen = {r for n in names if (r := file_rank(n)) is not None}
    if layout == "none":
        problems.append(
            f"no metadata ({GLOBAL_METADATA} or __<rank>.metadata): the save did not finish"
        )
        saving_world, inferred = world, False
    elif layout == "global":
        saving_world = (
            world
            if world is not None
            else max((r for n in needed if (r := file_rank(n)) is not None), default=0) + 1
        )
        inferred = False
        above = sorted(r for n in needed if (r := file_rank(n)) is not None and r >= saving_world)
        if above:
            problems.append(
                f"{GLOBAL_METADATA} references files of rank {above[0]}: saved by a world "
                f"of at least {above[-1] + 1}, not {saving_world}"
            )
    else:
        inferred = world is None
        saving_world = world if world is not None else max(seen) + 1
        have = {file_rank(n) for n in meta_names}
        missing = [r for r in range(saving_world) if r not in have]
        if missing:
            problems.append(
                f"no metadata of rank(s) {_ranges(missing)} of the saving world of "
                f"{saving_world} (use_collectives=False: each rank writes its own)"
            )
        above = sorted(r for r in seen if r >= saving_world)
        if above:
            problems.append(
                f"files of rank {above[0]} present: saved by a world of at least "
                f"{above[-1] + 1}, not {saving_world}"
            )

    files = tuple(
        DcpFile(name, file_rank(name), needed[name], names.get(name)) for name in sorted(needed)
    )
    for f in files:
        if f.present is None:
            problems.append(f"{f.name}: missing")
        elif f.present < f.needed:
            problems.append(f"{f.name}: {f.present} bytes, the metadata needs {f.needed}")
    size = sum(f.present or 0 for f in files)
    return DcpCompleteness(
        where, not problems, layout, saving_world, inferred, files, size, problems
    )


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], -1]:
        if r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return ", ".join(out)
