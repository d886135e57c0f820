"""The marker, driven in-process with real files and real daemons.

Two daemons on loopback (node-1 hosts rank 0, node-2 rank 1), one `Marker` per node
watching one shared DeepSpeed-layout directory (ZeRO stage 1, data parallel 2), each
polled by hand with its own clock, so the settle period is exact and no test sleeps
for it. The files are zip archives, as torch.save writes them.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import LocalCluster, until

from convergenced.markers.layouts import (
    DeepSpeedLayout,
    LayoutError,
    MegatronLayout,
    World,
    make_layout,
)
from convergenced.markers.marker import Marker
from convergenced.markers.verify import Settler, zip_complete

FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
]


def zip_bytes(tag: str, name: str, size: int = 4096) -> bytes:
    """A small zip archive, the container torch.save writes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", (f"{tag}/{name}".encode() * size)[:size])
    return buf.getvalue()


def write_step(root: Path, step: int, names: list[str] = FILES, *, cut: str | None = None) -> Path:
    d = root / f"global_step{step}"
    d.mkdir(exist_ok=True)
    for name in names:
        data = zip_bytes(d.name, name)
        (d / name).write_bytes(data[: len(data) // 2] if name == cut else data)
    return d


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- layouts -------------------------------------------------------------------------


def test_ranks_map_to_coordinates_tensor_parallel_fastest() -> None:
    w = World(tp=2, pp=2, dp=2)
    assert [w.coords(r) for r in (0, 1, 2, 3, 4, 7)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1),
    ]  # fmt: skip
    with pytest.raises(LayoutError):
        w.coords(8)
    with pytest.raises(LayoutError):
        World(tp=0)


def test_deepspeed_names_each_ranks_files_as_deepspeed_writes_them(tmp_path: Path) -> None:
    z2 = DeepSpeedLayout(World(tp=2, dp=2), zero_stage=2)
    assert z2.files(tmp_path, [3]).by_rank[3] == [
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ]
    z3 = DeepSpeedLayout(World(dp=2), zero_stage=3, bf16_optimizer=True)
    assert z3.files(tmp_path, [1]).by_rank[1][0] == "zero_pp_rank_1_mp_rank_00_model_states.pt"
    assert z3.files(tmp_path, [1]).by_rank[1][1] == "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plain = DeepSpeedLayout(World(dp=4))
    assert plain.files(tmp_path, [2]).by_rank[2] == ["mp_rank_00_model_states.pt"]
    assert plain.step_of("global_step100") == 100
    assert plain.step_of("global_step100.tmp") is None
    assert plain.step_of("best") is None
    assert plain.latest_text(100) == b"global_step100"
    assert plain.read_latest(b"global_step7\n") == 7


def test_megatron_names_iteration_directories_and_model_parallel_files(tmp_path: Path) -> None:
    m = MegatronLayout(World(tp=2, pp=2, dp=2), distributed_optimizer=True)
    assert m.dirname(500) == "iter_0000500"
    assert m.step_of("iter_0000500") == 500
    assert m.step_of("iter_500") is None
    # rank 6 = tp 0, dp 1, pp 1: it reads the file its dp-0 peer (rank 4) wrote.
    assert m.files(tmp_path, [6]).by_rank[6] == [
        "mp_rank_00_001/model_optim_rng.pt",
        "mp_rank_00_001/distrib_optim.pt",
    ]
    assert MegatronLayout(World(tp=2)).files(tmp_path, [1]).by_rank[1] == [
        "mp_rank_01/model_optim_rng.pt"
    ]
    assert m.latest_text(500) == b"500"
    assert m.read_latest(b"release") is None


@pytest.mark.parametrize(
    ("fmt", "kwargs", "why"),
    [
        ("orbax", {}, "unknown format"),
        ("deepspeed", {"zero_stage": 4}, "zero stage"),
        ("megatron", {"zero_stage": 1}, "DeepSpeed's"),
        ("deepspeed", {"distributed_optimizer": True}, "megatron format"),
        ("deepspeed", {"tag": "step"}, "{step} exactly once"),
    ],
)
def test_a_layout_it_cannot_check_is_refused_with_the_reason(
    fmt: str, kwargs: dict[str, object], why: str
) -> None:
    with pytest.raises(LayoutError, match=why):
        make_layout(fmt, World(), **kwargs)  # type: ignore[arg-type]


# -- is a file finished ----------------------------------------------------------------


def test_a_torch_save_file_cut_short_is_not_complete_however_still(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"w": torch.arange(1000)}, path)
    assert zip_complete(path) is None
    data = path.read_bytes()
    for cut in (1, len(data) // 3, len(data) - 1):
        path.write_bytes(data[:cut])
        assert zip_complete(path) is not None, cut


def test_a_file_counts_only_after_holding_still_for_the_settle_period(tmp_path: Path) -> None:
    clock = Clock()
    settler = Settler(2.0, clock)
    path = tmp_path / "f"
    path.write_bytes(b"a")
    assert settler.look(path)[1] is False
    clock.now = 1.9
    assert settler.look(path)[1] is False
    path.write_bytes(b"ab")  # grew: the period starts again
    clock.now = 3.0
    assert settler.look(path)[1] is False
    clock.now = 5.0
    assert settler.look(path)[1] is True
    path.unlink()
    assert settler.look(path) == (None, False)


# -- markers on real daemons -------------------------------------------------------------


@pytest.fixture
def two(request: pytest.FixtureRequest) -> Iterator[tuple[LocalCluster, list[Marker], Path, Clock]]:
    # Retention in epochs (steps): 100 keeps every older step a rollback may reach.
    retention = getattr(request, "param", 100)
    with LocalCluster(2) as cluster:
        cluster.start_all()
        root = cluster.dir / "ckpt"
        root.mkdir()
        c1, c2 = cluster.client(1), cluster.client(2)
        spec = cluster.spec(retention=retention)
        c1.declare(spec)
        c2.declare(spec)
        clock = Clock()
        layout = DeepSpeedLayout(World(dp=2), zero_stage=1)
        markers = [
            Marker(
                c,
                layout,
                root,
                stream="job",
                ranks=[rank],
                domain="nvme",
                check_ranks=[0, 1],
                settle=1.0,
                clock=clock,
            )
            for rank, c in enumerate((c1, c2))
        ]
        yield cluster, markers, root, clock


def poll_all(markers: list[Marker], clock: Clock, step: float = 1.0) -> None:
    for m in markers:
        m.poll()
    clock.now += step


def latest(root: Path) -> str | None:
    try:
        return (root / "latest").read_text()
    except FileNotFoundError:
        return None


def converge(markers: list[Marker], clock: Clock, root: Path, want: str | None) -> None:
    def done() -> bool:
        poll_all(markers, clock, 0.5)
        return latest(root) == want

    until(done, what=f"latest == {want}")


def test_a_step_is_committed_only_once_whole_and_settled_then_latest_points_at_it(
    two: tuple[LocalCluster, list[Marker], Path, Clock],
) -> None:
    cluster, markers, root, clock = two
    step_dir = write_step(root, 10, cut=FILES[2])  # rank 1's optimizer file cut short
    for _ in range(3):
        poll_all(markers, clock)
    assert all(10 not in m.committed for m in markers)
    assert "zip" in markers[0].poll().waiting[10]
    assert latest(root) is None
    (step_dir / FILES[2]).write_bytes(zip_bytes(step_dir.name, FILES[2]))
    report = markers[0].poll()
    assert report.waiting[10].endswith("settling")  # just rewritten: the period starts again
    clock.now += 1.0
    converge(markers, clock, root, "global_step10")
    state = cluster.client(1).state("job")
    assert state["restore_point"] == 10
    assert markers[0].committed[10].digests[0][0].startswith("sha256:")
    # Each rank's size: its model states and both data-parallel optimizer partitions.
    assert markers[1].committed[10].digests[1][1] == sum(
        (step_dir / n).stat().st_size for n in FILES
    )


def test_a_latest_the_framework_wrote_is_put_back_on_the_agreed_step(
    two: tuple[LocalCluster, list[Marker], Path, Clock],
) -> None:
    _, markers, root, clock = two
    (root / "latest").write_text("global_step20")  # rank 0 saved, rank 1 never did
    write_step(root, 20, FILES[:2])
    poll_all(markers, clock)
    assert latest(root) is None  # no agreed step at all: no file
    write_step(root, 10)
    poll_all(markers, clock)
    converge(markers, clock, root, "global_step10")
    (root / "latest").write_text("global_step20")  # the framework again, after a save
    poll_all(markers, clock)
    assert latest(root) == "global_step10"


def test_latest_rolls_back_with_the_restore_point(
    two: tuple[LocalCluster, list[Marker], Path, Clock],
) -> None:
    cluster, markers, root, clock = two
    write_step(root, 10)
    write_step(root, 20)
    poll_all(markers, clock)
    converge(markers, clock, root, "global_step20")
    # node-2 finds rank 1's copy of step 20 damaged: the daemons roll back to 10.
    cluster.client(2).retract("job", 1, "nvme", 20)
    converge(markers, clock, root, "global_step10")
    # A file of a committed step rewritten in place (a step saved again): retracted.
    (root / "global_step10" / FILES[0]).write_bytes(zip_bytes("other", FILES[0]))
    report = markers[1].poll()
    assert report.retracted == [10]
    converge(markers, clock, root, None)
    clock.now += 1.0
    converge(markers, clock, root, "global_step10")  # the new bytes, settled, count again


@pytest.mark.parametrize("two", [0], indirect=True)
def test_gc_deletes_only_what_the_daemon_says_is_safe_retiring_first(
    two: tuple[LocalCluster, list[Marker], Path, Clock],
) -> None:
    cluster, markers, root, clock = two
    for m in markers:
        m.gc = True
    for step in (10, 20, 30):
        write_step(root, step)
    poll_all(markers, clock)

    def collected() -> bool:
        poll_all(markers, clock, 0.0)
        return not (root / "global_step10").exists() and not (root / "global_step20").exists()

    until(collected, what="steps 10 and 20 collected")
    assert latest(root) == "global_step30" and (root / "global_step30").is_dir()

    # The other node's marker finds the steps gone, safe to delete: it retires them.
    def retired() -> bool:
        poll_all(markers, clock, 0.5)
        return all(cluster.client(i).state("job")["recoverable"] == [[30, 30]] for i in (1, 2))

    until(retired, what="10 and 20 retired on both nodes")
    assert "rolled back" not in cluster.log(1) + cluster.log(2)


def test_a_generation_holds_latest_until_the_job_saves_a_new_step(
    two: tuple[LocalCluster, list[Marker], Path, Clock],
) -> None:
    cluster, markers, root, clock = two
    write_step(root, 10)
    write_step(root, 20, FILES[:2])  # the crash: rank 1's file of step 20 never came
    poll_all(markers, clock)
    poll_all(markers, clock)
    gen = int(cluster.client(1).next_generation("job")["generation"])
    for m in markers:
        m.generation, m.resolved = gen, False
    until(lambda: all([m.resolve(0.2) for m in markers]), what="generation resolved")
    assert [m.held for m in markers] == [10, 10]
    converge(markers, clock, root, "global_step10")
    # The old run's step 20 finishes landing (a late copy): agreed, but it was there
    # when the generation resolved, so latest stays where the relaunch reads it.
    write_step(root, 20)
    for _ in range(4):
        poll_all(markers, clock)
    until(lambda: cluster.client(1).state("job")["restore_point"] == 20, what="rp 20")
    poll_all(markers, clock)
    assert latest(root) == "global_step10"
    write_step(root, 30)  # the relaunched job saved: it read latest long ago
    poll_all(markers, clock)
    converge(markers, clock, root, "global_step30")
