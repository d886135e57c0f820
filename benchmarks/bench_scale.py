"""Scale: handshake rounds and bytes per node to agreement, from the simulator, beside
the epidemic gossip (fanout 3) that Serf and memberlist users know.

Two sides, one run:

1. **convergenced, measured.** The real deterministic simulator
   (`convergenced.sim.world.Simulation`: the real sans-IO protocol core, a simulated
   network, the oracle checking S1-S5), fault-free, no training workload: after a
   short warm-up (``--warmup-ms`` of virtual time, default 20, as the simulator's own
   overlay test uses; the links form and every node declares the stream), every rank
   of every node commits one new epoch in every domain, and the run ends when every
   node's restore point is that epoch. N = 16, 32, 64, ... doubling: every N up to
   1024 is measured (with fewer seeds once over budget), larger N while the next N's
   predicted cost fits the wall-time budget (``--budget-s``): the cost of one seed is
   predicted from the growth of the last two measured N, and the doubling stops when
   the prediction does not fit what is left of the budget. Larger N are listed as not
   measured; nothing is extrapolated into the tables. Several seeds per N (one process
   each, ``--jobs`` at a time), medians over the seeds. Up to 16 nodes the overlay is
   a full mesh, past it the Chord-finger overlay of `convergenced.core.overlay`.

   Definitions (the simulator's own, `Result.rounds_to_converge` and
   `Result.bytes_per_node_per_round`): ``t_final`` is the virtual time at which the
   last of those final commits became durable; ``t_agree`` the first moment every
   node reports the true newest common epoch as its restore point. *Rounds to
   agreement* = ceil((t_agree - t_final) / RTT), RTT = 2 x the one-way latency
   (200 us, no jitter, in this phase): handshake round trips. *Bytes per node to
   agreement* = frame bytes delivered on all links between t_final and t_agree, / N
   (= bytes_per_node_per_round x rounds); frame bytes are convergenced's wire frames
   (12-byte header + msgpack body), without TCP/IP headers; the simulator does not
   sign records (a signed record carries 64 bytes more). *Messages* are frames
   delivered in the same window. Also shown, as the profile of where bytes and time
   go: record copies sent per (node, origin) in that window, and the wall time of a
   seed split into warm-up and final commit -> agreement.

2. **Epidemic gossip, fanout 3, simulated model** (seeded `random.Random`, Python ints
   as bitsets; cheap enough for N = 16 ... 4096). Every node starts with one new
   update (its own constraint set; size = the median packed size of the records in a
   node's view at the end of the largest convergenced run measured). Each round,
   every node that has something to send picks 3 distinct random peers and sends one
   message to each, carrying every update it has transmitted fewer than
   ``L = RetransmitMult x ceil(log10(N + 1))`` times (RetransmitMult = 4, memberlist's
   default; the count goes up per message, as memberlist's TransmitLimitedQueue
   counts); an update received in round t is forwarded from round t + 1. *Rounds* =
   rounds until every node knows all N updates (agreement needs everyone's state);
   when the bounded retransmits die out first, that seed is reported as not reaching
   everyone, with the node-update pairs missed (nothing patches it). *Bytes per node*
   = (updates sent x (update size + 3 bytes: memberlist's part length and message
   type) + messages x 12 bytes (the same frame header convergenced pays)) / N, no
   UDP/IP headers, no packet-size cap; shown both up to the round everyone knows
   everything and up to quiescence (nodes cannot tell when to stop).

   Where the model differs from convergenced: a gossip round is one one-way push per
   gossip interval (memberlist: 200 ms on a LAN), a convergenced round is a round trip
   on a link (network latency); gossip has no agreement phase: when it ends every node
   holds every state but does not know that the others do, whereas convergenced's
   two-phase handshake also establishes that every member proposed the epoch (its
   restore point is known to be consistent everywhere); memberlist's periodic
   push-pull anti-entropy and its UDP packet cap (about 1400 bytes) are not modelled.

The verdict on the issue's target, "rounds to agreement grow as O(log N)", is computed
from the measured medians: met when every measured median stays within the bound the
design gives for fault-free runs, 2 x ceil(log2 N) (two phases, each crossing the
overlay's diameter of at most ceil(log2 N) hops); the fit rounds = a + b log2 N and
the log-log slope are printed beside it. Only the measured range is judged. Nothing
here is tuned to meet the target.

Usage::

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--json] [--out DIR]
        [--budget-s S] [--seeds K] [--jobs J] [--max-nodes N] [--nodes N ...]
        [--gossip-seeds K] [--warmup-ms MS] [--profile N]

``--nodes N ...`` measures exactly those N instead of the doubling, whatever the
budget (``--nodes 1024 --seeds 1``: one seed at N = 1024, about ten CPU-minutes and
1.9 GB on this machine). Below the table, the cost of one seed at the N not
measured (up to 4096) is *predicted* from power laws fitted to the CPU time and peak
RSS of the largest measured N, and labelled as such.

``--quick``: N = 16 and 32, one seed, gossip up to 256 (< 15 s). ``--json`` also
prints one JSON object with every number on the last line. ``--out DIR`` writes
``DIR/scale.md`` (the command, definitions, tables and the verdict) and
``DIR/scale.png`` (log-log: rounds and bytes per node against N). ``--profile N``
also runs one seed at N under cProfile and prints where its time goes (protocol core,
simulator, msgpack, the rest). A full run takes about twenty minutes on an idle
2-core machine: N = 16..512 in about three, N = 1024 (two seeds at once, each about
ten CPU-minutes and 1.9 GB) in about twelve, then the gossip model and the plot.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import math
import multiprocessing
import pstats
import random
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bench_daemon as bd  # noqa: E402
import report  # noqa: E402

from convergenced.core.facts import Fact  # noqa: E402
from convergenced.core.overlay import DEFAULT_MESH_LIMIT  # noqa: E402
from convergenced.sim.world import STREAM, SimConfig, Simulation, liveness_bound  # noqa: E402

FANOUT = 3
RETRANSMIT_MULT = 4
"""memberlist's default RetransmitMult."""
FRAME_HEADER = 12
"""Bytes of framing per message charged to the gossip model (convergenced's header)."""
UPDATE_FRAMING = 3
"""Bytes per gossiped update on top of the record: memberlist's compound-message part
length (2) and message type (1)."""
DEFAULT_BUDGET_S = 420.0
MAX_NODES = 4096
FIRST_NODES = 16


# -- configuration -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one run of the whole benchmark."""

    mode: str
    budget_s: float
    seeds: int
    jobs: int
    max_nodes: int
    gossip_seeds: int
    gossip_max_nodes: int
    warmup_us: int
    nodes: tuple[int, ...] = ()
    """Exactly these N (``--nodes``), each measured whatever the budget; empty: N = 16
    doubling while the budget allows."""
    always_upto: int = 0
    """The doubling measures every N up to this one whatever the budget (one wave of
    ``jobs`` seeds once over it); past it, only what the budget allows."""


ALWAYS_UPTO = 1024
"""The issue's target: the scale table reaches N = 1024."""
FULL = Config("full", DEFAULT_BUDGET_S, 3, 2, MAX_NODES, 9, MAX_NODES, 20_000,
              always_upto=ALWAYS_UPTO)  # fmt: skip
QUICK = Config("quick", 8.0, 1, 2, 32, 3, 256, 20_000, nodes=(16, 32))
"""The smoke run: both N always, however loaded the machine (its budget would skip
N = 32 when N = 16 ran slowly)."""


# -- convergenced: the simulator ---------------------------------------------------


class _ScaleSimulation(Simulation):
    """The simulator, unchanged, plus a snapshot of the counters at ``t_final`` (the
    simulator keeps only the bytes) and wall-clock marks for the profile."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.wall_start = 0.0
        self.wall_final: float | None = None
        self.messages_at_final = 0
        self.records_at_final = 0

    def records_sent(self) -> int:
        """Records sent so far over every link (fault-free: no link ever closes)."""
        return sum(link.records_sent for c in self.conns.values() for link in c.links.values())

    def _durable(self, nid: str, fact: Fact) -> None:
        super()._durable(nid, fact)
        if self.liveness.t_final is not None and self.wall_final is None:
            self.wall_final = time.perf_counter()
            self.messages_at_final = self.net.messages
            self.records_at_final = self.records_sent()


def sim_config(nodes: int, seed: int, warmup_us: int) -> SimConfig:
    """A fault-free scale run: no workload, only the final commit."""
    return SimConfig(
        nodes=nodes, seed=seed, faults=frozenset(), workload=False, safety_us=warmup_us
    )


def run_seed(task: tuple[int, int, int]) -> dict[str, Any]:
    """One seed of the simulator at N nodes (runs in a worker process)."""
    nodes, seed, warmup_us = task
    cpu0 = _cpu_s()
    sim = _ScaleSimulation(sim_config(nodes, seed, warmup_us))
    sim.wall_start = start = time.perf_counter()
    r = sim.run()
    end = time.perf_counter()
    out: dict[str, Any] = {
        "nodes": nodes,
        "seed": seed,
        "converged": r.converged,
        "violation": None if r.violation is None else str(r.violation),
        "rounds": r.rounds_to_converge,
        "bytes_total": r.bytes,
        "messages_total": r.messages,
        "events": r.events,
        "trace_hash": r.trace_hash,
        "wall_s": round(end - start, 3),
        "cpu_s": round(_cpu_s() - cpu0, 3),
        "frames_per_cpu_s": round(r.messages / max(_cpu_s() - cpu0, 1e-9)),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "links_per_node": round(2 * len(sim.pairs) / nodes, 2),
    }
    if sim.wall_final is not None:
        out["warmup_wall_s"] = round(sim.wall_final - start, 3)
        out["agree_wall_s"] = round(end - sim.wall_final, 3)
    if r.converged and r.rounds_to_converge is not None:
        spent = r.bytes - sim.liveness.bytes_at_final
        messages = r.messages - sim.messages_at_final
        records = sim.records_sent() - sim.records_at_final
        out |= {
            "bytes_to_agree": spent,
            "bytes_per_node": round(spent / nodes, 1),
            "bytes_per_node_per_round": round(r.bytes_per_node_per_round, 1),
            "messages_to_agree": messages,
            "messages_per_node": round(messages / nodes, 2),
            "records_to_agree": records,
            "record_copies_per_node_origin": round(records / (nodes * (nodes - 1)), 3),
        }
    sizes = sorted(len(rec.packed()) for rec in _final_view(sim))
    if sizes:
        out["record_bytes"] = {
            "median": statistics.median_low(sizes),
            "min": sizes[0],
            "max": sizes[-1],
            "count": len(sizes),
        }
    return out


def _final_view(sim: Simulation) -> list[Any]:
    core = sim.nodes[sim.ids[0]].core
    if core is None:
        return []
    return list(core.view.stream(STREAM).values())


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_batch(tasks: list[tuple[int, int, int]], jobs: int) -> list[dict[str, Any]]:
    """Every task in its own fresh process (so each RSS is its own), ``jobs`` at once."""
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(max(1, min(jobs, len(tasks))), maxtasksperchild=1) as pool:
        return pool.map(run_seed, tasks, chunksize=1)


def summarize_n(nodes: int, runs: list[dict[str, Any]], batch_wall_s: float) -> dict[str, Any]:
    """Medians (and the max of rounds) over the seeds of one N."""
    ok = [r for r in runs if r["converged"] and r["violation"] is None]
    rounds = [r["rounds"] for r in ok]
    out: dict[str, Any] = {
        "nodes": nodes,
        "seeds": [r["seed"] for r in runs],
        "converged": len(ok),
        "failures": [
            {"seed": r["seed"], "violation": r["violation"], "converged": r["converged"]}
            for r in runs
            if r not in ok
        ],
        "rounds_bound": 2 * max(1, math.ceil(math.log2(nodes))),
        "sim_s5_bound": liveness_bound(nodes),
        "links_per_node": runs[0]["links_per_node"],
        "batch_wall_s": round(batch_wall_s, 2),
        "wall_s_median": _med([r["wall_s"] for r in runs]),
        "cpu_s_median": _med([r["cpu_s"] for r in runs]),
        "frames_per_cpu_s_median": _med([r["frames_per_cpu_s"] for r in runs]),
        "warmup_wall_s_median": _med([r["warmup_wall_s"] for r in runs if "warmup_wall_s" in r]),
        "agree_wall_s_median": _med([r["agree_wall_s"] for r in runs if "agree_wall_s" in r]),
        "events_median": _med([r["events"] for r in runs]),
        "max_rss_mb": max(r["max_rss_mb"] for r in runs),
        "runs": runs,
    }
    if ok:
        out |= {
            "rounds_median": _med(rounds),
            "rounds_max": max(rounds),
            "bytes_per_node_median": _med([r["bytes_per_node"] for r in ok]),
            "bytes_per_node_per_round_median": _med([r["bytes_per_node_per_round"] for r in ok]),
            "messages_per_node_median": _med([r["messages_per_node"] for r in ok]),
            "messages_to_agree_median": _med([r["messages_to_agree"] for r in ok]),
            "record_copies_per_node_origin_median": _med(
                [r["record_copies_per_node_origin"] for r in ok]
            ),
        }
    sizes = [r["record_bytes"]["median"] for r in runs if "record_bytes" in r]
    if sizes:
        out["record_bytes_median"] = _med(sizes)
    return out


def _med(values: Sequence[float]) -> float | None:
    if not values:
        return None
    m = statistics.median(values)
    return round(m, 3) if isinstance(m, float) else m


def predict_seed_s(done: list[dict[str, Any]]) -> float:
    """Predicted wall time of one seed at the next N (twice the last): the last N's wall
    time x the growth of CPU time per seed between the last two N (CPU time: other load
    on the machine inflates wall times unevenly; at least x2, at most x8; x4 with one
    point) x 1.1."""
    last = done[-1]["wall_s_median"] or 0.0
    growth = 4.0
    if len(done) >= 2 and done[-2]["cpu_s_median"] and done[-1]["cpu_s_median"]:
        growth = min(8.0, max(2.0, done[-1]["cpu_s_median"] / done[-2]["cpu_s_median"]))
    return 1.1 * growth * last


def sweep(cfg: Config, log: Any) -> dict[str, Any]:
    """Doubling N while the next N fits the budget. Returns the measured rows and
    what was left out, with why."""
    started = time.perf_counter()
    done: list[dict[str, Any]] = []
    not_measured: list[int] = []
    stop_reason = ""
    explicit = list(cfg.nodes)
    n = explicit.pop(0) if explicit else FIRST_NODES
    while n <= cfg.max_nodes:
        seeds = cfg.seeds
        if done and not cfg.nodes:
            left = cfg.budget_s - (time.perf_counter() - started)
            per_seed = predict_seed_s(done)
            waves = math.ceil(seeds / cfg.jobs)
            if waves * per_seed > left:
                # One wave of `jobs` parallel seeds costs about what one seed does.
                seeds = min(seeds, cfg.jobs)
                if per_seed > left and n > cfg.always_upto:
                    stop_reason = (
                        f"N = {n}: predicted {per_seed:.0f} s for one seed (growth of the "
                        f"last measured N) > {max(left, 0):.0f} s left of the "
                        f"{cfg.budget_s:g} s budget"
                    )
                    not_measured = [m for m in _doublings(n, cfg.max_nodes)]
                    break
        log(f"  N = {n}: {seeds} seed(s) ...")
        t0 = time.perf_counter()
        runs = run_batch([(n, s, cfg.warmup_us) for s in range(seeds)], cfg.jobs)
        row = summarize_n(n, runs, time.perf_counter() - t0)
        done.append(row)
        log(
            f" rounds {row.get('rounds_median')}, "
            f"{_fmt_bytes(row.get('bytes_per_node_median'))}/node, "
            f"{row['wall_s_median']:.1f} s/seed\n"
        )
        if cfg.nodes:
            if not explicit:
                break
            n = explicit.pop(0)
        else:
            n *= 2
    return {
        "rows": done,
        "not_measured": not_measured,
        "stop_reason": stop_reason,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _doublings(lo: int, hi: int) -> list[int]:
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= 2
    return out


# -- epidemic gossip, fanout 3 (model) ---------------------------------------------


def retransmit_limit(nodes: int, mult: int = RETRANSMIT_MULT) -> int:
    """memberlist's retransmit limit: RetransmitMult x ceil(log10(N + 1))."""
    return mult * math.ceil(math.log10(nodes + 1))


def gossip_run(nodes: int, seed: int, update_bytes: int, fanout: int = FANOUT) -> dict[str, Any]:
    """One seed of the push-gossip model (see the module docstring).

    Per node: the updates it knows (a bitset) and, per round it learned some, the
    cohort learned then: a cohort learned in round s goes out in message j (0-based,
    ``fanout`` per round) of round t while ``fanout x (t - s - 1) + j < L``.
    """
    rng = random.Random(seed)
    limit = retransmit_limit(nodes)
    full = (1 << nodes) - 1
    known = [1 << i for i in range(nodes)]
    cohorts: list[list[tuple[int, int]]] = [[(0, 1 << i)] for i in range(nodes)]
    others = range(nodes - 1)
    sent = messages = 0
    sent_at_all = messages_at_all = 0
    reached: int | None = None
    t = 0
    while True:
        inbox = [0] * nodes
        active = False
        t += 1
        for i in range(nodes):
            mine = cohorts[i]
            if not mine:
                continue
            active = True
            for j, p in enumerate(rng.sample(others, fanout)):
                payload = 0
                for s, bits in mine:
                    if fanout * (t - s - 1) + j < limit:
                        payload |= bits
                if payload:
                    inbox[p + (p >= i)] |= payload
                    messages += 1
                    sent += payload.bit_count()
            cohorts[i] = [(s, b) for s, b in mine if fanout * (t - s) < limit]
        if not active:
            t -= 1
            break
        for i in range(nodes):
            new = inbox[i] & ~known[i]
            if new:
                known[i] |= new
                cohorts[i].append((t, new))
        if reached is None and all(k == full for k in known):
            reached, sent_at_all, messages_at_all = t, sent, messages
    missing = sum(nodes - k.bit_count() for k in known)

    def per_node(updates: int, msgs: int) -> float:
        return (updates * (update_bytes + UPDATE_FRAMING) + msgs * FRAME_HEADER) / nodes

    out: dict[str, Any] = {
        "seed": seed,
        "reached_all": reached is not None,
        "rounds": reached,
        "rounds_to_quiescence": t,
        "missing_pairs": missing,
        "nodes_missing_some": sum(1 for k in known if k != full),
        "bytes_per_node_total": round(per_node(sent, messages), 1),
        "messages_per_node_total": round(messages / nodes, 2),
        "updates_sent_per_node_total": round(sent / nodes, 2),
    }
    if reached is not None:
        out["bytes_per_node"] = round(per_node(sent_at_all, messages_at_all), 1)
        out["messages_per_node"] = round(messages_at_all / nodes, 2)
    return out


def gossip_sweep(cfg: Config, update_bytes: int) -> list[dict[str, Any]]:
    """The model for N = 16 ... gossip_max_nodes, ``gossip_seeds`` seeds each."""
    rows = []
    for n in _doublings(FIRST_NODES, cfg.gossip_max_nodes):
        t0 = time.perf_counter()
        runs = [gossip_run(n, s, update_bytes) for s in range(cfg.gossip_seeds)]
        ok = [r for r in runs if r["reached_all"]]
        # Seeds that never reached everyone count as infinitely slow in the median.
        ranked = sorted(r["rounds"] if r["reached_all"] else math.inf for r in runs)
        mid = ranked[(len(ranked) - 1) // 2]
        row: dict[str, Any] = {
            "nodes": n,
            "retransmit_limit": retransmit_limit(n),
            "seeds": len(runs),
            "reached_all_seeds": len(ok),
            "rounds_median": None if math.isinf(mid) else mid,
            "rounds_median_reached": _med([r["rounds"] for r in ok]),
            "rounds_max_reached": max((r["rounds"] for r in ok), default=None),
            "rounds_to_quiescence_median": _med([r["rounds_to_quiescence"] for r in runs]),
            "missing_pairs_total": sum(r["missing_pairs"] for r in runs),
            "coverage_min": round(
                min(1 - r["missing_pairs"] / (n * n) for r in runs),
                7,
            ),
            "bytes_per_node_median": _med([r["bytes_per_node"] for r in ok]),
            "bytes_per_node_total_median": _med([r["bytes_per_node_total"] for r in runs]),
            "messages_per_node_median": _med([r["messages_per_node"] for r in ok]),
            "wall_s": round(time.perf_counter() - t0, 3),
            "runs": runs,
        }
        rows.append(row)
    return rows


# -- analysis ----------------------------------------------------------------------


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares y = a + b x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def analyse(
    rows: list[dict[str, Any]], gossip: list[dict[str, Any]], not_measured: list[int]
) -> dict[str, Any]:
    """Fits, ratios against gossip, and the verdict on "rounds grow as O(log N)"."""
    pts = [(r["nodes"], r["rounds_median"]) for r in rows if r.get("rounds_median")]
    out: dict[str, Any] = {"measured_nodes": [n for n, _ in pts]}
    lin = _fit([math.log2(n) for n, _ in pts], [y for _, y in pts])
    overlay = [(n, y) for n, y in pts if n > DEFAULT_MESH_LIMIT]
    lin_overlay = _fit([math.log2(n) for n, _ in overlay], [y for _, y in overlay])
    loglog = _fit([math.log(n) for n, _ in pts], [math.log(y) for _, y in pts])
    if lin:
        out["fit_rounds_vs_log2n"] = {"a": round(lin[0], 3), "b_per_doubling": round(lin[1], 3)}
    if lin_overlay:
        out["fit_rounds_vs_log2n_overlay"] = {
            "a": round(lin_overlay[0], 3),
            "b_per_doubling": round(lin_overlay[1], 3),
            "nodes": [n for n, _ in overlay],
        }
    if loglog:
        out["loglog_slope_rounds"] = round(loglog[1], 3)
    bpts = [
        (r["nodes"], r["bytes_per_node_median"]) for r in rows if r.get("bytes_per_node_median")
    ]
    bfit = _fit([math.log(n) for n, _ in bpts], [math.log(b) for _, b in bpts])
    if bfit:
        out["loglog_slope_bytes_per_node"] = round(bfit[1], 3)
    gpts = [(g["nodes"], g["bytes_per_node_median"]) for g in gossip if g["bytes_per_node_median"]]
    gfit = _fit([math.log(n) for n, _ in gpts], [math.log(b) for _, b in gpts])
    if gfit:
        out["loglog_slope_gossip_bytes_per_node"] = round(gfit[1], 3)
    by_n = {g["nodes"]: g for g in gossip}
    ratios = []
    for r in rows:
        g = by_n.get(r["nodes"])
        if g is None or not r.get("rounds_median"):
            continue
        g_rounds = g["rounds_median"] or g["rounds_median_reached"]
        ratios.append(
            {
                "nodes": r["nodes"],
                "rounds": _ratio(r["rounds_median"], g_rounds),
                "bytes_per_node": _ratio(r["bytes_per_node_median"], g["bytes_per_node_median"]),
                "gossip_reached_all_seeds": f"{g['reached_all_seeds']}/{g['seeds']}",
            }
        )
    out["ratios_convergenced_over_gossip"] = ratios
    fit = cost_fit(rows)
    if fit is not None:
        out["cost_fit"] = fit
    out["verdict"] = verdict(rows, out, not_measured)
    return out


def cost_fit(rows: list[dict[str, Any]], upto: int = MAX_NODES) -> dict[str, Any] | None:
    """What one seed would cost at the N not measured, from power laws fitted over the
    largest measured N: CPU time per seed (median) and peak RSS per seed process, each
    ``c x N^k`` by least squares on log-log over the last (at most four) measured N
    past the mesh limit. A prediction, never a measurement: the tables show none."""
    pts = [r for r in rows if r["nodes"] > DEFAULT_MESH_LIMIT and r.get("cpu_s_median")][-4:]
    if len(pts) < 2:
        return None
    xs = [math.log(r["nodes"]) for r in pts]
    cpu = _fit(xs, [math.log(r["cpu_s_median"]) for r in pts])
    rss = _fit(xs, [math.log(r["max_rss_mb"]) for r in pts])
    if cpu is None or rss is None:
        return None
    top = pts[-1]["nodes"]
    predicted = [
        {
            "nodes": n,
            "cpu_s": round(math.exp(cpu[0]) * n ** cpu[1]),
            "rss_mb": round(math.exp(rss[0]) * n ** rss[1]),
        }
        for n in _doublings(2 * top, upto)
    ]
    return {
        "from_nodes": [r["nodes"] for r in pts],
        "cpu_exponent": round(cpu[1], 2),
        "rss_exponent": round(rss[1], 2),
        "predicted": predicted,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def verdict(rows: list[dict[str, Any]], fits: dict[str, Any], not_measured: list[int]) -> str:
    """One line: is the growth of the measured median rounds consistent with O(log N)?"""
    measured = [r for r in rows if r.get("rounds_median")]
    failed = [r["nodes"] for r in rows if r["converged"] < len(r["runs"])]
    if not measured:
        return "Verdict: no N converged; the target cannot be judged (see the failures)."
    lo, hi = measured[0]["nodes"], measured[-1]["nodes"]
    series = ", ".join(f"{r['rounds_median']:g}" for r in measured)
    over = [r for r in measured if r["rounds_median"] > r["rounds_bound"]]
    fit = fits.get("fit_rounds_vs_log2n_overlay") or fits.get("fit_rounds_vs_log2n")
    detail = (
        f"fit rounds = {fit['a']:.2f} + {fit['b_per_doubling']:.2f} x log2 N"
        if fit
        else "one N only, no fit"
    )
    if "loglog_slope_rounds" in fits:
        detail += f", log-log slope {fits['loglog_slope_rounds']:.2f}"
    tail = ""
    if not_measured:
        tail = f"N = {not_measured[0]}..{not_measured[-1]} not measured (wall-time budget)."
    elif hi < MAX_NODES:
        tail = f"N > {hi} not run (--max-nodes or --nodes)."
    if failed:
        tail += f" Seeds that did not converge at N = {', '.join(map(str, failed))}."
    if over:
        worst = ", ".join(f"N = {r['nodes']}: {r['rounds_median']:g} > {r['rounds_bound']}"
                          for r in over)  # fmt: skip
        return (
            f"Verdict: target MISSED over the measured N = {lo}..{hi}: median rounds {series} "
            f"exceed 2 x ceil(log2 N) ({worst}); {detail}. {tail}"
        ).strip()
    return (
        f"Verdict: consistent with O(log N) over the measured N = {lo}..{hi}: median rounds "
        f"{series} stay within 2 x ceil(log2 N) at every N ({detail}); a range this "
        f"short cannot tell log N from a small power of N. {tail}"
    ).strip()


# -- profile -------------------------------------------------------------------------


def profile_run(nodes: int, warmup_us: int) -> dict[str, Any]:
    """One seed under cProfile: self time by part (core, simulator, msgpack, rest) and
    the top functions."""
    sim = Simulation(sim_config(nodes, 0, warmup_us))
    prof = cProfile.Profile()
    prof.enable()
    sim.run()
    prof.disable()
    stats = pstats.Stats(prof)
    parts: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for (file, line, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        part = (
            "protocol core (convergenced/core)"
            if "convergenced/core" in file
            else "simulator and oracle (convergenced/sim)"
            if "convergenced/sim" in file
            else "msgpack"
            if "msgpack" in file
            else "builtins and stdlib"
        )
        parts[part] = parts.get(part, 0.0) + tottime
        short = file.split("convergenced/")[-1] if "convergenced/" in file else Path(file).name
        top.append((tottime, f"{short}:{line}({func})"))
    total = sum(parts.values()) or 1.0
    top.sort(reverse=True)
    return {
        "nodes": nodes,
        "total_s": round(total, 2),
        "share": {k: round(v / total, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "top_self_s": [{"function": f, "self_s": round(t, 3)} for t, f in top[:12]],
    }


# -- output --------------------------------------------------------------------------


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt(v: Any, spec: str = "g") -> str:
    return "-" if v is None else format(v, spec)


def definitions(cfg: Config, record_bytes: int) -> str:
    """The definitions paragraph (stdout and the Markdown fragment)."""
    return (
        "Definitions. convergenced (measured, real simulator, fault-free, no workload, "
        f"{cfg.warmup_us // 1000} ms virtual warm-up): t_final = when the last final commit "
        "(every rank of every node, every domain, one new epoch) became durable; rounds = "
        "ceil((t_agree - t_final) / RTT), RTT = 400 us virtual (2 x 200 us one-way), "
        "t_agree = first moment every node's restore point is that epoch "
        "(Result.rounds_to_converge); bytes/node = frame bytes delivered between t_final "
        "and t_agree / N (= Result.bytes_per_node_per_round x rounds; 12-byte frame header "
        "+ msgpack, unsigned records, no TCP/IP headers); msgs = frames in that window; "
        "copies = records sent per (node, origin) in that window. Overlay: full mesh up "
        f"to {DEFAULT_MESH_LIMIT} nodes, Chord fingers past it. "
        "Gossip fanout 3 (model, not measured on a network): every node starts with one "
        f"update of {record_bytes} B (median packed record size in a node's final view, "
        "largest convergenced N measured); per round each node sends one message to each "
        "of 3 random peers with every update it has sent fewer than L = 4 x "
        "ceil(log10(N + 1)) times (memberlist's rule, counted per message); rounds = "
        "until every node knows all N updates; bytes/node = (updates x "
        f"({record_bytes} + {UPDATE_FRAMING}) + messages x {FRAME_HEADER}) / N, up to that "
        "round ('to all') and up to quiescence ('total'). A gossip round is one one-way "
        "push per gossip interval (memberlist: 200 ms), a convergenced round one round "
        "trip on a link; gossip has no agreement phase (every node ends up with every "
        "state but does not know that the others have it; convergenced's two-phase "
        "handshake establishes that too); memberlist's push-pull anti-entropy and packet "
        "cap are not modelled."
    )


def render(sw: dict[str, Any], gossip: list[dict[str, Any]], an: dict[str, Any]) -> str:
    """The tables as preformatted text."""
    lines = ["convergenced, simulator (measured; medians over seeds, rounds also max)"]
    head = (
        f"{'N':>5} {'links':>5} {'seeds':>5} {'rounds':>6} {'max':>4} {'2clog2N':>7} "
        f"{'bytes/node':>10} {'B/node/rnd':>10} {'msgs/node':>9} {'copies':>6} "
        f"{'wall/seed':>9} {'cpu':>7} {'warm-up':>8} {'agree':>7} {'events':>8} {'RSS':>7} "
        f"{'frames/cpu-s':>12}"
    )
    lines.append(head)
    for r in sw["rows"]:
        seeds = f"{r['converged']}/{len(r['runs'])}"
        lines.append(
            f"{r['nodes']:>5} {r['links_per_node']:>5.1f} {seeds:>5} "
            f"{_fmt(r.get('rounds_median')):>6} {_fmt(r.get('rounds_max')):>4} "
            f"{r['rounds_bound']:>7} {_fmt_bytes(r.get('bytes_per_node_median')):>10} "
            f"{_fmt_bytes(r.get('bytes_per_node_per_round_median')):>10} "
            f"{_fmt(r.get('messages_per_node_median'), '.1f'):>9} "
            f"{_fmt(r.get('record_copies_per_node_origin_median'), '.2f'):>6} "
            f"{r['wall_s_median']:>8.1f}s {r['cpu_s_median']:>6.1f}s "
            f"{_fmt(r['warmup_wall_s_median'], '.1f'):>7}s "
            f"{_fmt(r['agree_wall_s_median'], '.1f'):>6}s {r['events_median']:>8.0f} "
            f"{r['max_rss_mb']:>5.0f}MB {_fmt(r.get('frames_per_cpu_s_median'), '.0f'):>12}"
        )
    lines.append(
        "(links: overlay links per node; 2clog2N: 2 x ceil(log2 N), the design's bound "
        "for fault-free runs; B/node/rnd: bytes per node per round; copies: record copies "
        "sent per (node, origin); wall/seed = warm-up + agree; cpu: CPU time per seed; "
        "RSS: peak per seed process; frames/cpu-s: frames delivered per CPU-second of the "
        "seed's process, whole run)"
    )
    measured = ", ".join(str(r["nodes"]) for r in sw["rows"])
    lines.append(f"measured N: {measured}")
    fit = an.get("cost_fit")
    if fit and fit["predicted"]:
        lo, hi = fit["from_nodes"][0], fit["from_nodes"][-1]
        guesses = "; ".join(
            f"N = {p['nodes']}: ~{p['cpu_s']} CPU-s, ~{p['rss_mb']} MB" for p in fit["predicted"]
        )
        lines.append(
            f"predicted per seed, NOT measured (power laws fitted over N = {lo}..{hi}: CPU "
            f"~ N^{fit['cpu_exponent']:g}, RSS ~ N^{fit['rss_exponent']:g}): {guesses}"
        )
    if sw["not_measured"]:
        lines.append(
            f"NOT measured: N = {', '.join(map(str, sw['not_measured']))} ({sw['stop_reason']})"
        )
    for r in sw["rows"]:
        for f in r["failures"]:
            lines.append(f"FAILED N = {r['nodes']} seed {f['seed']}: {f['violation']}")
    lines += [
        "",
        "gossip, fanout 3, push with memberlist's retransmit limit L (model; medians)",
        f"{'N':>5} {'L':>3} {'reached all':>11} {'rounds':>6} {'(reached)':>9} {'max':>4} "
        f"{'quiesce':>7} {'missed':>6} {'bytes/node':>10} {'total':>10} {'msgs/node':>9}",
    ]
    for g in gossip:
        reached = f"{g['reached_all_seeds']}/{g['seeds']}"
        lines.append(
            f"{g['nodes']:>5} {g['retransmit_limit']:>3} {reached:>11} "
            f"{_fmt(g['rounds_median']):>6} {_fmt(g['rounds_median_reached']):>9} "
            f"{_fmt(g['rounds_max_reached']):>4} {_fmt(g['rounds_to_quiescence_median']):>7} "
            f"{g['missing_pairs_total']:>6} {_fmt_bytes(g['bytes_per_node_median']):>10} "
            f"{_fmt_bytes(g['bytes_per_node_total_median']):>10} "
            f"{_fmt(g['messages_per_node_median'], '.1f'):>9}"
        )
    incomplete = [g for g in gossip if g["reached_all_seeds"] < g["seeds"]]
    if incomplete:
        lines.append(
            "gossip did NOT reach every node with every update in some seeds (bounded "
            "retransmits died out first): "
            + "; ".join(
                f"N = {g['nodes']}: {g['seeds'] - g['reached_all_seeds']} of {g['seeds']} "
                f"seeds, {g['missing_pairs_total']} node-update pairs missed in all"
                for g in incomplete
            )
        )
    lines += ["", "ratios convergenced / gossip (medians, same N)"]
    lines.append(f"{'N':>5} {'rounds':>7} {'bytes/node':>10}")
    for q in an["ratios_convergenced_over_gossip"]:
        lines.append(
            f"{q['nodes']:>5} {_fmt(q['rounds'], '.2f'):>7} {_fmt(q['bytes_per_node'], '.2f'):>10}"
        )
    fits = []
    if "fit_rounds_vs_log2n" in an:
        f = an["fit_rounds_vs_log2n"]
        fits.append(f"rounds = {f['a']:.2f} + {f['b_per_doubling']:.2f} log2 N (all measured N)")
    if "fit_rounds_vs_log2n_overlay" in an:
        f = an["fit_rounds_vs_log2n_overlay"]
        fits.append(f"rounds = {f['a']:.2f} + {f['b_per_doubling']:.2f} log2 N (overlay, N > 16)")
    for key, what in (
        ("loglog_slope_rounds", "log-log slope of rounds"),
        ("loglog_slope_bytes_per_node", "log-log slope of bytes/node"),
        ("loglog_slope_gossip_bytes_per_node", "log-log slope of gossip bytes/node"),
    ):
        if key in an:
            fits.append(f"{what}: {an[key]:.2f}")
    lines += ["", "fits (measured range only): " + "; ".join(fits)]
    return "\n".join(lines)


def render_profile(p: dict[str, Any]) -> str:
    """The profile of one seed as text."""
    lines = [f"profile of one seed at N = {p['nodes']} (cProfile, self time {p['total_s']} s)"]
    lines += [f"  {share * 100:5.1f}%  {part}" for part, share in p["share"].items()]
    lines.append("  top functions by self time:")
    lines += [f"    {t['self_s']:7.2f} s  {t['function']}" for t in p["top_self_s"]]
    return "\n".join(lines)


def plot(sw: dict[str, Any], gossip: list[dict[str, Any]], path: Path) -> None:
    """Two log-log panels: rounds and bytes per node against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in sw["rows"] if r.get("rounds_median")]
    fig, (ax_r, ax_b) = plt.subplots(1, 2, figsize=(11, 5.8))
    g_all = [g["nodes"] for g in gossip]
    ns = sorted({*g_all, *(r["nodes"] for r in rows)})
    # Rounds.
    ax_r.plot(ns, [math.log2(n) for n in ns], ":", color="grey", label="log2 N (reference)")
    if rows:
        xs = [r["nodes"] for r in rows]
        med = [r["rounds_median"] for r in rows]
        up = [r["rounds_max"] - r["rounds_median"] for r in rows]
        ax_r.errorbar(xs, med, yerr=[[0] * len(xs), up], fmt="o-", color="C0", capsize=3,
                      label="convergenced, simulator (median; bar: max)")  # fmt: skip
    full = [g for g in gossip if g["reached_all_seeds"] == g["seeds"]]
    part = [g for g in gossip if 0 < g["reached_all_seeds"] < g["seeds"]]
    ax_r.plot([g["nodes"] for g in gossip if g["rounds_median_reached"]],
              [g["rounds_median_reached"] for g in gossip if g["rounds_median_reached"]],
              "-", color="C1", alpha=0.6)  # fmt: skip
    ax_r.plot([g["nodes"] for g in full], [g["rounds_median_reached"] for g in full], "s",
              color="C1", label="gossip fanout 3, model (median)")  # fmt: skip
    if part:
        ax_r.plot([g["nodes"] for g in part], [g["rounds_median_reached"] for g in part], "s",
                  mfc="none", color="C1",
                  label="gossip: some seeds never reached everyone\n"
                  "(median of those that did)")  # fmt: skip
    never = [g for g in gossip if g["reached_all_seeds"] == 0]
    if never:
        ax_r.plot([g["nodes"] for g in never],
                  [g["rounds_to_quiescence_median"] for g in never], "x", color="C3",
                  label="gossip: no seed reached everyone\n"
                  "(x: rounds until it died out)")  # fmt: skip
    ax_r.set_ylabel("rounds to agreement")
    ax_r.set_title("Rounds (convergenced: round trips; gossip: pushes)")
    # Bytes per node.
    if rows:
        ax_b.plot([r["nodes"] for r in rows], [r["bytes_per_node_median"] for r in rows], "o-",
                  color="C0", label="convergenced, simulator (median)")  # fmt: skip
    gb = [g for g in gossip if g["bytes_per_node_median"]]
    ax_b.plot([g["nodes"] for g in gb], [g["bytes_per_node_median"] for g in gb], "s-",
              color="C1", label="gossip fanout 3, until all know all")  # fmt: skip
    ax_b.plot(g_all, [g["bytes_per_node_total_median"] for g in gossip], "s--", mfc="none",
              color="C1", alpha=0.7, label="gossip fanout 3, until quiescence")  # fmt: skip
    ax_b.set_ylabel("bytes per node to agreement")
    ax_b.set_title("Bytes per node")
    top = max(r["nodes"] for r in rows) if rows else None
    for ax in (ax_r, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xticks(ns)
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_xlabel("nodes (N)")
        ax.grid(True, which="both", alpha=0.3)
        if top is not None and top < ns[-1]:
            ax.axvspan(top * 1.25, ns[-1] * 1.1, color="grey", alpha=0.08)
            ax.text(top * 1.35, 0.03, f"convergenced:\nN > {top}\nnot measured",
                    transform=ax.get_xaxis_transform(), va="bottom", fontsize=8,
                    color="0.35")  # fmt: skip
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    ax_r.set_ylim(1, None)
    ax_r.set_yticks([2**k for k in range(8) if 2**k <= 2 * ax_r.get_ylim()[1]])
    ax_r.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_r.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle("Scale: convergenced (measured in the simulator) vs epidemic gossip (model)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run both sides, print the tables (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="N = 16, 32, one seed (< 15 s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="also write DIR/scale.md and DIR/scale.png"
    )
    parser.add_argument("--budget-s", type=float, help=f"convergenced sweep budget "
                        f"(default {DEFAULT_BUDGET_S:g} s)")  # fmt: skip
    parser.add_argument("--seeds", type=int, help="simulator seeds per N (default 3)")
    parser.add_argument("--jobs", type=int, help="worker processes (default 2)")
    parser.add_argument("--max-nodes", type=int, help=f"largest N tried (default {MAX_NODES})")
    parser.add_argument(
        "--nodes", type=int, nargs="+", metavar="N",
        help="measure exactly these N (each whatever the budget), e.g. --nodes 1024",
    )  # fmt: skip
    parser.add_argument("--gossip-seeds", type=int, help="gossip model seeds per N (default 9)")
    parser.add_argument("--warmup-ms", type=int, help="virtual warm-up before the final commit")
    parser.add_argument("--profile", type=int, metavar="N", help="also cProfile one seed at N")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    for name, field in (("budget_s", "budget_s"), ("seeds", "seeds"), ("jobs", "jobs"),
                        ("max_nodes", "max_nodes"), ("gossip_seeds", "gossip_seeds")):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
            cfg = dataclasses.replace(cfg, **{field: value})
    if args.warmup_ms is not None:
        cfg = dataclasses.replace(cfg, warmup_us=max(1, args.warmup_ms) * 1000)
    if args.nodes:
        if min(args.nodes) < 2:
            parser.error("--nodes must be at least 2")
        cfg = dataclasses.replace(cfg, nodes=tuple(sorted(set(args.nodes))))
    if cfg.max_nodes < FIRST_NODES:
        parser.error(f"--max-nodes must be at least {FIRST_NODES}")
    info: dict[str, Any] = {
        "mode": cfg.mode,
        "machine": bd.machine(),
        "config": dataclasses.asdict(cfg),
    }
    m = info["machine"]
    started = time.perf_counter()

    def log(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    print(f"scale: rounds and bytes per node to agreement ({cfg.mode})")
    print(
        f"machine: os.cpu_count()={m['cpu_count']} (usable {m['nproc']})  cpu={m['cpu']}  "
        f"loadavg at start {m['loadavg_at_start']}"
    )
    print(
        f"convergenced: simulator, fault-free, no workload, {cfg.seeds} seed(s) per N, "
        f"{cfg.jobs} job(s), budget {cfg.budget_s:g} s, N = {FIRST_NODES} doubling up to "
        f"{cfg.max_nodes}; gossip model: {cfg.gossip_seeds} seeds per N, N = {FIRST_NODES} "
        f"... {cfg.gossip_max_nodes}"
    )
    log("convergenced sweep:\n")
    sw = sweep(cfg, log)
    sizes = [r["record_bytes_median"] for r in sw["rows"] if r.get("record_bytes_median")]
    record_bytes = int(sizes[-1]) if sizes else 0
    t0 = time.perf_counter()
    gossip = gossip_sweep(cfg, record_bytes)
    gossip_s = time.perf_counter() - t0
    an = analyse(sw["rows"], gossip, sw["not_measured"])
    prof = profile_run(args.profile, cfg.warmup_us) if args.profile else None
    table = render(sw, gossip, an)
    defs = definitions(cfg, record_bytes)
    print()
    print(defs)
    print()
    print(table)
    if prof:
        print()
        print(render_profile(prof))
    print()
    print(an["verdict"])
    if args.out:
        command = report.command_line(__file__, sys.argv[1:] if argv is None else argv)
        body = table + ("\n\n" + render_profile(prof) if prof else "")
        text = "\n\n".join([an["verdict"], defs, "Plot: `scale.png`."])
        report.write_fragment(args.out, "scale", command, m, body, text=text)
        plot(sw, gossip, args.out / "scale.png")
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    info["loadavg_at_end"] = bd.loadavg()
    print()
    print(
        f"elapsed: {info['elapsed_s']} s (convergenced sweep {sw['wall_s']} s, gossip model "
        f"{gossip_s:.1f} s; loadavg at end {info['loadavg_at_end']})"
    )
    if args.json:
        out = info | {
            "definitions": defs,
            "record_bytes": record_bytes,
            "gossip_model": {
                "fanout": FANOUT,
                "retransmit_mult": RETRANSMIT_MULT,
                "frame_header_bytes": FRAME_HEADER,
                "update_framing_bytes": UPDATE_FRAMING,
            },
            "convergenced": sw["rows"],
            "not_measured": sw["not_measured"],
            "stop_reason": sw["stop_reason"],
            "sweep_wall_s": sw["wall_s"],
            "gossip": gossip,
            "gossip_wall_s": round(gossip_s, 2),
            "analysis": {k: v for k, v in an.items() if k != "verdict"},
            "verdict": an["verdict"],
            "profile": prof,
        }
        print(json.dumps(out, separators=(",", ":"), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
