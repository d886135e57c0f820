"""Which peers a node links to: full mesh when small, a log-degree overlay when large.

Up to ``mesh_limit`` nodes every pair is linked. Past it, node ``i`` (in the sorted
list of node ids) dials ``i + 2^k mod N`` for ``k = 0 .. ceil(log2 N) - 1``, and
accepts the mirror links from ``i - 2^k``; that is the Chord finger pattern. Every
node then has about ``2 log2 N`` links (``log2 N`` dialled), any node is
``O(log N)`` hops from any other, and records, being signed and idempotent, are
relayed unchanged along the way. The overlay is a pure function of the member
list, so every node computes the same graph without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MESH_LIMIT = 16


def dial_targets(nodes: Sequence[str], me: str, mesh_limit: int = DEFAULT_MESH_LIMIT) -> list[str]:
    """The peers ``me`` dials (it accepts the links the others dial to it).

    In a mesh each pair is dialled once, by the node whose id sorts first.
    """
    order = sorted(set(nodes))
    n = len(order)
    i = order.index(me)
    if n <= mesh_limit:
        return order[i + 1 :]
    out: list[str] = []
    step = 1
    while step < n:
        j = (i + step) % n
        # When j also reaches i by a finger, the pair is linked once, by the lower index.
        if j != i and order[j] not in out and (not _is_finger((i - j) % n, n) or i < j):
            out.append(order[j])
        step *= 2
    return out


def _is_finger(distance: int, n: int) -> bool:
    return 0 < distance < n and distance & (distance - 1) == 0


def links(nodes: Sequence[str], mesh_limit: int = DEFAULT_MESH_LIMIT) -> list[tuple[str, str]]:
    """All (dialler, acceptor) pairs of the overlay."""
    return [(a, b) for a in sorted(set(nodes)) for b in dial_targets(nodes, a, mesh_limit)]
