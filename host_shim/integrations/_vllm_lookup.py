"""The vLLM connector scheduler's lookups of a prompt's chunks on the tier (needs no vLLM):
whether to look up at all, deferring a match while the start-up probe moves its chunk, and
reusing a request's answer
while vLLM asks again for a request that waits for free blocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from host_shim.integrations._vllm_core import TierCostModel
from kvproto.keys import ChunkLayout

__all__ = ["ANSWER_REUSE_S_MAX", "PROBE_LOOKUP_WAIT_S_MAX", "SchedulerLookups"]

# How long after start a match is deferred while the start-up probe has not measured the
# tier: a tier that answers at all moves the probe's chunk there and back in
# seconds even throttled (4.9 s at bench serve's 40 Mbit/s); past this lookups go on, with
# the tier taken to be at least as slow as a probe still moving its chunk after this long.
PROBE_LOOKUP_WAIT_S_MAX = 30.0
# How long a request's answer (hits and their lease) is reused while vLLM asks again each
# step for a request that has no free blocks: one replay made 53 lookups for 8 requests.
# Well under the agent's lease TTL (`lease_ttl_s`, 30 s by default), so that the reused
# lease still holds the chunks when the request is allocated and loads them.
ANSWER_REUSE_S_MAX = 5.0


@dataclass(slots=True)
class _Answer:
    at: float  # clock() when looked up
    hits: int  # leading chunks the agent held
    lease_id: int  # their lease (0: none), released by take()'s caller or here


class SchedulerLookups:
    """The scheduler's answers to "how many of this prompt's chunks does the tier hold?".

    - Once the cost model has measured the tier slower per chunk than recomputing a chunk
      (`TierCostModel.loading_can_pay`), no match could be loaded, so it does not look up at
      all (no lease round trip on the scheduler's path; `skipped_lookups`). The saver's
      stores keep measuring the tier, so lookups start again when it is measured fast.
    - While the start-up probe moves its chunk (until `probed` is set by the probe's thread,
      whether it succeeded or not, at most `probe_wait_s_max` after start) a match is not
      decided: `defer_for_probe` says so, and the connector answers vLLM "not yet, ask
      again" (its answer and lease kept for the next ask), so no match is decided on an
      unmeasured tier and the scheduler's loop goes on with the other requests. Not a wait
      in the scheduler: that held the loop, every request with it, for the rest of the
      probe (first TTFTs of 3.5 and 4.1 s against plain's 0.7 and 1.4 s behind a 40 Mbit/s
      link, where the probe takes 4.9 s, though those first prompts matched nothing). Not
      an answer of 0 either: a fresh instance's first request, sent as soon as it started,
      then recomputed a prefix a fast tier held. A probe still running
      after `probe_wait_s_max` is a measure too: the model is told its chunk took at least
      that long there and back (a second server's probe behind the throttled link, sharing
      it with the first server's stores, ran out the wait and its first match then loaded
      over the link as if the tier were unmeasured).
    - A request asked again within `reuse_s_max` gets its last answer and keeps its lease
      (`reused_answers`); `take` hands the lease over when vLLM allocates the request,
      `forget` releases it. Answers older than `reuse_s_max` are dropped and their leases
      released on the next lookup, so only the requests asked in the last `reuse_s_max`
      hold one here.
    """

    def __init__(
        self,
        client: Any,
        cost: TierCostModel,
        layout: ChunkLayout,
        *,
        clock: Callable[[], float] = time.monotonic,
        probe_wait_s_max: float = PROBE_LOOKUP_WAIT_S_MAX,
        reuse_s_max: float = ANSWER_REUSE_S_MAX,
    ) -> None:
        assert probe_wait_s_max >= 0 and reuse_s_max >= 0
        self._client, self._cost, self._layout = client, cost, layout
        self._clock, self._reuse_s_max = clock, reuse_s_max
        self._probe_deadline = time.monotonic() + probe_wait_s_max
        self.probed = threading.Event()
        self._probe_wait_s_max = probe_wait_s_max
        self._probe_outlasted = False  # the probe ran past the wait: its bound is in the model
        self._answers: dict[str, _Answer] = {}  # insertion order is lookup order
        self.lookups = 0  # lease round trips made
        self.skipped_lookups = 0  # asks answered 0 without one: loading could not pay
        self.reused_answers = 0  # asks answered from the request's last lookup
        self.probe_deferred_asks = 0  # matches deferred while the start-up probe ran

    def hits(self, req_id: str, tokens: Sequence[int]) -> tuple[int, float]:
        """Leading chunks of the prompt the tier holds (leased until `take` or `forget`),
        and the lease round trip's seconds (0.0 when no lookup was made)."""
        now = self._clock()
        old = self._answers.get(req_id)
        if old is not None and now - old.at <= self._reuse_s_max:
            self.reused_answers += 1
            return old.hits, 0.0
        self.forget(req_id)
        self._expire(now)
        lo = self._layout
        if not self._cost.loading_can_pay(lo.chunk_tokens, lo.chunk_bytes):
            self.skipped_lookups += 1
            self._answers[req_id] = _Answer(self._clock(), 0, 0)  # asked again: the same
            return 0, 0.0
        self.lookups += 1
        t0 = time.perf_counter()
        hits, lease_id = self._client.lease(list(tokens))
        rtt = time.perf_counter() - t0
        self._answers[req_id] = _Answer(self._clock(), int(hits), int(lease_id or 0))
        return int(hits), rtt

    def counts(self) -> dict[str, int]:
        """The counters since start, named as in the connector's stats (STATS_COUNTERS)."""
        return {
            "lookups": self.lookups,
            "skipped_lookups": self.skipped_lookups,
            "probe_deferred_asks": self.probe_deferred_asks,
        }

    def defer_for_probe(self) -> bool:
        """Whether a match must wait for the start-up probe (counted)."""
        if self._probe_in_flight():
            self.probe_deferred_asks += 1
            return True
        return False

    def take(self, req_id: str) -> int:
        """The request's lease (0: none), now the caller's to release; its answer is gone."""
        answer = self._answers.pop(req_id, None)
        return answer.lease_id if answer is not None else 0

    def forget(self, req_id: str) -> None:
        """Drop the request's answer and release its lease."""
        lease_id = self.take(req_id)
        if lease_id:
            self._client.release_lease(lease_id)

    def _expire(self, now: float) -> None:
        while self._answers:
            req_id, answer = next(iter(self._answers.items()))
            if now - answer.at <= self._reuse_s_max:
                return
            self.forget(req_id)

    def _probe_in_flight(self) -> bool:
        if self.probed.is_set():
            return False
        if time.monotonic() < self._probe_deadline:
            return True
        if not self._probe_outlasted:  # its chunk there and back took at least this long
            self._probe_outlasted = True
            self._cost.observe_transfer(2 * self._layout.chunk_bytes, self._probe_wait_s_max)
        return False
