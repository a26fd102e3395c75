"""The Serf RPC codec and client against live `serf agent` processes on loopback ports."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
from waits import wait_until

from dpu_agent.cluster import SerfClient, SerfProcess, free_port
from kvproto.serf import MemberEvent, QueryEvent, SerfError, UserEvent

pytestmark = pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary")


def start(node: str, join: list[str] | None = None, auth_key: str = "") -> SerfProcess:
    return SerfProcess(
        node, bind=f"127.0.0.1:{free_port()}", rpc_addr=f"127.0.0.1:{free_port()}",
        tags={"role": "kv"}, join=join or [], auth_key=auth_key,
    )  # fmt: skip


@pytest.fixture()
def pair() -> Iterator[tuple[SerfProcess, SerfProcess]]:
    a = start("a1")
    b = start("b1", join=[a.bind])
    try:
        yield a, b
    finally:
        for p in (a, b):
            p.kill()


def test_members_join_tags_event_query_stop_leave(pair: tuple[SerfProcess, SerfProcess]) -> None:
    a, b = pair
    with a.wait_ready() as ca, b.wait_ready() as cb:
        wait_until(lambda: len([m for m in ca.members() if m.status == "alive"]) == 2,
                   "both members alive", interval_s=0.1)  # fmt: skip
        names = {m.name: m for m in ca.members()}
        assert names["b1"].tags == {"role": "kv"} and names["b1"].addr == "127.0.0.1"
        assert [m.name for m in ca.members_filtered(status="alive", name="b.*")] == ["b1"]
        seq = ca.stream("member-update,user:hello,query")
        cb.tags({"zone": "z1"}, delete=["role"])
        cb.event("hello", b"payload", coalesce=False)
        seen: dict[type, object] = {}
        deadline = time.monotonic() + 20
        while len(seen) < 2 and time.monotonic() < deadline:
            rec = ca.next_record(1.0)
            if isinstance(rec, MemberEvent) and rec.members[0].tags.get("zone") == "z1":
                seen[MemberEvent] = rec
            elif isinstance(rec, UserEvent):
                assert (rec.name, rec.payload) == ("hello", b"payload")
                seen[UserEvent] = rec
        assert set(seen) == {MemberEvent, UserEvent}, seen
        # a query from b is delivered to a's stream; a answers it through respond. b has a
        # stream of its own: its records arriving during the query are kept, not lost
        cb.stream("user:other")
        ca.event("other", b"kept", coalesce=False)
        replies = []
        for rec in cb.query("ping", b"?", timeout_s=3.0, request_ack=True):
            if rec.type == "response":
                replies.append((rec.from_, rec.payload))
            if not replies:
                q = ca.next_record(0.5)
                if isinstance(q, QueryEvent):
                    ca.respond(q.id, b"pong")
        ca.stop(seq)
        assert ("a1", b"pong") in replies, replies
        kept = cb.next_record(5.0)
        assert isinstance(kept, UserEvent) and kept.payload == b"kept", kept
        assert ca.join([b.bind]) == 1
        with pytest.raises(SerfError, match="join"):
            ca.join(["127.0.0.1:1"])
        cb.leave()
        wait_until(lambda: {m.name: m.status for m in ca.members()}["b1"] in ("left", "failed"),
                   "b1 left", interval_s=0.1)  # fmt: skip


def test_auth_key_required_and_checked() -> None:
    p = start("auth1", auth_key="s3cret")
    try:
        p.wait_ready().close()
        with SerfClient(p.rpc_addr) as c, pytest.raises(SerfError, match="Authentication"):
            c.members()
        with pytest.raises(SerfError, match="Invalid authentication token"):
            SerfClient(p.rpc_addr, auth_key="wrong")
        with SerfClient(p.rpc_addr, auth_key="s3cret") as c:
            assert [m.name for m in c.members()] == ["auth1"]
    finally:
        p.kill()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_serf_dies_with_a_killed_parent() -> None:
    """The failure: an agent killed with kill -9 left its `serf agent` child running, holding
    the node's ports and gossiping a member nobody served (two per kill -9 test)."""
    import os
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from dpu_agent.cluster import SerfProcess, free_port\n"
        "s = SerfProcess('orphan', bind=f'127.0.0.1:{free_port()}',"
        " rpc_addr=f'127.0.0.1:{free_port()}')\n"
        "s.wait_ready().close()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        serf_pid = int(parent.stdout.readline())
        os.kill(serf_pid, 0)  # running while its parent lives
    finally:
        parent.kill()
        parent.wait()

    def gone() -> bool:
        try:
            os.kill(serf_pid, 0)
        except ProcessLookupError:
            return True
        # reaped by init, or a zombie init has not reaped yet: only 'Z' counts as gone
        with open(f"/proc/{serf_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"

    try:
        wait_until(gone, "the member gone", 10.0, 0.1)
    finally:
        if not gone():
            os.kill(serf_pid, signal.SIGKILL)


def test_free_port_never_hands_out_a_port_twice_in_a_row() -> None:
    """A CI rehearsal: `serf agent a1 exited with 1` (the cause that fits). A pick is free
    when made, but nothing holds it until Serf binds, and a node's gossip and RPC ports are
    two picks: 2,000 picks from 12,000 ports repeat one almost surely (the birthday bound),
    so the same port twice would make a Serf bind its own port. Picks this process made are
    not made again."""
    picks = [free_port() for _ in range(2000)]
    assert len(set(picks)) == len(picks)
