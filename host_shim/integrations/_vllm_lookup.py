"""The vLLM connector scheduler's lookups of a prompt's chunks on the tier (needs no vLLM):
whether to look up at all, and waiting for the start-up probe."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from host_shim.integrations._vllm_core import TierCostModel
from kvproto.keys import ChunkLayout

__all__ = ["PROBE_LOOKUP_WAIT_S_MAX", "SchedulerLookups"]

# How long the first lookups wait for the scheduler's start-up probe to have measured the
# tier: a tier that answers at all moves one chunk in seconds even throttled (2.4 s at
# 40 Mbit/s); one slower than this is decided on without it (it loads until measured).
PROBE_LOOKUP_WAIT_S_MAX = 30.0


@dataclass(slots=True)
class _Answer:
    hits: int  # leading chunks the agent held
    lease_id: int  # their lease (0: none), released by take()'s caller or here


class SchedulerLookups:
    """The scheduler's answers to "how many of this prompt's chunks does the tier hold?".

    - Once the cost model has measured the tier slower per chunk than recomputing a chunk
      (`TierCostModel.loading_can_pay`), no match could be loaded, so it does not look up at
      all (no lease round trip on the scheduler's path; `skipped_lookups`). The saver's
      stores keep measuring the tier, so lookups start again when it is measured fast.
    - The first lookups wait for the start-up probe (`probed`, set by the probe's thread
      whether it succeeded or not), at most `probe_wait_s_max` after start, so the first
      match is decided on a measured tier.
    - `take` hands a request's lease over when vLLM allocates the request, `forget`
      releases it.
    """

    def __init__(
        self,
        client: Any,
        cost: TierCostModel,
        layout: ChunkLayout,
        *,
        probe_wait_s_max: float = PROBE_LOOKUP_WAIT_S_MAX,
    ) -> None:
        assert probe_wait_s_max >= 0
        self._client, self._cost, self._layout = client, cost, layout
        self._probe_deadline = time.monotonic() + probe_wait_s_max
        self.probed = threading.Event()
        self._answers: dict[str, _Answer] = {}
        self.lookups = 0  # lease round trips made
        self.skipped_lookups = 0  # asks answered 0 without one: loading could not pay

    def hits(self, req_id: str, tokens: Sequence[int]) -> tuple[int, float]:
        """Leading chunks of the prompt the tier holds (leased until `take` or `forget`),
        and the lease round trip's seconds (0.0 when no lookup was made)."""
        self.forget(req_id)
        self._wait_for_probe()
        lo = self._layout
        if not self._cost.loading_can_pay(lo.chunk_tokens, lo.chunk_bytes):
            self.skipped_lookups += 1
            return 0, 0.0
        self.lookups += 1
        t0 = time.perf_counter()
        hits, lease_id = self._client.lease(list(tokens))
        rtt = time.perf_counter() - t0
        self._answers[req_id] = _Answer(int(hits), int(lease_id or 0))
        return int(hits), rtt

    def take(self, req_id: str) -> int:
        """The request's lease (0: none), now the caller's to release; its answer is gone."""
        answer = self._answers.pop(req_id, None)
        return answer.lease_id if answer is not None else 0

    def forget(self, req_id: str) -> None:
        """Drop the request's answer and release its lease."""
        lease_id = self.take(req_id)
        if lease_id:
            self._client.release_lease(lease_id)

    def _wait_for_probe(self) -> None:
        left = self._probe_deadline - time.monotonic()
        if left > 0 and not self.probed.is_set():
            self.probed.wait(left)
