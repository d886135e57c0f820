"""torchtitan's checkpoints, restored, committed and purged as the daemon agrees.

torchtitan's `CheckpointManager` (``torchtitan.components.checkpoint``) saves each
checkpoint as a DCP directory ``<dump_folder>/<folder>/step-<N>``. On its own, at a
restart, every rank lists that folder and loads the highest ``step-N`` holding a
``.metadata`` file, each by its own listing; and rank 0 deletes all but the newest
``keep_latest_k`` step directories right after dispatching a save, counting the one
still being written. Nothing checks that the step every rank picks is the same, nor
that every rank's files of it are there.

`ConvergencedCheckpointManager` is that manager with three seams replaced, and its saves timed:

* **load** (``load(step=-1)``, what the trainer calls first): every rank asks its
  daemon for the restore point of the launch's recovery generation and loads exactly
  that step, the same on every rank, or starts fresh (torchtitan's ``initial_load_path``
  rules then apply) when no step is restorable everywhere. Never the highest step with
  ``.metadata``. An explicit ``load_step`` is loaded as torchtitan does.
* **save**: the DCP save goes through `convergenced.integrations.dcp.DcpCheckpointer`,
  whose storage writer commits this rank's part of the step to its daemon only once
  the step is loadable; an asynchronous save (``async_mode``) commits when it
  completes. A model-only final save (``last_save_model_only``, the default) and a
  Hugging Face export are not training states a run can resume from: they are written
  as torchtitan writes them and never committed.
* **overhead**: each save the trainer waits for is timed, from the wait for the
  previous asynchronous save to the purge (and a pinned-memory save's staging wait),
  and reported to the daemon, best effort: the checkpoint overhead figure of
  docs/verification.md. Exports are not counted.
* **purge** (``keep_latest_k`` > 0): each rank deletes only the steps the daemon lists
  as safe to delete (older than every member's restore point, minus the spec's
  ``retention``), retiring them first, and never one of the newest ``keep_latest_k``.

The manager is built by torchtitan's config system, like the one it replaces::

    from convergenced.integrations.torchtitan import ConvergencedCheckpointManager

    config.checkpoint = ConvergencedCheckpointManager.Config(
        enable=True,
        folder="checkpoint",  # on a file system every host mounts
        interval=500,
        spec_file="/etc/job/spec.json",  # this launch's hosts: node id -> ranks
        domain="pfs",  # the persistence domain that folder is
        async_mode="async",
    )

Creating it is a collective of the default process group (torchtitan creates its
checkpointer on every rank, after the process group): rank 0 asks its daemon for a new
launch (`convergenced.integrations.launches.shared_launch`) and broadcasts it; every
rank declares the spec for it. Given ``stream`` (a name the job declared itself) in
place of ``spec_file``, rank 0 asks for a new generation at load instead.

This module imports torchtitan (and torch) only when the class is first used
(``pip install 'convergenced[torchtitan]'``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
import tomllib
from pathlib import Path
from typing import Any

from convergenced.core.spec import StreamSpec

# ConvergencedCheckpointManager, the class, comes from __getattr__ (it imports torchtitan).
__all__ = ["load_spec", "manager_class", "resumable", "step_of"]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")
_OPTIMIZER = "optimizer."  # torchtitan's OPTIMIZER key, as DCP flattens it


def step_of(checkpoint_id: str | os.PathLike[str]) -> int | None:
    """The step of a torchtitan checkpoint directory (``.../step-<N>``); None for any
    other name."""
    name = os.fspath(checkpoint_id).rstrip("/").rsplit("/", 1)[-1]
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def resumable(step_dir: str | os.PathLike[str]) -> bool:
    """Whether a torchtitan step directory holds a training state a run resumes from:
    its DCP metadata names optimizer state. A model-only export (torchtitan's default
    last step, a seed checkpoint) does not.

    Raises:
        DcpLayoutError: the metadata cannot be read.
    """
    from convergenced.integrations.dcp_layout import read_dcp_metadata

    keys = read_dcp_metadata(step_dir).state_dict_metadata
    return any(k.startswith(_OPTIMIZER) for k in keys)


def load_spec(path: str | os.PathLike[str]) -> StreamSpec:
    """The stream spec in a JSON or TOML file (by suffix; else JSON), the map
    ``declare`` takes, as ``convergencectl declare --spec`` reads it.

    Raises:
        ValueError: the file cannot be read or parsed, or is not a valid spec (a
            `SpecError` names the field).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        data = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"checkpoint.spec_file {p}: {exc}") from None
    if isinstance(data, dict) and set(data) == {"spec"} and isinstance(data["spec"], dict):
        data = data["spec"]
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint.spec_file {p}: expected a map, found {type(data).__name__}")
    return StreamSpec.from_wire(data)


def manager_class() -> type[Any]:
    """`ConvergencedCheckpointManager` (imports torchtitan the first time).

    Raises:
        ImportError: torchtitan is not installed.
    """
    return _build()


def __getattr__(name: str) -> Any:
    # The class derives from torchtitan's: built on first use, so that importing this
    # module (or convergenced.integrations) never imports torchtitan.
    if name == "ConvergencedCheckpointManager":
        return _build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _build() -> type[Any]:
    try:
        from torchtitan.components.checkpoint import (  # type: ignore[import-untyped]
            AsyncMode,
            CheckpointManager,
        )
    except ImportError as exc:
        raise ImportError(
            "convergenced.integrations.torchtitan needs torchtitan: "
            "pip install 'convergenced[torchtitan]'"
        ) from exc
    return _define(CheckpointManager, AsyncMode)


class _NotAsked:
    """`_find_load_step` outside `_load`: torchtitan's own rule."""


_NOT_ASKED = _NotAsked()


def _define(base: Any, async_modes: Any) -> type[Any]:
    """The subclass of torchtitan's ``CheckpointManager`` ``base`` (see the module
    docstring); ``async_modes`` is its ``AsyncMode`` enum."""
    from dataclasses import dataclass, replace

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torchtitan.tools import filesystem  # type: ignore[import-untyped]
    from torchtitan.tools.utils import GarbageCollection  # type: ignore[import-untyped]

    from convergenced.client import Client
    from convergenced.core.local_api_codec import ApiError, ErrorKind
    from convergenced.integrations.dcp import DcpCheckpointer
    from convergenced.integrations.dcp_layout import DcpCompleteness
    from convergenced.integrations.errors import (
        NoRestorePointError,
        RestorePointLostError,
        ShardUnavailableError,
    )
    from convergenced.integrations.launches import Launch, shared_generation, shared_launch

    class TitanDcp(DcpCheckpointer):
        """The DCP checkpointer, for whom a model-only export is never a whole step:
        it is not committed again on open, nor loaded as a restore point."""

        times_saves = False  # the manager times all of a save the loop waits for

        def complete(self, epoch: int) -> DcpCompleteness:
            found = super().complete(epoch)
            if found.ok and not resumable(found.step_dir):
                why = "a model-only export (no optimizer state): not a training state"
                return replace(found, ok=False, problems=[why])
            return found

    def everywhere(ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the default group (a collective)."""
        backend = str(dist.get_backend())
        device = "cpu" if "gloo" in backend or not torch.cuda.is_available() else "cuda"
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    class ConvergencedCheckpointManager(base):  # type: ignore[misc]
        """torchtitan's DCP checkpoint manager, restoring, committing and purging as
        this rank's convergenced daemon agrees (see the module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):  # type: ignore[misc]
            """torchtitan's checkpoint configuration, and the stream it commits to."""

            spec_file: str = ""
            """JSON or TOML file of the stream's spec (the map ``declare`` takes) with
            this launch's hosts: node id -> the ranks it hosts. Every rank reads it;
            the manager declares it for a new launch."""

            stream: str = ""
            """Instead of ``spec_file``: the name of a stream the job declared itself."""

            domain: str = ""
            """The persistence domain the checkpoint folder is (one of the policy's
            domains; shared in the spec when every host mounts the folder)."""

            socket: str = ""
            """This rank's daemon socket ("": ``$CONVERGENCED_SOCKET``, else the
            default path)."""

            restore_timeout: float = 300.0
            """Seconds a load waits for every member to ask for the restore point."""

            def __post_init__(self) -> None:
                base.Config.__post_init__(self)
                if not self.enable:
                    return
                if bool(self.spec_file) == bool(self.stream):
                    raise ValueError(
                        "checkpoint: give spec_file (the stream's spec, declared for "
                        "each launch) or stream (a stream the job declared), one of them"
                    )
                if not self.domain:
                    raise ValueError(
                        "checkpoint.domain: name the persistence domain the checkpoint "
                        "folder is in (one of the stream policy's domains)"
                    )
                if not self.restore_timeout > 0:
                    raise ValueError(
                        f"checkpoint.restore_timeout: {self.restore_timeout} is not positive"
                    )

        def __init__(
            self,
            config: Any,
            *,
            dataloader: Any,
            model_parts: Any,
            optimizers: Any,
            lr_schedulers: Any,
            states: dict[str, Any],
            sd_adapter: Any,
            base_folder: str = "",
        ) -> None:
            super().__init__(
                config, dataloader=dataloader, model_parts=model_parts,
                optimizers=optimizers, lr_schedulers=lr_schedulers, states=states,
                sd_adapter=sd_adapter, base_folder=base_folder,
            )  # fmt: skip
            if not self.enable:
                return
            self.restore_timeout = float(config.restore_timeout)
            self.rank = dist.get_rank()
            self.client = Client(config.socket or None)
            """This rank's client of its node's daemon."""
            stream: str | StreamSpec = config.stream
            self.launch: Launch | None = None
            """The launch (its generation and membership), when given the spec."""
            if config.spec_file:
                stream = load_spec(config.spec_file)
                if config.domain not in stream.policy.domains:
                    raise ValueError(
                        f"checkpoint.domain {config.domain!r} is not one of the domains "
                        f"of stream {stream.name!r}'s policy {list(stream.policy.domains)}"
                    )
                self.launch = shared_launch(self.client, stream)  # a collective
            self.convergenced = TitanDcp(
                self.client, stream, self.rank, self.folder, domain=config.domain,
                launch=self.launch,
            )  # fmt: skip
            """The DCP checkpointer that commits, answers the restore point and purges."""
            self.generation: int | None = None
            """The recovery generation the last load asked for."""
            self.restored_step: int | None = None
            """The step the last load restored (None: it started fresh)."""
            self.deleted: list[Any] = []
            """What purges deleted so far (the dcp checkpointer's records)."""
            self._agreed: int | _NotAsked | None = _NOT_ASKED
            self._exporting = False
            self._committing = False  # the save in progress is one dcp_save commits

        # -- load: the agreed restore point ---------------------------------------------

        def _load(self, step: int = -1) -> bool:
            if step != -1:  # an explicit load_step: the user's choice, as torchtitan does
                return bool(super()._load(step))
            epoch = self._agreed_step()
            if epoch is not None and not filesystem.isdir(self._create_checkpoint_id(epoch)):
                # torchtitan would start fresh on this rank while the others resume.
                raise RestorePointLostError(self.convergenced.stream, self.generation or 0, epoch)
            self._agreed = epoch
            try:
                loaded = bool(super()._load(-1))  # asks _find_load_step, below
            finally:
                self._agreed = _NOT_ASKED
            self.restored_step = epoch if loaded else None
            return loaded

        def _agreed_step(self) -> int | None:
            """The restore point of this launch's generation, or None when no step is
            restorable everywhere; every rank asks (a collective).

            The step must still be whole on every rank: a rank that finds its part
            gone or damaged since it was committed retracts it, and every rank asks
            again under a new generation (rank 0 asks for it and broadcasts it), whose
            restore point is an older step.
            """
            cvg = self.convergenced
            if self.launch is not None:
                generation = self.launch.generation
            else:
                generation = cvg.generation(self.restore_timeout)
            broken: set[int] = set()  # steps some rank found not whole: retracted
            while True:
                self.generation = generation
                try:
                    epoch = int(cvg.agreed_epoch(generation, self.restore_timeout))
                except NoRestorePointError:
                    return None
                except RestorePointLostError as lost:
                    # Another rank found the step not whole and retracted it before
                    # this one asked: vote "not whole" with it, then ask again.
                    everywhere(False)
                    broken.add(lost.epoch)
                    generation = shared_generation(self.client, cvg.stream,
                                                   timeout=self.restore_timeout)  # fmt: skip
                    continue
                if epoch in broken:
                    # Agreed again after its retraction: restorable in another of the
                    # policy's domains, which this manager does not read. Every rank
                    # got the same answer, so every rank raises here.
                    raise ShardUnavailableError(
                        cvg.stream, self.rank, epoch,
                        [f"not whole in {cvg.domain!r}, and agreed again after retraction"],
                    )  # fmt: skip
                found = cvg.complete(epoch)
                if not found.ok:
                    logger.warning(
                        "stream %r rank %d: the agreed step %d is no longer whole here "
                        "(%s): retracted, asking a new generation",
                        cvg.stream, self.rank, epoch, "; ".join(found.problems),
                    )  # fmt: skip
                    try:
                        self.client.retract(cvg.stream, self.rank, cvg.domain, epoch)
                    except ApiError as exc:
                        if exc.kind is not ErrorKind.REJECTED:
                            raise
                if everywhere(found.ok):
                    return epoch
                broken.add(epoch)
                generation = shared_generation(self.client, cvg.stream,
                                               timeout=self.restore_timeout)  # fmt: skip

        def _find_load_step(self, folder: str = "") -> int:
            if isinstance(self._agreed, _NotAsked) or folder not in ("", self.folder):
                return int(super()._find_load_step(folder))
            # -1: nothing restorable everywhere; torchtitan then starts fresh (or from
            # initial_load_path), whatever step directories the folder holds.
            return -1 if self._agreed is None else self._agreed

        # -- save: commit what is loadable -----------------------------------------------

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            # Timed whole: the wait for the previous asynchronous save, the garbage
            # collections, the staging and the purge all hold the training loop.
            started = time.perf_counter()
            self._committing = False
            saved = bool(super()._save(curr_step, last_step))
            if saved and self._committing:  # an export is not a checkpoint's cost
                self.convergenced.save_timer.saved(started, time.perf_counter() - started)
            return saved

        def _maybe_wait_for_staging(self) -> None:
            # The trainer waits for a pinned-memory save's staging after the save
            # returned: counted with the next save.
            started = time.perf_counter()
            super()._maybe_wait_for_staging()
            self.convergenced.save_timer.extra_s += time.perf_counter() - started

        def dcp_save(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            async_mode: Any,
            enable_garbage_collection: bool = False,
            to_hf: bool = False,
        ) -> Any:
            epoch = step_of(checkpoint_id)
            if (
                to_hf
                or self._exporting
                or epoch is None
                or checkpoint_id != self._create_checkpoint_id(epoch)
            ):  # an export (a model only, or Hugging Face's format): never committed
                return super().dcp_save(
                    state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
                )
            self._committing = True
            result: Any = None
            if async_mode == async_modes.ASYNC:
                result = self.convergenced.async_save(state_dict, epoch, process_group=self.pg)
            elif async_mode == async_modes.ASYNC_WITH_PINNED_MEM:
                result = self.convergenced.async_save(
                    state_dict, epoch, process_group=self.pg,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self.stager,
                )  # fmt: skip
            else:
                self.convergenced.save(state_dict, epoch)
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return result

        def _save_last_step(self, curr_step: int) -> None:
            # A model-only final save is an export, not a state a run can resume from.
            self._exporting = bool(self.last_save_model_only)
            try:
                super()._save_last_step(curr_step)
            finally:
                self._exporting = False

        # -- purge: only what the daemon says is safe ----------------------------------

        def _purge_stale_checkpoints(self) -> None:
            if self.keep_latest_k > 0:
                self.deleted.extend(self.convergenced.gc())

        def _close(self) -> None:
            # Also called from __del__, on a manager whose __init__ may have raised.
            try:
                super()._close()
                cvg = getattr(self, "convergenced", None)
                if cvg is not None:
                    cvg.close()  # waits for async saves still committing
            finally:
                client = getattr(self, "client", None)
                if client is not None:
                    client.close()

    return ConvergencedCheckpointManager
