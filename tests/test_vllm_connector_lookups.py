"""The vLLM connector scheduler's lookups (`SchedulerLookups`) against a real agent: no
lookup once loading cannot pay, and lookups again when the tier is measured fast."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the [inference] extra (torch)")
import torch

from host_shim.integrations.vllm import SchedulerLookups, TierCostModel
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout(
    model_id="test/lookups", dtype="float16", num_layers=3, num_kv_heads=2, head_dim=8,
    chunk_tokens=32,
)  # fmt: skip
CHUNKS = 3
SYNC = 30.0  # a step budget no loopback lookup outlasts: each ask is answered at once
TOKENS = tuple(range(7_000, 7_000 + CHUNKS * LAYOUT.chunk_tokens + 5))


class CountingClient:
    """A real KVClient whose lease round trips are counted (what a lookup costs)."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.leases = 0
        self.released: list[int] = []

    def lease(self, tokens: list[int]) -> tuple[int, int]:
        self.leases += 1
        hits, lease_id = self.kv.lease(tokens)
        return int(hits), int(lease_id)

    def release_lease(self, lease_id: int) -> None:
        self.released.append(lease_id)
        self.kv.release_lease(lease_id)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from dpu_agent.testing import spawn_agent

    proc = spawn_agent(tmp_path_factory.mktemp("agent"))
    yield proc
    proc.stop()


@pytest.fixture
def client(agent: Any) -> Iterator[CountingClient]:
    from host_shim.client import KVClient

    with KVClient(agent.control_url, "default", agent.token, LAYOUT, os.urandom(32)) as kv:
        chunk = torch.zeros(LAYOUT.chunk_shape, dtype=torch.float16)
        keys = kv.keys(list(TOKENS[: CHUNKS * LAYOUT.chunk_tokens]))
        assert kv.put_keys(keys, [chunk] * CHUNKS) == CHUNKS
        yield CountingClient(kv)


def released(client: CountingClient, n: int) -> list[int]:
    """The leases released once `n` were (releases run on the lookups' thread)."""
    deadline = time.monotonic() + 10
    while len(client.released) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # and no more than n
    return client.released


def _slow_tier(cost: TierCostModel, factor: float = 4.0) -> None:
    """Feed the model the tier `factor` times slower per chunk than recomputing one."""
    rate = cost.prefill_tokens_per_s
    assert rate is not None
    chunk_s = LAYOUT.chunk_tokens / rate * factor
    for _ in range(40):  # the moving average forgets the fast samples
        cost.feed([["store", LAYOUT.chunk_bytes, chunk_s]])


def _fast_tier(cost: TierCostModel) -> None:
    for _ in range(40):
        cost.feed([["store", LAYOUT.chunk_bytes, 1e-4]])


def test_loading_can_pay_compares_one_chunk_without_the_latency() -> None:
    cost = TierCostModel()
    assert cost.loading_can_pay(256, 10 << 20)  # nothing measured: it may
    cost.observe_prefill(256, 1.0)  # 256 tokens/s: a 256-token chunk recomputes in 1 s
    cost.observe_transfer(10 << 20, 0.5)  # 10 MiB in 0.5 s: loads in 0.5 s
    cost.observe_latency(0.4)  # a round trip slower than the chunk itself: still pays per chunk
    assert cost.loading_can_pay(256, 10 << 20)
    for _ in range(40):
        cost.observe_transfer(10 << 20, 2.0)
    assert not cost.loading_can_pay(256, 10 << 20)
    assert not cost.worth_loading(256 * 8, 8 * (10 << 20))  # no match length pays either


def test_no_lookup_once_loading_cannot_pay_and_lookups_again_when_the_tier_is_fast(
    client: CountingClient,
) -> None:
    cost = TierCostModel()
    cost.observe_prefill(512, 1.0)
    _fast_tier(cost)
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=0.0, step_wait_s=SYNC)
    hits, rtt = lookups.hits("r1", TOKENS)
    assert (hits, client.leases, lookups.lookups) == (CHUNKS, 1, 1)
    assert rtt > 0
    lease = lookups.take("r1")
    assert lease
    client.release_lease(lease)

    _slow_tier(cost)  # the saver's stores over a throttled link
    for i in range(5):  # no lease round trip on the scheduler's path, the tier holds them all
        assert lookups.hits(f"s{i}", TOKENS) == (0, 0.0)
        assert lookups.take(f"s{i}") == 0
    assert (client.leases, lookups.lookups, lookups.skipped_lookups) == (1, 1, 5)

    _fast_tier(cost)  # the link is fast again: the stores measure it
    assert lookups.hits("r2", TOKENS)[0] == CHUNKS
    assert (client.leases, lookups.lookups, lookups.skipped_lookups) == (2, 2, 5)
    lookups.forget("r2")  # the request finished before it was allocated: its lease goes
    assert released(client, 2)[-1] != 0 and lookups.take("r2") == 0


def test_a_forgotten_or_taken_answer_holds_no_lease(client: CountingClient) -> None:
    cost = TierCostModel()
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=0.0, step_wait_s=SYNC)
    t0 = time.perf_counter()
    assert lookups.hits("a", TOKENS)[0] == CHUNKS
    assert time.perf_counter() - t0 < 5.0
    lookups.forget("a")
    lookups.forget("a")  # twice: released once
    assert len(released(client, 1)) == 1
    assert lookups.take("a") == 0


def test_a_match_is_deferred_while_the_start_up_probe_moves_its_chunk(
    client: CountingClient,
) -> None:
    """Before the probe has measured the tier a match is not decided: the connector answers
    vLLM "ask again" (no wait on the scheduler's loop; prompts without a match go on), and
    the answer and its lease are reused when asked again; once the probe is done the match
    is decided on the measure."""
    cost = TierCostModel()
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=20.0, step_wait_s=SYNC)
    t0 = time.monotonic()
    assert lookups.hits("early", TOKENS)[0] == CHUNKS
    for _ in range(3):  # vLLM asks again each step
        assert lookups.defer_for_probe()
        assert lookups.hits("early", TOKENS)[0] == CHUNKS
    assert time.monotonic() - t0 < 1.0  # answered at once, not after the probe
    assert (client.leases, lookups.probe_deferred_asks, lookups.reused_answers) == (1, 3, 3)

    lookups.probed.set()  # the probe measured the tier
    assert not lookups.defer_for_probe()
    assert lookups.take("early")  # allocated: its lease, from the first lookup
    assert lookups.counts() == {"lookups": 1, "skipped_lookups": 0, "probe_deferred_asks": 3,
                                "pending_asks": 0, "abandoned_lookups": 0}  # fmt: skip


def test_a_probe_that_outlasts_the_wait_max_is_taken_as_a_slow_tier(
    client: CountingClient,
) -> None:
    cost = TierCostModel()
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=0.5, step_wait_s=SYNC)
    assert lookups.hits("a", TOKENS)[0] == CHUNKS
    assert lookups.defer_for_probe()
    time.sleep(0.6)
    assert cost.bytes_per_s is None
    assert not lookups.defer_for_probe()  # the wait is over: the match is decided
    assert (client.leases, lookups.probe_deferred_asks) == (1, 1)
    # a probe still moving its chunk after the wait is a measure: at least that slow, so a
    # first match is not loaded as if the tier were unmeasured
    fed = cost.bytes_per_s
    assert fed is not None and 2 * LAYOUT.chunk_bytes / 1.5 < fed <= 2 * LAYOUT.chunk_bytes / 0.6
    assert not cost.worth_loading(LAYOUT.chunk_tokens, LAYOUT.chunk_bytes)
    assert not lookups.defer_for_probe()
    assert cost.bytes_per_s == fed  # fed once
    lookups.forget("a")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_waiting_for_blocks_reuses_its_answer_and_lease(client: CountingClient) -> None:
    """vLLM asks get_num_new_matched_tokens again every step while a request has no free
    blocks (one replay: 53 lookups for 8 requests). The request's last answer and its lease
    are reused for ANSWER_REUSE_S_MAX, then looked up anew; the lease outlives the reuse."""
    from dpu_agent.config import StorageSection
    from host_shim.integrations.vllm import ANSWER_REUSE_S_MAX

    assert ANSWER_REUSE_S_MAX < StorageSection().lease_ttl_s  # a reused lease still holds
    clock = FakeClock()
    cost = TierCostModel()
    lookups = SchedulerLookups(client, cost, LAYOUT, clock=clock, probe_wait_s_max=0.0,
                               step_wait_s=SYNC)  # fmt: skip
    requests = [f"w{i}" for i in range(8)]
    for _step in range(7):  # 8 requests asked each step, 0.5 s apart, none allocated
        for req_id in requests:
            assert lookups.hits(req_id, TOKENS)[0] == CHUNKS
        clock.now += 0.5
    assert (client.leases, lookups.lookups, lookups.reused_answers) == (8, 8, 48)
    assert client.released == []  # the leases are kept while reused

    lease = lookups.take("w0")  # allocated: the lease is the connector's now
    assert lease
    client.release_lease(lease)
    clock.now += ANSWER_REUSE_S_MAX  # the others' answers are stale: looked up anew
    assert lookups.hits("w1", TOKENS)[0] == CHUNKS
    assert client.leases == 9
    # the stale answers' leases were released with that lookup, w1's old one too
    assert len(released(client, 1 + 7)) == 1 + 7
    for req_id in requests[2:]:
        assert lookups.take(req_id) == 0
    lookups.forget("w1")


def test_a_skipped_lookup_is_reused_too(client: CountingClient) -> None:
    clock = FakeClock()
    cost = TierCostModel()
    cost.observe_prefill(512, 1.0)
    _slow_tier(cost)
    lookups = SchedulerLookups(client, cost, LAYOUT, clock=clock, probe_wait_s_max=0.0,
                               step_wait_s=SYNC)  # fmt: skip
    for _ in range(5):
        assert lookups.hits("s", TOKENS) == (0, 0.0)
    assert (client.leases, lookups.skipped_lookups, lookups.reused_answers) == (0, 1, 4)
    assert lookups.take("s") == 0


def test_a_fresh_server_does_not_load_over_a_slow_tier_before_its_first_prefill() -> None:
    """A restarted or second server's first matches come before any long forward has
    measured its prefill rate; with the probe's measure of the tier they are weighed
    against PREFILL_TOKENS_PER_S_UNMEASURED: bench serve's 40 Mbit/s link (the probe's 4.9 s
    for a chunk there and back) recomputes, loopback's rate loads."""
    from host_shim.integrations.vllm import PREFILL_TOKENS_PER_S_UNMEASURED

    chunk_bytes, chunk_tokens = 256 * 46_080, 256  # SmolLM2-135M, float32
    throttled = TierCostModel()
    throttled.feed([["store", chunk_bytes, 2.47], ["load", chunk_bytes, 2.46]])  # the probe
    assert throttled.prefill_tokens_per_s is None
    assert not throttled.worth_loading(2 * chunk_tokens, 2 * chunk_bytes)
    loopback = TierCostModel()  # the probe's chunk at 150 MB/s, loopback on a busy box
    loopback.feed([["store", chunk_bytes, chunk_bytes / 150e6], ["load", chunk_bytes, 0.078]])
    assert loopback.worth_loading(2 * chunk_tokens, 2 * chunk_bytes)
    assert loopback.worth_loading(chunk_tokens // 2, chunk_bytes)  # a match inside a chunk
    assert TierCostModel().worth_loading(chunk_tokens, chunk_bytes)  # tier unmeasured: load
    # once measured, the engine's own rate decides: slower than the prior, so loads win more
    throttled.observe_prefill(512, 512 / 20.0)  # 20 tokens/s: 25 s for 512 tokens
    assert throttled.worth_loading(2 * chunk_tokens, 2 * chunk_bytes)
    assert 150 <= PREFILL_TOKENS_PER_S_UNMEASURED <= 683  # within the rates measured here
    # 9 chunks of a fresh vLLM instance's first request (test_engine_vllm), its probe taken
    # while vLLM started beside it: loopback measured at 21 MB/s, and loaded
    started = TierCostModel()
    started.feed([["store", chunk_bytes, chunk_bytes / 21e6], ["load", chunk_bytes, 0.56]])
    assert started.worth_loading(9 * chunk_tokens, 9 * chunk_bytes)


def test_after_a_failed_probe_matches_are_recomputed_until_a_transfer_measures_the_tier() -> None:
    """A second server's probe over a link busy with the first server's stores got no
    answer in the client's timeouts; the tier counted as unmeasured, and its first match
    loaded 512 tokens over the 40 Mbit/s link (5.1 s, serve-throttled-11)."""
    chunk_bytes, chunk_tokens = 256 * 46_080, 256
    cost = TierCostModel()
    cost.probe_failed = True
    assert not cost.worth_loading(2 * chunk_tokens, 2 * chunk_bytes)
    cost.feed([["store", chunk_bytes, 0.02]])  # the saver's store measured it fast
    assert cost.worth_loading(2 * chunk_tokens, 2 * chunk_bytes)


@pytest.fixture
def stoppable(tmp_path: Path) -> Iterator[Any]:
    """An agent of its own, to black-hole (SIGSTOP: its socket still accepts, nothing answers)."""
    from dpu_agent.testing import spawn_agent

    proc = spawn_agent(tmp_path / "agent")
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.proc.pid, signal.SIGCONT)
        proc.stop()


@pytest.fixture
def held(stoppable: Any) -> Iterator[tuple[Any, CountingClient]]:
    """The stoppable agent and a counting client of it, the prompt's chunks stored there."""
    from host_shim.client import KVClient

    with KVClient(stoppable.control_url, "default", stoppable.token, LAYOUT,
                  os.urandom(32)) as kv:  # fmt: skip
        chunk = torch.zeros(LAYOUT.chunk_shape, dtype=torch.float16)
        keys = kv.keys(list(TOKENS[: CHUNKS * LAYOUT.chunk_tokens]))
        assert kv.put_keys(keys, [chunk] * CHUNKS) == CHUNKS
        yield stoppable, CountingClient(kv)


def test_a_black_holed_agent_never_holds_the_scheduler_and_a_late_lease_is_released(
    held: tuple[Any, CountingClient],
) -> None:
    """Regression: the lease round trip ran on vLLM's scheduler loop, so a black-holed agent
    held every request, decodes included, for the client's deadline (5 s). Now each ask
    waits at most the step's budget and answers "ask again"; a lookup not answered within the
    time recomputing the prompt takes is answered 0; its lease, arriving later, is released."""
    stoppable, client = held
    cost = TierCostModel()
    cost.observe_prefill(len(TOKENS), 0.3)  # recomputing this prompt: 0.3 s
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=0.0)
    assert lookups.hits("warm", TOKENS) is not None or _answered(lookups, "warm")
    lookups.forget("warm")

    os.kill(stoppable.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    asks, slowest, got = 0, 0.0, None
    while got is None and time.monotonic() - t0 < 5.0:
        lookups.new_step()  # vLLM's next step
        a0 = time.monotonic()
        got = lookups.hits("r", TOKENS)
        slowest = max(slowest, time.monotonic() - a0)
        asks += 1
        time.sleep(0.01)  # the step's other work
    took = time.monotonic() - t0
    assert got == (0, 0.0)  # recomputed: the answer would come too late to pay
    # each ask: the step's budget at most (0.02 s), with a loaded box's slack; the old code
    # held one ask for the client's deadline (5 s)
    assert slowest < 0.25, slowest
    assert 0.3 <= took < 3.0, took
    assert lookups.abandoned_lookups == 1 and lookups.pending_asks == asks - 1 > 2
    assert lookups.hits("r", TOKENS) == (0, 0.0)  # asked again: the same answer
    assert lookups.take("r") == 0
    a0 = time.monotonic()  # while that lookup is stuck, the next prompts are not looked up
    assert lookups.hits("r2", TOKENS) == (0, 0.0) and time.monotonic() - a0 < 0.1
    assert lookups.skipped_lookups == 1 and lookups.lookups == 2

    os.kill(stoppable.proc.pid, signal.SIGCONT)  # the late answer arrives: its lease goes
    deadline = time.monotonic() + 10
    while len(client.released) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.leases == 2 and len(client.released) == 2 and client.released[-1] != 0
    lookups.close()


def _answered(lookups: SchedulerLookups, req_id: str) -> bool:
    for _ in range(500):
        lookups.new_step()
        if lookups.hits(req_id, TOKENS) is not None:
            return True
        time.sleep(0.01)
    return False


def test_an_in_flight_lookup_of_a_finished_request_releases_its_lease(
    held: tuple[Any, CountingClient],
) -> None:
    """vLLM may finish (abort) a request whose lookup is in flight: nothing is left leased."""
    stoppable, client = held
    lookups = SchedulerLookups(client, TierCostModel(), LAYOUT, probe_wait_s_max=0.0)
    os.kill(stoppable.proc.pid, signal.SIGSTOP)
    assert lookups.hits("gone", TOKENS) is None  # in flight
    lookups.forget("gone")  # request_finished
    assert lookups.take("gone") == 0
    os.kill(stoppable.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not client.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.leases == 1 and len(client.released) == 1 and client.released[0] != 0
    lookups.close()


def test_a_probe_slower_than_recomputing_a_chunk_ends_the_wait_for_lookups(
    held: tuple[Any, CountingClient],
) -> None:
    """Regression (serve-throttled-13: a fresh second server's first request waited 4.6 s,
    against plain's 1.6, for a lookup queued behind the start-up probe's data on a 40 Mbit/s
    link). A probe still running after twice the time recomputing a chunk takes says loading
    a chunk cannot pay: the lookup in flight is answered 0 then, not when it arrives."""
    stoppable, client = held
    cost = TierCostModel()
    cost.observe_prefill(512, 512 / 1000)  # a chunk recomputes in 32 ms
    lookups = SchedulerLookups(client, cost, LAYOUT, probe_wait_s_max=30.0)
    os.kill(stoppable.proc.pid, signal.SIGSTOP)  # the lookup waits, as behind the probe
    assert lookups.hits("first", TOKENS) is None
    time.sleep(0.15)  # the probe has not ended: its chunk takes > 75 ms each way
    lookups.new_step()
    t0 = time.monotonic()
    assert lookups.hits("first", TOKENS) == (0, 0.0)  # answered: recompute
    assert lookups.hits("next", TOKENS) == (0, 0.0)  # and no lookup for the next prompt
    assert time.monotonic() - t0 < 0.1
    assert not cost.loading_can_pay(LAYOUT.chunk_tokens, LAYOUT.chunk_bytes)
    assert not lookups.defer_for_probe()  # no match waits for that probe either
    assert (lookups.lookups, lookups.abandoned_lookups, lookups.skipped_lookups) == (1, 1, 1)
    os.kill(stoppable.proc.pid, signal.SIGCONT)
    lookups.close()


def test_an_unmeasured_prefill_rate_is_the_prior_in_loading_can_pay() -> None:
    from host_shim.integrations.vllm import PREFILL_TOKENS_PER_S_UNMEASURED

    chunk_bytes, chunk_tokens = 256 * 46_080, 256  # SmolLM2-135M, float32
    cost = TierCostModel()
    cost.feed([["load", chunk_bytes, 2.5]])  # the 40 Mbit/s link: 2.5 s a chunk
    assert chunk_tokens / PREFILL_TOKENS_PER_S_UNMEASURED < 2.5
    assert not cost.loading_can_pay(chunk_tokens, chunk_bytes)
    cost.observe_prefill(512, 512 / 20.0)  # an engine far slower than the prior: it pays
    assert cost.loading_can_pay(chunk_tokens, chunk_bytes)
