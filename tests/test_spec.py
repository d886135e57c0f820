"""Stream specs: validation that names the field, normalization, canonical digests, and
conflicting declarations refused by the node instead of silently merged."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import SpecConflictError, SpecError
from convergenced.core.facts import Commit, Declare
from convergenced.core.node import NodeCore
from convergenced.core.spec import (
    MAX_MEMBERS,
    MAX_POLICY_DOMAINS,
    MAX_RANKS_PER_MEMBER,
    Policy,
    PolicyMode,
    StreamSpec,
)

PROPERTY = settings(max_examples=100, deadline=None)
NVME = Policy.all_of("nvme")


def spec_ab(**overrides: Any) -> StreamSpec:
    args: dict[str, Any] = {
        "name": "job",
        "members": {"a": [0, 1], "b": [2, 3]},
        "policy": NVME,
        "retention": 0,
    }
    args.update(overrides)
    return StreamSpec.create(args["name"], args["members"], args["policy"], args["retention"])


# -- strategies ---------------------------------------------------------------

node_ids = st.sampled_from(["a", "b", "c", "node-1", "node.2", "host/3"])
domain_names = st.sampled_from(["gpu", "ram", "nvme", "s3", "gcs"])


@st.composite
def member_maps(draw: st.DrawFn) -> dict[str, list[int]]:
    nodes = draw(st.lists(node_ids, min_size=1, max_size=4, unique=True))
    ranks = draw(st.lists(st.integers(0, 64), min_size=len(nodes), max_size=12, unique=True))
    out: dict[str, list[int]] = {n: [] for n in nodes}
    for i, r in enumerate(ranks):
        out[nodes[i % len(nodes)]].append(r)
    return out


@st.composite
def specs(draw: st.DrawFn) -> StreamSpec:
    name = draw(st.sampled_from(["job", "train-7", "llm/pretrain"]))
    mode = draw(st.sampled_from(list(PolicyMode)))
    domains = tuple(draw(st.lists(domain_names, min_size=1, max_size=4, unique=True)))
    retention = draw(st.integers(0, 100))
    return StreamSpec.create(name, draw(member_maps()), Policy(mode, domains), retention)


# -- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"name": ""}, "spec.name"),
        ({"name": "has space"}, "spec.name"),
        ({"name": "-leading-dash"}, "spec.name"),
        ({"name": "x" * 129}, "spec.name"),
        ({"name": 7}, "spec.name"),
        ({"members": {}}, "spec.members"),
        ({"members": {"bad id": [0]}}, "spec.members"),
        ({"members": {"a": [0], 7: [1]}}, "spec.members"),
        ({"members": {"a": []}}, "spec.members.a"),
        ({"members": {"a": [-1]}}, "spec.members.a"),
        ({"members": {"a": [2**63]}}, "spec.members.a"),
        ({"members": {"a": [True]}}, "spec.members.a"),
        ({"members": {"a": [1.0]}}, "spec.members.a"),
        ({"members": {"a": ["x", 1]}}, "spec.members.a"),
        ({"members": {"a": [[1]]}}, "spec.members.a"),
        ({"members": {"a": 3}}, "spec.members.a"),
        ({"members": {"a": [0, 1], "b": [1]}}, "spec.members.b"),
        ({"policy": Policy.all_of()}, "spec.policy"),
        ({"policy": "all of nvme"}, "spec.policy"),
        ({"policy": Policy.any_of("bad domain")}, "spec.policy.domains"),
        ({"policy": Policy.any_of(*(f"d{i}" for i in range(17)))}, "spec.policy"),
        ({"retention": -1}, "spec.retention"),
        ({"retention": True}, "spec.retention"),
        ({"retention": 1.5}, "spec.retention"),
        ({"retention": 2**63}, "spec.retention"),
    ],
    ids=repr,
)
def test_create_rejects_invalid_field_naming_it(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_ab(**overrides)
    assert str(info.value).startswith(field + ":") or str(info.value).startswith(field + " ")


def test_rank_hosted_twice_names_both_members() -> None:
    with pytest.raises(SpecError, match=r"spec\.members\.b: rank 1 is also hosted by a"):
        spec_ab(members={"a": [0, 1], "b": [1]})


def test_create_rejects_too_many_members() -> None:
    members = {f"n{i}": [i] for i in range(MAX_MEMBERS + 1)}
    with pytest.raises(SpecError, match=r"^spec\.members: "):
        spec_ab(members=members)


def test_create_rejects_too_many_ranks_for_one_member() -> None:
    with pytest.raises(SpecError, match=r"^spec\.members\.a: "):
        spec_ab(members={"a": list(range(MAX_RANKS_PER_MEMBER + 1))})


def test_create_accepts_the_limits_exactly() -> None:
    domains = [f"d{i}" for i in range(MAX_POLICY_DOMAINS)]
    spec = spec_ab(
        members={"a": list(range(MAX_RANKS_PER_MEMBER))},
        policy=Policy.any_of(*domains),
        retention=2**63 - 1,
    )
    assert len(spec.ranks_of("a")) == MAX_RANKS_PER_MEMBER
    assert len(spec.policy.domains) == MAX_POLICY_DOMAINS


# -- normalization ------------------------------------------------------------


def test_create_sorts_members_and_ranks_and_drops_duplicate_ranks() -> None:
    spec = spec_ab(members={"b": [3, 2, 3], "a": (1, 0)})
    assert spec.members == (("a", (0, 1)), ("b", (2, 3)))
    assert spec.member_ids == ("a", "b")
    assert spec.ranks_of("b") == (2, 3)


def test_ranks_of_a_non_member_is_empty() -> None:
    assert spec_ab().ranks_of("z") == ()


def test_create_sorts_and_deduplicates_policy_domains() -> None:
    spec = spec_ab(policy=Policy(PolicyMode.ANY, ("s3", "nvme", "s3")))
    assert spec.policy == Policy(PolicyMode.ANY, ("nvme", "s3"))


def test_policy_constructors_normalize_domains() -> None:
    assert Policy.all_of("s3", "nvme", "nvme") == Policy(PolicyMode.ALL, ("nvme", "s3"))
    assert Policy.any_of("s3", "gpu") == Policy(PolicyMode.ANY, ("gpu", "s3"))
    assert str(Policy.any_of("s3", "nvme")) == "any of [nvme, s3]"


# -- digest -------------------------------------------------------------------


@PROPERTY
@given(specs(), st.randoms(use_true_random=False))
def test_equal_specs_given_in_any_order_have_equal_digests(spec: StreamSpec, rnd: Any) -> None:
    members = [(node, list(ranks)) for node, ranks in spec.members]
    rnd.shuffle(members)
    for _, ranks in members:
        rnd.shuffle(ranks)
        ranks.extend(ranks[:1])  # a repeated rank is the same spec
    domains = list(spec.policy.domains) * 2
    rnd.shuffle(domains)
    again = StreamSpec.create(
        spec.name, dict(members), Policy(spec.policy.mode, tuple(domains)), spec.retention
    )
    assert again == spec
    assert again.canonical_bytes() == spec.canonical_bytes()
    assert again.digest == spec.digest


@PROPERTY
@given(specs(), specs())
def test_different_specs_have_different_digests(a: StreamSpec, b: StreamSpec) -> None:
    assert (a.digest == b.digest) == (a == b)


@pytest.mark.parametrize(
    "overrides",
    [
        {"name": "other-job"},
        {"members": {"a": [0, 1], "b": [2]}},
        {"members": {"a": [0, 1], "c": [2, 3]}},
        {"members": {"a": [0], "b": [1, 2, 3]}},
        {"policy": Policy.any_of("nvme")},
        {"policy": Policy.all_of("nvme", "s3")},
        {"retention": 1},
    ],
    ids=lambda o: next(iter(o)),
)
def test_changing_any_field_changes_the_digest(overrides: dict[str, Any]) -> None:
    assert spec_ab(**overrides).digest != spec_ab().digest


def test_digest_is_sha256_sized() -> None:
    assert len(spec_ab().digest) == 32


def test_differences_name_what_differs() -> None:
    ours = spec_ab()
    theirs = spec_ab(members={"a": [0]}, policy=Policy.any_of("nvme", "s3"), retention=4)
    diffs = ours.differences(theirs)
    assert diffs[0] == "members differ"
    assert diffs[1] == "policy all of [nvme] vs any of [nvme, s3]"
    assert diffs[2] == "retention 0 vs 4"
    assert ours.differences(spec_ab()) == []


# -- wire form ----------------------------------------------------------------


@PROPERTY
@given(specs())
def test_to_wire_from_wire_round_trips(spec: StreamSpec) -> None:
    back = StreamSpec.from_wire(spec.to_wire())
    assert back == spec
    assert back.digest == spec.digest


@PROPERTY
@given(specs())
def test_wire_form_survives_msgpack(spec: StreamSpec) -> None:
    obj = msgpack.unpackb(msgpack.packb(spec.to_wire(), use_bin_type=True), raw=False)
    assert StreamSpec.from_wire(obj) == spec


def test_to_wire_is_plain_data() -> None:
    assert spec_ab(retention=3).to_wire() == {
        "name": "job",
        "members": {"a": [0, 1], "b": [2, 3]},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 3,
    }


def test_from_wire_defaults_retention_to_zero() -> None:
    wire = spec_ab(retention=5).to_wire()
    del wire["retention"]
    assert StreamSpec.from_wire(wire).retention == 0


def _wire(**changes: Any) -> dict[str, Any]:
    wire = spec_ab().to_wire()
    for key, value in changes.items():
        if value is _DELETE:
            del wire[key]
        else:
            wire[key] = value
    return wire


_DELETE = object()


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([1, 2], "spec"),
        (_wire(extra=1), "spec"),
        (_wire(name=_DELETE), "spec.name"),
        (_wire(members=_DELETE), "spec.members"),
        (_wire(policy=_DELETE), "spec.policy"),
        (_wire(name=None), "spec.name"),
        (_wire(members=[["a", [0]]]), "spec.members"),
        (_wire(members={"a": 0}), "spec.members.a"),
        (_wire(members={"a": ["0"]}), "spec.members.a"),
        (_wire(members={"a": ["x", 1]}), "spec.members.a"),
        (_wire(members={"a": [{}]}), "spec.members.a"),
        (_wire(members={"a": [0], 5: [1]}), "spec.members"),
        (_wire(policy=["all", ["nvme"]]), "spec.policy"),
        (_wire(policy={"mode": "all"}), "spec.policy"),
        (_wire(policy={"mode": "all", "domains": ["nvme"], "x": 1}), "spec.policy"),
        (_wire(policy={"mode": "most", "domains": ["nvme"]}), "spec.policy.mode"),
        (_wire(policy={"mode": "all", "domains": "nvme"}), "spec.policy.domains"),
        (_wire(policy={"mode": "all", "domains": [["nvme"]]}), "spec.policy.domains"),
        (_wire(policy={"mode": "all", "domains": []}), "spec.policy"),
        (_wire(retention="3"), "spec.retention"),
    ],
    ids=repr,
)
def test_from_wire_rejects_malformed_input_naming_the_field(obj: Any, field: str) -> None:
    with pytest.raises(SpecError) as info:
        StreamSpec.from_wire(obj)
    assert str(info.value).startswith(field + ":")


# -- declarations on a node -------------------------------------------------------


def test_redeclaring_the_same_spec_is_a_no_op() -> None:
    node = NodeCore("a", 1)
    node.apply(Declare(spec_ab()))
    before = node.own_record("job")
    node.apply(Declare(spec_ab(members={"b": [3, 2], "a": [1, 0]})))
    assert node.own_record("job") == before
    assert node.spec("job") == spec_ab()


def test_declaring_a_stream_this_node_is_not_a_member_of_is_refused() -> None:
    node = NodeCore("z", 1)
    with pytest.raises(SpecError, match="not a member"):
        node.apply(Declare(spec_ab()))
    assert node.streams() == []


def test_redeclaring_a_different_spec_locally_raises_spec_conflict() -> None:
    node = NodeCore("a", 1)
    node.apply(Declare(spec_ab()))
    node.apply(Commit("job", 0, "nvme", 4))
    record = node.own_record("job")
    with pytest.raises(SpecConflictError) as info:
        node.apply(Declare(spec_ab(retention=2)))
    assert info.value.stream == "job"
    assert info.value.ours == spec_ab().digest.hex()[:16]
    assert info.value.theirs == spec_ab(retention=2).digest.hex()[:16]
    assert "retention 0 vs 2" in str(info.value)
    assert node.spec("job") == spec_ab()
    assert node.own_record("job") == record


def test_check_refuses_a_conflicting_declaration_too() -> None:
    node = NodeCore("a", 1)
    node.apply(Declare(spec_ab()))
    with pytest.raises(SpecConflictError):
        node.check(Declare(spec_ab(policy=Policy.any_of("nvme"))))


def test_declaring_a_spec_that_a_member_already_declared_differently_raises() -> None:
    b = NodeCore("b", 1)
    b.apply(Declare(spec_ab(policy=Policy.any_of("nvme", "s3"))))
    a = NodeCore("a", 1)
    a.receive(b.view)
    with pytest.raises(SpecConflictError) as info:
        a.apply(Declare(spec_ab()))
    assert info.value.stream == "job"
    assert "member b declared (or tried to declare) a different spec" in str(info.value)
    assert a.streams() == []


def test_a_matching_member_record_does_not_block_declaration() -> None:
    b = NodeCore("b", 1)
    b.apply(Declare(spec_ab()))
    a = NodeCore("a", 1)
    a.receive(b.view)
    a.apply(Declare(spec_ab()))
    assert a.streams() == ["job"]


def test_a_non_member_record_with_another_digest_does_not_block_declaration() -> None:
    outsider_spec = spec_ab(members={"a": [0, 1], "b": [2, 3], "z": [9]})
    z = NodeCore("z", 1)
    z.apply(Declare(outsider_spec))
    a = NodeCore("a", 1)
    a.receive(z.view)
    a.apply(Declare(spec_ab()))
    assert a.streams() == ["job"]
