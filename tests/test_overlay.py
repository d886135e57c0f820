"""The peer overlay: mesh when small, Chord fingers when large."""

from __future__ import annotations

import math
from collections import deque

import pytest

from convergenced.core.overlay import DEFAULT_MESH_LIMIT, dial_targets, links


def _ids(n: int) -> list[str]:
    return [f"node-{i:05d}" for i in range(n)]


def _adjacency(n: int) -> dict[str, set[str]]:
    adj: dict[str, set[str]] = {i: set() for i in _ids(n)}
    for a, b in links(_ids(n)):
        adj[a].add(b)
        adj[b].add(a)
    return adj


def _eccentricity(adj: dict[str, set[str]], start: str) -> int:
    dist = {start: 0}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for peer in adj[node]:
            if peer not in dist:
                dist[peer] = dist[node] + 1
                queue.append(peer)
    assert len(dist) == len(adj), "overlay is not connected"
    return max(dist.values())


@pytest.mark.parametrize("n", [1, 2, 5, DEFAULT_MESH_LIMIT])
def test_small_clusters_are_a_full_mesh_dialled_once_per_pair(n: int) -> None:
    pairs = links(_ids(n))
    assert len(pairs) == n * (n - 1) // 2
    assert all(a < b for a, b in pairs)


@pytest.mark.parametrize("n", [17, 64, 100, 1000])
def test_large_clusters_link_each_pair_at_most_once(n: int) -> None:
    pairs = links(_ids(n))
    assert len({frozenset(p) for p in pairs}) == len(pairs)
    assert all(a != b for a, b in pairs)


@pytest.mark.parametrize("n", [17, 64, 100, 1000, 4096])
def test_large_clusters_have_logarithmic_degree_and_diameter(n: int) -> None:
    adj = _adjacency(n)
    log_n = math.ceil(math.log2(n))
    assert max(len(p) for p in adj.values()) <= 2 * log_n
    # Diameter from a few starting points (the overlay is vertex-transitive).
    for start in list(adj)[:: max(1, n // 4)]:
        assert _eccentricity(adj, start) <= log_n


def test_every_node_computes_the_same_graph_from_any_order() -> None:
    ids = _ids(40)
    assert links(ids) == links(list(reversed(ids)))
    me = ids[7]
    assert dial_targets(ids, me) == dial_targets(sorted(ids, key=hash), me)
