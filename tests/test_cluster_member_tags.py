"""Member tags decide ownership: a member owns keys only when it is alive in Serf, its tags
are well-formed and bounded, and its ``auth`` tag verifies with the cluster key. Whatever a
member publishes, the view never breaks (fuzzed), and each refusal is counted once."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.cluster import CAPACITY_BYTES_MAX, Membership, check_member, node_of
from dpu_agent.cluster._peer import PEER_REFUSED
from kvproto.peer_auth import member_tag
from kvproto.placement import NODE_STATES, Node, Placement
from kvproto.serf import MEMBER_STATUSES, Member

KEYS = (b"cluster-key-0123456789-0123456789-abcdef",)
OTHER = (b"some-other-key-0123456789-0123456789-abc",)


def member(name: str, status: str = "alive", keys: tuple[bytes, ...] = KEYS, **tags: str) -> Member:
    t = {"kv": "1", "ctl": "tcp://10.0.0.1:7400", "nvme": "10.0.0.1:4420", "cap": "1000",
         "zone": "", **tags}  # fmt: skip
    t.setdefault("auth", member_tag(keys[0], name, t))
    t.setdefault("state", "serving")
    return Member(name=name, addr="10.0.0.1", port=7946, tags=t, status=status)


def membership() -> Membership:
    opts = SimpleNamespace(peer_keys=KEYS, zone="")
    return Membership(opts, node="me", control="tcp://127.0.0.1:7400",  # type: ignore[arg-type]
                      nvme="127.0.0.1:4420", capacity_bytes=1 << 30)  # fmt: skip


def test_signed_member_owns_and_state_changes_keep_the_proof() -> None:
    m = member("n1")
    assert node_of(m, KEYS) == Node(name="n1", control="tcp://10.0.0.1:7400",
                                    nvme="10.0.0.1:4420", capacity_bytes=1000)  # fmt: skip
    leaving = member("n1", state="leaving", auth=m.tags["auth"])
    assert isinstance(node_of(leaving, KEYS), Node)  # state is not part of the proof


def test_member_without_the_cluster_key_is_refused() -> None:
    assert check_member(member("n1", keys=OTHER), KEYS) == (
        "member_tag: its auth tag does not verify with the cluster key"
    )
    stolen = member("n1").tags["auth"]  # a real member's tag on another name or address
    assert node_of(member("n2", auth=stolen), KEYS) is None
    assert node_of(member("n1", auth=stolen, ctl="tcp://6.6.6.6:7400"), KEYS) is None
    assert node_of(member("n1", auth=""), KEYS) is None


def test_left_and_failed_members_never_own() -> None:
    for status in ("left", "failed", "leaving", "none"):
        assert node_of(member("n1", status=status), KEYS) is None


def test_capacity_and_addresses_are_bounded() -> None:
    assert isinstance(node_of(member("n1", cap=str(CAPACITY_BYTES_MAX)), KEYS), Node)
    for tags in ({"cap": str(CAPACITY_BYTES_MAX + 1)}, {"cap": "abc"}, {"cap": "0"},
                 {"cap": "-5"}, {"cap": "1" * 400}, {"ctl": "unix:///tmp/x"},
                 {"ctl": "tcp://h:99999"}, {"nvme": "nohostport"}, {"state": "owner"},
                 {"ctl": "tcp://h:\u00b2"}, {"nvme": "h:" + "9" * 5000}, {"cap": "\u00b2"},
                 {"zone": "z" * 65}):  # fmt: skip
        why = check_member(member("n1", **tags), KEYS)
        assert isinstance(why, str) and why.startswith("bad_tag"), (tags, why)


def test_a_refusal_is_counted_and_logged_once_per_member_and_tags() -> None:
    m = membership()
    bad = member("evil", keys=OTHER)
    refused = PEER_REFUSED.labels("member_tag")
    before = refused._value.get()
    assert m._owner(bad) is None and m._owner(bad) is None
    assert refused._value.get() == before + 1
    assert m._owner(member("evil", keys=OTHER, cap="2")) is None  # new tags: counted again
    assert refused._value.get() == before + 2


_TAG_KEYS = st.sampled_from(["kv", "ctl", "nvme", "cap", "zone", "state", "auth", "x"])
_TAG_VALUES = st.one_of(
    st.text(max_size=80),
    st.sampled_from(
        [
            "1",
            "serving",
            "abc",
            "tcp://1.2.3.4:7400",
            "1.2.3.4:4420",
            "-1",
            "0",
            "tcp://h:\u00b2",
            "h:\u0663",
            "\u00b2",
        ]
    ),
    st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=40),
            st.sampled_from(sorted(MEMBER_STATUSES)),
            st.dictionaries(_TAG_KEYS, _TAG_VALUES, max_size=8),
            st.booleans(),
        ),
        max_size=6,
    )
)
def test_fuzzed_tags_never_break_the_view(
    rows: list[tuple[str, str, dict[str, str], bool]],
) -> None:
    members = []
    for name, status, tags, signed in rows:
        if signed:
            tags = {**tags, "auth": member_tag(KEYS[0], name, tags)}
        members.append(Member(name=name, addr="10.0.0.9", port=7946, tags=tags, status=status))
    m = membership()
    m.members = members
    owners = [n for n in map(m._owner, members) if n is not None]
    placement = Placement(owners)  # never an assertion inside placement
    for n in owners:
        assert 0 < n.capacity_bytes <= CAPACITY_BYTES_MAX and n.state in NODE_STATES
    view = m.view()
    assert len(view["members"]) == sum(mb.tags.get("kv") == "1" for mb in members)
    for row in view["members"]:
        assert row["status"] in {*MEMBER_STATUSES, "refused"}
    assert placement.epoch >= 0
