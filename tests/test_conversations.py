"""Whole conversations: nodes that talk only through `Link` objects reach the same view
and the same restore point, whatever the order and chunking of deliveries.

Sans-IO all the way: each directed connection is a byte buffer in memory. A step
delivers some prefix of one buffer (TCP keeps order within a connection, never across
connections), ticks a node's timers, or commits at a node. After any input to a node,
every link of that node is polled and its output appended to its outgoing buffer, as a
daemon would after each event. Finally everything is delivered and timers tick until
the links are quiet and in mutual sync; then every node must hold the same view
(equal digests) and the restore point must be the newest epoch of the true
convergence interval, computed here from the commits alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st
from pulled import clear_events, clear_facts, pending_facts

from convergenced.core.facts import Commit, Declare, HighWater, Horizon
from convergenced.core.link import Closed, Link, LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

STREAM = "job"
CLUSTER = "test-cluster"
RANKS = {"a": (0, 1), "b": (2,), "c": (3,)}
"""Node a hosts two ranks, so its recoverable set needs both."""
POLICY = Policy.any_of("nvme", "s3")
DOMAINS = ("nvme", "s3", "ram")
""""ram" is outside the policy: commits there never make an epoch recoverable."""
QUIET_ROUNDS = 40
"""Bound on tick-and-deliver rounds after the chaos (S5: bounded rounds)."""

TOPOLOGIES = {
    "pair": (("a", "b"),),
    "triangle": (("a", "b"), ("a", "c"), ("b", "c")),
    "line": (("a", "b"), ("b", "c")),  # a and c only meet through b's relaying
}


def _config(peer: str | None = None) -> LinkConfig:
    # Failure detection is out of scope here: links must never be declared dead
    # because one side ticked while its peer's bytes sat undelivered.
    return LinkConfig(cluster=CLUSTER, idle_ticks=1, dead_ticks=10**9, expected_peer=peer)


@dataclass
class Network:
    """Nodes, links and the in-flight bytes of every directed connection."""

    topology: tuple[tuple[str, str], ...]
    nodes: dict[str, NodeCore] = field(default_factory=dict)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    """(owner, peer) -> the owner's end of the connection to peer."""
    wire: dict[tuple[str, str], bytearray] = field(default_factory=dict)
    """(sender, receiver) -> bytes sent and not yet delivered."""
    held: dict[tuple[str, int, str], set[int]] = field(default_factory=dict)
    """Ground truth: (node, rank, domain) -> epochs committed there."""
    undeclared: set[str] = field(default_factory=set)
    """Nodes whose job has not declared the stream yet (they relay records anyway)."""

    def __post_init__(self) -> None:
        members = sorted({m for pair in self.topology for m in pair})
        self.spec = StreamSpec.create(STREAM, {m: list(RANKS[m]) for m in members}, POLICY)
        for m in members:
            node = NodeCore(m, 1)
            if m not in self.undeclared:
                node.apply(Declare(self.spec))
            self.nodes[m] = node
        for dialler, acceptor in self.topology:
            self.links[(dialler, acceptor)] = Link(
                self.nodes[dialler], Role.INITIATOR, _config(acceptor)
            )
            self.links[(acceptor, dialler)] = Link(self.nodes[acceptor], Role.ACCEPTOR, _config())
            self.wire[(dialler, acceptor)] = bytearray()
            self.wire[(acceptor, dialler)] = bytearray()
        for link in self.links.values():
            link.start()
        for m in members:
            self.flush(m)

    # -- driving ------------------------------------------------------------------

    def flush(self, node: str) -> None:
        """Poll every link of ``node`` and queue what it sends; check nothing broke."""
        # The simulated log is instantly durable, so pending high-water marks and GC
        # horizons are done.
        assert all(isinstance(f, HighWater | Horizon) for f in pending_facts(self.nodes[node]))
        clear_facts(self.nodes[node])
        clear_events(self.nodes[node])
        for (owner, peer), link in self.links.items():
            if owner != node:
                continue
            link.poll()
            self.wire[(owner, peer)] += link.data_to_send()
            while (event := link.next_event()) is not None:
                assert not isinstance(event, Closed), f"{owner}->{peer} closed: {event}"

    def deliver(self, sender: str, receiver: str, size: int | None = None) -> None:
        """Deliver the first ``size`` in-flight bytes (all when None) to the receiver."""
        buf = self.wire[(sender, receiver)]
        n = len(buf) if size is None else min(size, len(buf))
        chunk = bytes(buf[:n])
        del buf[:n]
        self.links[(receiver, sender)].receive_data(chunk)
        self.flush(receiver)

    def tick(self, node: str) -> None:
        for (owner, _), link in self.links.items():
            if owner == node:
                link.on_timer()
        self.flush(node)

    def declare(self, node: str) -> None:
        self.nodes[node].apply(Declare(self.spec))
        self.undeclared.discard(node)
        self.flush(node)

    def commit(self, node: str, rank: int, domain: str, epoch: int) -> None:
        if node in self.undeclared:
            self.declare(node)
        self.nodes[node].apply(Commit(STREAM, rank, domain, epoch))
        self.held.setdefault((node, rank, domain), set()).add(epoch)
        self.flush(node)

    def pending(self) -> list[tuple[str, str]]:
        return [key for key, buf in sorted(self.wire.items()) if buf]

    def deliver_all(self) -> None:
        for _ in range(1000):
            busy = self.pending()
            if not busy:
                return
            for sender, receiver in busy:
                self.deliver(sender, receiver)
        raise AssertionError("deliveries never ran dry")

    def quiesce(self) -> int:
        """Deliver everything and tick until all links are in mutual sync; the rounds."""
        for rounds in range(QUIET_ROUNDS):
            self.deliver_all()
            if self.quiet():
                return rounds
            for m in sorted(self.nodes):
                self.tick(m)
        raise AssertionError(f"no quiescence after {QUIET_ROUNDS} rounds")

    # -- observing --------------------------------------------------------------------

    def quiet(self) -> bool:
        digests = {node.view.digest for node in self.nodes.values()}
        synced = all(link.in_sync and link.mutual for link in self.links.values())
        return len(digests) == 1 and synced and not self.pending()

    def true_convergence(self) -> set[int]:
        """Epochs every rank of every member holds in a policy domain, from commits."""
        out: set[int] | None = None
        for m in self.nodes:
            for rank in RANKS[m]:
                epochs: set[int] = set()
                for d in POLICY.domains:
                    epochs |= self.held.get((m, rank, d), set())
                out = epochs if out is None else out & epochs
        assert out is not None
        return out

    def restore_points(self) -> dict[str, int | None]:
        return {m: node.restore_point(STREAM) for m, node in self.nodes.items()}

    def assert_converged(self) -> None:
        digests = {m: node.view.digest for m, node in self.nodes.items()}
        assert len(set(digests.values())) == 1, digests
        expected = max(self.true_convergence(), default=None)
        assert self.restore_points() == dict.fromkeys(self.nodes, expected)
        for node in self.nodes.values():
            status = node.status(STREAM)
            assert status.convergence is not None
            assert set(status.convergence) == self.true_convergence()
            assert status.missing == ()
            assert status.conflicts == ()


# -- the property -----------------------------------------------------------------------


def _commit_step(net: Network, data: st.DataObject) -> None:
    node = data.draw(st.sampled_from(sorted(net.nodes)), label="commit at")
    rank = data.draw(st.sampled_from(RANKS[node]), label="rank")
    domain = data.draw(st.sampled_from(DOMAINS), label="domain")
    epoch = data.draw(st.integers(0, 8), label="epoch")
    net.commit(node, rank, domain, epoch)


def _save_step(net: Network, data: st.DataObject) -> None:
    """Every rank of one node saves one epoch, each in a domain of its choice."""
    node = data.draw(st.sampled_from(sorted(net.nodes)), label="save at")
    epoch = data.draw(st.integers(0, 5), label="epoch")
    for rank in RANKS[node]:
        net.commit(node, rank, data.draw(st.sampled_from(DOMAINS), label="domain"), epoch)


def _deliver_step(net: Network, data: st.DataObject) -> None:
    pending = net.pending()
    if not pending:
        return
    sender, receiver = data.draw(st.sampled_from(pending), label="deliver on")
    size = len(net.wire[(sender, receiver)])
    chunk = data.draw(st.none() | st.integers(1, size), label="chunk (None: all)")
    net.deliver(sender, receiver, chunk)


def _run_conversation(topology: str, data: st.DataObject) -> Network:
    members = sorted({m for pair in TOPOLOGIES[topology] for m in pair})
    late = data.draw(st.sets(st.sampled_from(members)), label="declare late")
    net = Network(TOPOLOGIES[topology], undeclared=set(late))
    steps = data.draw(st.integers(0, 80), label="steps")
    for _ in range(steps):
        kind = data.draw(
            st.sampled_from(["deliver"] * 4 + ["save"] * 3 + ["commit", "tick", "declare"])
        )
        if kind == "declare":
            if net.undeclared:
                net.declare(data.draw(st.sampled_from(sorted(net.undeclared)), label="declare"))
        elif kind == "deliver":
            _deliver_step(net, data)
        elif kind == "save":
            _save_step(net, data)
        elif kind == "commit":
            _commit_step(net, data)
        else:
            net.tick(data.draw(st.sampled_from(sorted(net.nodes)), label="tick at"))
    for m in sorted(net.undeclared):
        net.declare(m)
    rounds = net.quiesce()
    net.assert_converged()
    event(f"quiet after {rounds} rounds")
    event("restore point: " + ("none" if net.true_convergence() == set() else "an epoch"))
    return net


CONVERSATIONS = settings(max_examples=100, deadline=None)


@CONVERSATIONS
@given(st.data())
def test_pair_agrees_whatever_the_delivery_order(data: st.DataObject) -> None:
    _run_conversation("pair", data)


@CONVERSATIONS
@given(st.data())
def test_triangle_agrees_whatever_the_delivery_order(data: st.DataObject) -> None:
    _run_conversation("triangle", data)


@CONVERSATIONS
@given(st.data())
def test_line_agrees_through_relaying_whatever_the_delivery_order(data: st.DataObject) -> None:
    _run_conversation("line", data)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_agreement_is_stable_once_quiet(data: st.DataObject) -> None:
    net = _run_conversation("triangle", data)
    digests = {m: n.view.digest for m, n in net.nodes.items()}
    points = net.restore_points()
    for _ in range(5):  # heartbeats keep flowing; nothing may change
        for m in sorted(net.nodes):
            net.tick(m)
        net.deliver_all()
    assert {m: n.view.digest for m, n in net.nodes.items()} == digests
    assert net.restore_points() == points
    assert net.quiet()


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_late_commits_after_quiet_converge_again(data: st.DataObject) -> None:
    net = _run_conversation("line", data)
    for m in sorted(net.nodes):
        for rank in RANKS[m]:
            net.commit(m, rank, "nvme", 9)
    net.quiesce()
    net.assert_converged()
    assert net.restore_points() == dict.fromkeys(net.nodes, 9)


# -- fixed scenarios ------------------------------------------------------------------------


def _commit_everywhere(net: Network, epochs: range) -> None:
    for m in sorted(net.nodes):
        for rank in RANKS[m]:
            for e in epochs:
                net.commit(m, rank, "nvme", e)


def test_pair_with_one_byte_deliveries_converges() -> None:
    net = Network(TOPOLOGIES["pair"])
    _commit_everywhere(net, range(0, 5))
    for _ in range(200):
        for sender, receiver in net.pending():
            net.deliver(sender, receiver, 1)
        for m in sorted(net.nodes):
            net.tick(m)
    net.quiesce()
    net.assert_converged()
    assert net.restore_points() == {"a": 4, "b": 4}


def test_line_relays_the_far_ends_records() -> None:
    net = Network(TOPOLOGIES["line"])
    _commit_everywhere(net, range(3, 7))
    net.commit("c", 3, "s3", 8)  # only c has 8
    net.quiesce()
    net.assert_converged()
    assert net.nodes["a"].view.get((STREAM, "c")) == net.nodes["c"].own_record(STREAM)
    assert net.restore_points() == {"a": 6, "b": 6, "c": 6}


def test_a_node_missing_a_rank_holds_the_restore_point_back() -> None:
    net = Network(TOPOLOGIES["triangle"])
    _commit_everywhere(net, range(0, 3))
    for m, ranks in RANKS.items():
        for rank in ranks:
            if rank != 1:  # rank 1 of node a never saves epoch 3
                net.commit(m, rank, "s3", 3)
    net.commit("a", 1, "ram", 3)  # outside the policy: does not count
    net.quiesce()
    net.assert_converged()
    assert net.restore_points() == {"a": 2, "b": 2, "c": 2}


def test_quiescence_takes_few_rounds() -> None:
    net = Network(TOPOLOGIES["triangle"])
    _commit_everywhere(net, range(0, 10))
    assert net.quiesce() <= 8
    net.assert_converged()
