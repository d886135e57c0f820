"""What a complete step looks like on disk, in each framework's own format.

A *layout* names a framework's step directories, says which files each rank of the
saving world needs to restore a step, and reads and writes the framework's "latest"
file. The marker (`convergenced.markers.marker`) asks it, and never guesses: a name
that does not parse as a step of the layout is not a step.

Ranks map to parallel coordinates the way Megatron-LM (and DeepSpeed with Megatron's
model-parallel unit) lays out its default process groups: tensor (model) parallel
fastest, then data parallel, then pipeline, that is
``rank = tp + TP * (dp + DP * pp)``.

- **DeepSpeed** (``engine.save_checkpoint(dir)``): ``dir/<tag>/`` with
  ``mp_rank_{mp:02d}_model_states.pt`` per model-parallel rank (ZeRO stage 3:
  ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`` per rank), and with ZeRO
  (stage 1-3) ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` per rank;
  ``dir/latest`` holds the tag. A rank's loader reads its model-parallel rank's model
  states and every data-parallel partition of its model-parallel rank's optimizer
  states (DeepSpeed's ``_get_all_zero_checkpoints``), so those are the rank's files.
  Tags are matched against a pattern (``global_step{step}`` by default). Pipeline
  parallel checkpoints (``layer_*-model_*`` files) are not supported.
- **Megatron-LM**, legacy format (``--ckpt-format torch``): ``dir/iter_{N:07d}/`` with
  ``mp_rank_{tp:02d}/model_optim_rng.pt`` (``mp_rank_{tp:02d}_{pp:03d}`` with
  pipeline parallelism; ``distrib_optim.pt`` beside it with the distributed
  optimizer), written by the data-parallel rank 0 of each model-parallel group and
  read by every rank of it; ``dir/latest_checkpointed_iteration.txt`` holds N.
- **Megatron-LM dist-ckpt** (``--ckpt-format torch_dist``) and **PyTorch DCP**: one
  DCP checkpoint per step (``.metadata`` and the files it references), judged
  complete by `convergenced.integrations.dcp_layout.dcp_step_complete`; every rank
  may read any file, so each rank's files are all of them.

Every ``.pt`` file must be a complete zip archive (what ``torch.save`` writes since
PyTorch 1.6: its central directory, written last, must be there and parse), so a
file cut short by a writer that died is never counted, however long it stays still.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FORMATS",
    "DcpLayout",
    "DeepSpeedLayout",
    "Layout",
    "LayoutError",
    "MegatronDistLayout",
    "MegatronLayout",
    "StepFiles",
    "World",
    "make_layout",
]


class LayoutError(ValueError):
    """The layout's parameters do not describe a world it can check."""


@dataclass(frozen=True)
class World:
    """The parallel layout of the world that saved the steps.

    Attributes:
        tp: tensor (model) parallel size; DeepSpeed's model-parallel size.
        pp: pipeline parallel size.
        dp: data parallel size.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise LayoutError(f"{name}: {value!r} is not a positive integer")

    @property
    def size(self) -> int:
        """How many ranks the world has."""
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of ``rank``: tensor parallel fastest, then data, then pipeline."""
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is outside a world of {self.size}")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


@dataclass
class StepFiles:
    """The files a step needs, per rank, and what is already known to be wrong.

    Attributes:
        by_rank: per rank asked for, the files (relative to the step directory) it
            reads to restore the step.
        problems: why the step cannot be complete whatever the files' state (its
            metadata is missing or names files that are not there).
        zip_files: the files that must be complete zip archives (``torch.save``).
    """

    by_rank: dict[int, list[str]]
    problems: list[str] = field(default_factory=list)
    zip_files: set[str] = field(default_factory=set)

    def all_files(self) -> list[str]:
        """Every file of every rank asked for, once, sorted."""
        return sorted({f for files in self.by_rank.values() for f in files})


class Layout(ABC):
    """One framework's checkpoint layout."""

    name: str
    """The ``--format`` value."""
    latest_name: str
    """The framework's "latest" file, in the checkpoint directory."""

    def __init__(self, world: World) -> None:
        self.world = world

    @abstractmethod
    def step_of(self, dirname: str) -> int | None:
        """The step a directory of the checkpoint directory holds (None: not a step)."""

    @abstractmethod
    def dirname(self, step: int) -> str:
        """The directory name of ``step``."""

    @abstractmethod
    def files(self, step_dir: Path, ranks: Iterable[int]) -> StepFiles:
        """The files each of ``ranks`` needs to restore the step in ``step_dir``."""

    def latest_text(self, step: int) -> bytes:
        """The content of the "latest" file pointing at ``step``."""
        return self.dirname(step).encode()

    def read_latest(self, data: bytes) -> int | None:
        """The step a "latest" file's content names (None: no step of this layout)."""
        try:
            return self.step_of(data.decode().strip())
        except UnicodeDecodeError:
            return None

    def steps(self, root: Path) -> dict[int, Path]:
        """The steps found in ``root``: step -> its directory.

        Raises:
            OSError: ``root`` cannot be listed.
        """
        found: dict[int, Path] = {}
        for entry in sorted(root.iterdir()):
            step = self.step_of(entry.name)
            if step is not None and entry.is_dir() and not entry.is_symlink():
                found[step] = entry
        return found


def _pattern(template: str) -> re.Pattern[str]:
    if template.count("{step}") != 1:
        raise LayoutError(f"tag pattern {template!r} must hold {{step}} exactly once")
    head, _, tail = template.partition("{step}")
    return re.compile(re.escape(head) + r"(0|[1-9][0-9]{0,17})" + re.escape(tail))


class DeepSpeedLayout(Layout):
    """DeepSpeed's ``save_checkpoint`` layout (see the module docstring)."""

    name = "deepspeed"
    latest_name = "latest"

    def __init__(
        self,
        world: World,
        *,
        zero_stage: int = 0,
        bf16_optimizer: bool = False,
        tag: str = "global_step{step}",
    ) -> None:
        super().__init__(world)
        if world.pp != 1:
            raise LayoutError(
                "deepspeed: pipeline-parallel checkpoints (layer_*-model_* files) are not supported"
            )
        if zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"deepspeed: zero stage {zero_stage!r} is not 0, 1, 2 or 3")
        if bf16_optimizer and zero_stage == 0:
            raise LayoutError("deepspeed: the bf16 optimizer's files are ZeRO files: give a stage")
        self.zero_stage = zero_stage
        self.bf16_optimizer = bf16_optimizer
        self.tag = tag
        self._re = _pattern(tag)

    def step_of(self, dirname: str) -> int | None:
        m = self._re.fullmatch(dirname)
        return int(m.group(1)) if m else None

    def dirname(self, step: int) -> str:
        return self.tag.replace("{step}", str(step))

    def files(self, step_dir: Path, ranks: Iterable[int]) -> StepFiles:
        optim = "bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
        if not self.bf16_optimizer:
            optim = optim.removeprefix("bf16_")
        by_rank: dict[int, list[str]] = {}
        for rank in ranks:
            mp, dp, _ = self.world.coords(rank)
            if self.zero_stage == 3:
                files = [f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"]
            else:
                files = [f"mp_rank_{mp:02d}_model_states.pt"]
            if self.zero_stage:
                files += [optim.format(dp=d, mp=mp) for d in range(self.world.dp)]
            by_rank[rank] = files
        out = StepFiles(by_rank)
        out.zip_files = set(out.all_files())
        return out


class MegatronLayout(Layout):
    """Megatron-LM's legacy (``torch``) checkpoint layout."""

    name = "megatron"
    latest_name = "latest_checkpointed_iteration.txt"
    _re = re.compile(r"iter_([0-9]{7,18})")

    def __init__(self, world: World, *, distributed_optimizer: bool = False) -> None:
        super().__init__(world)
        self.distributed_optimizer = distributed_optimizer

    def step_of(self, dirname: str) -> int | None:
        m = self._re.fullmatch(dirname)
        return int(m.group(1)) if m else None

    def dirname(self, step: int) -> str:
        return f"iter_{step:07d}"

    def latest_text(self, step: int) -> bytes:
        return str(step).encode()  # what Megatron writes: the iteration, no newline

    def read_latest(self, data: bytes) -> int | None:
        text = data.decode(errors="replace").strip()
        return int(text) if text.isascii() and text.isdigit() else None  # "release": none

    def files(self, step_dir: Path, ranks: Iterable[int]) -> StepFiles:
        by_rank: dict[int, list[str]] = {}
        for rank in ranks:
            tp, _, pp = self.world.coords(rank)
            group = f"mp_rank_{tp:02d}" if self.world.pp == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
            files = [f"{group}/model_optim_rng.pt"]
            if self.distributed_optimizer:
                files.append(f"{group}/distrib_optim.pt")
            by_rank[rank] = files
        out = StepFiles(by_rank)
        out.zip_files = set(out.all_files())
        return out


class DcpLayout(Layout):
    """A PyTorch DCP checkpoint per step, named by a pattern (``step-{step}``)."""

    name = "dcp"
    latest_name = "latest"

    def __init__(self, world: World, *, step_format: str = "step-{step}") -> None:
        super().__init__(world)
        self.step_format = step_format
        self._re = _pattern(step_format)

    def step_of(self, dirname: str) -> int | None:
        m = self._re.fullmatch(dirname)
        return int(m.group(1)) if m else None

    def dirname(self, step: int) -> str:
        return self.step_format.replace("{step}", str(step))

    def _extra(self) -> list[str]:
        return []

    def files(self, step_dir: Path, ranks: Iterable[int]) -> StepFiles:
        from convergenced.integrations.dcp_layout import dcp_step_complete

        ranks = list(ranks)
        problems: list[str] = []
        files: list[str] = []
        try:
            done = dcp_step_complete(step_dir, world=self.world.size)
        except Exception as exc:  # any unreadable metadata: not complete
            problems.append(f"{step_dir.name}: DCP metadata unreadable: {exc}")
        else:
            problems.extend(done.problems)
            files = sorted(f.name for f in done.files)
        files += [f for f in self._extra() if f not in files]
        zips = {f for f in files if f.endswith(".pt")}
        return StepFiles({r: list(files) for r in ranks}, problems, zips)


class MegatronDistLayout(DcpLayout):
    """Megatron-LM's dist-ckpt (``torch_dist``): DCP under ``iter_{N:07d}``, with
    Megatron's ``common.pt`` and ``metadata.json`` beside it."""

    name = "megatron-dist"
    latest_name = MegatronLayout.latest_name

    def __init__(self, world: World) -> None:
        super().__init__(world, step_format="iter_{step}")
        self._re = MegatronLayout._re

    def dirname(self, step: int) -> str:
        return f"iter_{step:07d}"

    def _extra(self) -> list[str]:
        return ["common.pt", "metadata.json"]

    latest_text = MegatronLayout.latest_text
    read_latest = MegatronLayout.read_latest


FORMATS = ("deepspeed", "megatron", "megatron-dist", "dcp")
"""The ``--format`` values."""


def make_layout(
    fmt: str,
    world: World,
    *,
    zero_stage: int = 0,
    bf16_optimizer: bool = False,
    distributed_optimizer: bool = False,
    tag: str | None = None,
) -> Layout:
    """The layout of ``fmt`` for ``world``.

    Raises:
        LayoutError: an unknown format, or options it does not take.
    """
    if fmt not in FORMATS:
        raise LayoutError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt != "deepspeed" and (zero_stage or bf16_optimizer):
        raise LayoutError(f"{fmt}: --zero-stage and --bf16-optimizer are DeepSpeed's")
    if fmt != "megatron" and distributed_optimizer:
        raise LayoutError(f"{fmt}: --distributed-optimizer is for the megatron format")
    if tag is not None and fmt not in ("deepspeed", "dcp"):
        raise LayoutError(f"{fmt}: --tag is for the deepspeed and dcp formats")
    if fmt == "deepspeed":
        return DeepSpeedLayout(
            world, zero_stage=zero_stage, bf16_optimizer=bf16_optimizer,
            tag=tag or "global_step{step}",
        )  # fmt: skip
    if fmt == "megatron":
        return MegatronLayout(world, distributed_optimizer=distributed_optimizer)
    if fmt == "megatron-dist":
        return MegatronDistLayout(world)
    return DcpLayout(world, step_format=tag or "step-{step}")
