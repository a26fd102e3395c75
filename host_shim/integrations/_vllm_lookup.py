"""The vLLM connector scheduler's lookups of a prompt's chunks on the tier (needs no vLLM):
whether to look up at all, the lookup itself off the scheduler's loop, deferring a match
while the start-up probe moves its chunk, and reusing a request's answer while vLLM asks again
for a request that waits for free blocks."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from host_shim.integrations._vllm_core import TierCostModel
from kvproto.keys import ChunkLayout

__all__ = [
    "ANSWER_REUSE_S_MAX",
    "LOOKUP_STEP_WAIT_S",
    "PROBE_LOOKUP_WAIT_S_MAX",
    "SchedulerLookups",
]

log = logging.getLogger("host_shim.integrations.vllm")

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
# The most one scheduler step waits for lookups in all (`new_step` refills it): a lookup on
# loopback answers in about a millisecond, so a healthy tier's answer is in the step that
# asked, as when the scheduler made the round trip itself; a slow one is asked again.
LOOKUP_STEP_WAIT_S = 0.02
# What an ask of a lookup still in flight waits (from the step's budget): lets the lookups'
# thread take the GIL from a scheduler spinning on "ask again" with nothing else to run.
LOOKUP_POLL_S = 0.001
# Releases queued for the lookups' thread beyond this are dropped: the agent frees a lease
# at its TTL anyway (a black-holed agent must not grow the queue without bound).
RELEASES_QUEUED_MAX = 4096


@dataclass(slots=True)
class _Lookup:
    """A lease round trip handed to the lookups' thread."""

    tokens: list[int]
    at: float  # clock() when asked
    give_up_s: float  # after this long recomputing the prompt is sooner: answer 0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False  # answered 0 (or forgotten) first: the lease is released on arrival
    hits: int = 0
    lease_id: int = 0
    rtt: float = 0.0


@dataclass(slots=True)
class _Answer:
    at: float  # clock() when looked up
    hits: int  # leading chunks the agent held
    lease_id: int  # their lease (0: none), released by take()'s caller or here


class SchedulerLookups:
    """The scheduler's answers to "how many of this prompt's chunks does the tier hold?".

    - The lease round trip runs on this object's own thread (`dpukv-lookups`), never on the
      scheduler's loop: an ask waits for it at most what is left of the step's
      `step_wait_s` (`new_step` refills it each step) and otherwise answers None, which the
      connector hands vLLM as "ask again" (the request waits, every other request is
      scheduled). Before, the round trip was made in the scheduler: a black-holed agent held
      every request, decodes included, for the client's deadline, and behind a throttled
      link each lookup held the loop for the time its frame queued there. A lookup not
      answered within the time recomputing the prompt would take (the cost model's prefill
      rate, its prior before a forward measured it) is answered 0: no wait for it could pay
      (`abandoned_lookups`; its lease is released when it arrives).
      While such a lookup is still in flight (a black-holed agent, until the client's
      deadline) new prompts are not looked up (`skipped_lookups`): one request waits for a
      dead tier, not each.
    - Once the cost model has measured the tier slower per chunk than recomputing a chunk
      (`TierCostModel.loading_can_pay`), no match could be loaded, so it does not look up at
      all (`skipped_lookups`). The saver's stores keep measuring the tier, so lookups start
      again when it is measured fast.
    - While the start-up probe moves its chunk (until `probed` is set by the probe's thread,
      whether it succeeded or not, at most `probe_wait_s_max` after start) a match is not
      decided: `defer_for_probe` says so, and the connector answers vLLM "ask again" (its
      answer and lease kept for the next ask), so no match is decided on an unmeasured tier.
      Not an answer of 0: a fresh instance's first request, sent as soon as it started,
      then recomputed a prefix a fast tier held. A probe still running is a measure too:
      once it has run twice as long as recomputing one chunk takes (the model's prefill
      rate, or its prior; `probe_wait_s_max` at most), a chunk there and back took at least
      that long, so loading one cannot pay: the model is told so, and the lookups, those in
      flight included, are answered 0 from then on until a transfer measures the tier fast.
      Before, behind a 40 Mbit/s link (a 4.9 s probe), a fresh server's first request
      waited for its lookup behind the probe's data (4.6 s against plain's 1.6).
    - A request asked again within `reuse_s_max` gets its last answer and keeps its lease
      (`reused_answers`); `take` hands the lease over when vLLM allocates the request,
      `forget` releases it. Answers older than `reuse_s_max` are dropped and their leases
      released on the next lookup, so only the requests asked in the last `reuse_s_max`
      hold one here. Releases go through the lookups' thread too (`release`), so a dead
      agent costs the scheduler nothing there either.
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
        step_wait_s: float = LOOKUP_STEP_WAIT_S,
    ) -> None:
        assert probe_wait_s_max >= 0 and reuse_s_max >= 0 and step_wait_s >= 0
        self._client, self._cost, self._layout = client, cost, layout
        self._clock, self._reuse_s_max = clock, reuse_s_max
        self._probe_started = time.monotonic()
        self.probed = threading.Event()
        self._probe_wait_s_max = probe_wait_s_max
        self._probe_outlasted = False  # the probe ran past the wait: its bound is in the model
        self._answers: dict[str, _Answer] = {}  # insertion order is lookup order
        self._pending: dict[str, _Lookup] = {}  # asked, not answered yet
        self._step_wait_s = step_wait_s
        self._wait_left_s = step_wait_s  # this step's budget for waiting on lookups
        self._jobs: queue.Queue[_Lookup | int | None] = queue.Queue()
        self._queued_releases = 0  # releases in _jobs (a bound: RELEASES_QUEUED_MAX)
        self._jobs_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first job
        self._current: _Lookup | None = None  # the lookup the thread is making
        self.lookups = 0  # lease round trips asked for
        self.skipped_lookups = 0  # asks answered 0 without one: loading could not pay
        self.reused_answers = 0  # asks answered from the request's last lookup
        self.probe_deferred_asks = 0  # matches deferred while the start-up probe ran
        self.pending_asks = 0  # asks answered "ask again": the lookup was still in flight
        self.abandoned_lookups = 0  # answered 0: recomputing was sooner than the answer

    def new_step(self) -> None:
        """A scheduler step begins: its budget for waiting on lookups is full again."""
        self._wait_left_s = self._step_wait_s

    def hits(
        self, req_id: str, tokens: Sequence[int], computed_tokens: int = 0
    ) -> tuple[int, float] | None:
        """Leading chunks of the prompt the tier holds (leased until `take` or `forget`) and
        the lease round trip's seconds (0.0 when none was made), or None: not answered yet,
        ask again (next step)."""
        now = self._clock()
        old = self._answers.get(req_id)
        if old is not None and now - old.at <= self._reuse_s_max:
            self.reused_answers += 1
            return old.hits, 0.0
        lo = self._layout
        self._probe_in_flight()  # a probe that has run too long is a measure: into the model
        can_pay = self._cost.loading_can_pay(lo.chunk_tokens, lo.chunk_bytes)
        job = self._pending.get(req_id)
        if job is None:
            self.forget(req_id)
            self._expire(now)
            stalled = self._current  # a lookup given up on and still in flight: no answer
            if (stalled is not None and stalled.abandoned) or not can_pay:
                self.skipped_lookups += 1
                self._answers[req_id] = _Answer(now, 0, 0)  # asked again: the same
                return 0, 0.0
            # an answer later than recomputing the prompt (beyond vLLM's own hit) cannot pay
            give_up_s = self._cost.recompute_s(max(0, len(tokens) - computed_tokens))
            job = _Lookup(list(tokens), now, give_up_s)
            self._pending[req_id] = job
            self.lookups += 1
            self._put(job)
            wait_s = self._step_wait_s
        elif not can_pay:  # its answer could not be loaded: do not wait for it
            return self._give_up(req_id, job, now)
        else:
            wait_s = LOOKUP_POLL_S
        t0 = time.monotonic()
        job.done.wait(min(wait_s, self._wait_left_s))
        self._wait_left_s = max(0.0, self._wait_left_s - (time.monotonic() - t0))
        if not job.done.is_set():
            if self._clock() - job.at < job.give_up_s:
                self.pending_asks += 1
                return None
            return self._give_up(req_id, job, self._clock())
        del self._pending[req_id]
        self._answers[req_id] = _Answer(self._clock(), job.hits, job.lease_id)
        return job.hits, job.rtt

    def _give_up(self, req_id: str, job: _Lookup, now: float) -> tuple[int, float]:
        """Answer 0 for a lookup still in flight; its lease is released when it arrives."""
        del self._pending[req_id]
        self._abandon(job)
        self.abandoned_lookups += 1
        self._answers[req_id] = _Answer(now, 0, 0)
        return 0, 0.0

    def counts(self) -> dict[str, int]:
        """The counters since start, named as in the connector's stats (STATS_COUNTERS)."""
        return {
            "lookups": self.lookups,
            "skipped_lookups": self.skipped_lookups,
            "probe_deferred_asks": self.probe_deferred_asks,
            "pending_asks": self.pending_asks,
            "abandoned_lookups": self.abandoned_lookups,
        }

    def defer_for_probe(self) -> bool:
        """Whether a match must wait for the start-up probe (counted)."""
        if self._probe_in_flight():
            self.probe_deferred_asks += 1
            return True
        return False

    def take(self, req_id: str) -> int:
        """The request's lease (0: none), now the caller's to release (`release`); its
        answer is gone."""
        answer = self._answers.pop(req_id, None)
        if answer is not None:
            return answer.lease_id
        job = self._pending.pop(req_id, None)
        if job is not None:  # never answered: not the caller's
            self._abandon(job)
        return 0

    def forget(self, req_id: str) -> None:
        """Drop the request's answer (or its lookup in flight) and release its lease."""
        self.release(self.take(req_id))

    def release(self, lease_id: int) -> None:
        """Release a lease on the lookups' thread (dropped past RELEASES_QUEUED_MAX: the
        agent frees it at its TTL)."""
        if not lease_id:
            return
        with self._jobs_lock:
            if self._queued_releases >= RELEASES_QUEUED_MAX:
                return
            self._queued_releases += 1
        self._put(lease_id)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the lookups' thread (what is queued is dropped: leases end at their TTL)."""
        with self._jobs_lock:
            thread, self._closed = self._thread, True
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)

    def _put(self, job: _Lookup | int) -> None:
        with self._jobs_lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpukv-lookups",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        self._jobs.put(job)

    def _abandon(self, job: _Lookup) -> None:
        with job.lock:
            if not job.done.is_set():
                job.abandoned = True
                return
        self.release(job.lease_id)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, int):
                with self._jobs_lock:
                    self._queued_releases -= 1
                self._call(self._client.release_lease, job)
                continue
            if job.abandoned:  # answered 0 before its turn: no round trip
                continue
            t0 = time.perf_counter()
            self._current = job
            got = self._call(self._client.lease, job.tokens)
            self._current = None
            hits, lease_id = got if got is not None else (0, 0)
            with job.lock:
                job.hits, job.lease_id = int(hits), int(lease_id or 0)
                job.rtt = time.perf_counter() - t0 if got is not None else 0.0
                release = job.abandoned and job.lease_id
                job.done.set()
            if release:
                self._call(self._client.release_lease, job.lease_id)

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # a lookup is a miss, a release the TTL's: the thread goes on
            log.exception("dpukv: lookup thread: %s failed", getattr(fn, "__name__", fn))
            return None

    def _expire(self, now: float) -> None:
        while self._answers:
            req_id, answer = next(iter(self._answers.items()))
            if now - answer.at <= self._reuse_s_max:
                return
            self.forget(req_id)

    def _probe_in_flight(self) -> bool:
        if self.probed.is_set() or self._probe_outlasted:
            return False
        lo = self._layout
        wait_s = min(self._probe_wait_s_max, 2 * self._cost.recompute_s(lo.chunk_tokens))
        ran_s = time.monotonic() - self._probe_started
        if ran_s < wait_s:
            return True
        # its chunk there and back took at least this long: one chunk's load, at least
        # half of it, is no faster than recomputing the chunk (a bound: never a faster tier
        # than the model has; none with no wait at all)
        self._probe_outlasted = True
        bound = 2 * lo.chunk_bytes / ran_s if wait_s > 0 else None
        if bound is not None and (self._cost.bytes_per_s or math.inf) > bound:
            self._cost.observe_transfer(2 * lo.chunk_bytes, ran_s)
        return False
