"""`DpuKVConnector`: the vLLM V1 connector class (imports vLLM; see host_shim.integrations.vllm).

Written against vLLM 0.32's ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/
v1/base.py): ``__init__(vllm_config, role, kv_cache_config)``; scheduler side
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``; worker side ``register_kv_caches``, ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``,
``get_block_ids_with_load_errors``; the stats channel ``get_kv_connector_stats`` (both sides),
``update_connector_output`` (scheduler), ``build_kv_connector_stats`` and
``build_prom_metrics`` (vllm/distributed/kv_transfer/kv_connector/v1/metrics.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from host_shim.client import KVClient
from host_shim.integrations._vllm_core import (
    PREFILL_TOKENS_MIN,
    STATS_COUNTERS,
    STATS_GAUGES,
    AsyncSaver,
    ConnectorSettings,
    CostSamples,
    ReqLoad,
    ReqStore,
    TierCostModel,
    failed_block_ids,
    forward_binding_warning,
    load_request,
    matched_tokens,
    merge_stats,
    omp_bound_cpus,
    paged_kind_for,
    probe_tier,
    reduce_stats,
    storable_chunks,
)
from host_shim.integrations._vllm_lookup import PROBE_LOOKUP_WAIT_S_MAX, SchedulerLookups
from host_shim.integrations.layout import PagedLayout, check_chunk_tokens
from kvproto.keys import ChunkLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["DpuKVConnector", "DpuKVConnectorMetadata", "DpuKVStats"]

log = logging.getLogger("host_shim.integrations.vllm")

# Scheduler steps a lease is kept after the step that loads its chunks: vLLM keeps at most
# `max_concurrent_batches` steps in flight (2 with async scheduling), so by then the worker has
# run that step's start_load_kv. Leases also end at request_finished() and at the agent's TTL.
LEASE_STEPS_MAX = 4


@dataclass
class DpuKVStats(KVConnectorStats):
    """The connector's stats (``data``: `_vllm_core.merge_stats`'s dict): the worker's timed
    loads, stores and forwards, which the scheduler's `update_connector_output` feeds to its
    `TierCostModel` (with `vllm serve` on the CPU build the worker is another process, and
    this is the only way its measurements reach the scheduler), and the scheduler's
    load-or-recompute decisions, which vLLM logs ("KV Transfer metrics") and exports
    (`DpuKVPromMetrics`)."""

    def reset(self) -> None:
        self.data = merge_stats({}, {})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("samples") and not any(
            self.data.get(name) for name in (*STATS_COUNTERS, *STATS_GAUGES)
        )


# reduce_stats' keys -> (Prometheus counter, help); prometheus_client adds "_total"
PROM_COUNTERS = {
    "load_decisions": ("vllm:dpukv_load_decisions", "Matched prefixes loaded from the tier."),
    "recompute_decisions": (
        "vllm:dpukv_recompute_decisions",
        "Matched prefixes recomputed: loading them was estimated slower.",
    ),
    "loaded_tokens": ("vllm:dpukv_loaded_tokens", "Tokens of the matched prefixes loaded."),
    "recomputed_tokens": (
        "vllm:dpukv_recomputed_tokens",
        "Tokens of the matched prefixes recomputed instead of loaded.",
    ),
    "load_bytes": ("vllm:dpukv_load_bytes", "Bytes loaded from the tier."),
    "load_s": ("vllm:dpukv_load_seconds", "Seconds spent loading from the tier."),
    "store_bytes": ("vllm:dpukv_store_bytes", "Bytes stored to the tier."),
    "store_s": ("vllm:dpukv_store_seconds", "Seconds storing to the tier (off the forward)."),
    "lookups": ("vllm:dpukv_lookups", "The scheduler's lookups (lease round trips)."),
    "skipped_lookups": (
        "vllm:dpukv_skipped_lookups",
        "Prompts not looked up: the tier was measured slower per chunk than recomputing.",
    ),
    "probe_deferred_asks": (
        "vllm:dpukv_probe_deferred_asks",
        "Matches answered 'ask again': the start-up probe had not measured the tier yet.",
    ),
    "pending_asks": (
        "vllm:dpukv_pending_asks",
        "Asks answered 'ask again': the lookup was still in flight on its own thread.",
    ),
    "abandoned_lookups": (
        "vllm:dpukv_abandoned_lookups",
        "Lookups answered 0: no answer within the time recomputing the prompt takes.",
    ),
}
PROM_GAUGES = {
    "latency_s": ("vllm:dpukv_model_latency_seconds", "The cost model's tier round trip."),
    "bytes_per_s": ("vllm:dpukv_model_tier_bytes_per_second", "The cost model's tier bandwidth."),
    "prefill_tokens_per_s": (
        "vllm:dpukv_model_prefill_tokens_per_second",
        "The cost model's prefill rate of the engine.",
    ),
}


class DpuKVPromMetrics(KVConnectorPromMetrics):
    """The decisions and transfers as Prometheus counters on vLLM's /metrics:
    ``vllm:dpukv_load_decisions_total``, ``vllm:dpukv_recompute_decisions_total`` (matched
    prefixes loaded / recomputed because loading was estimated slower), their tokens, and
    ``vllm:dpukv_{load,store}_{bytes,seconds}_total``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {}
        for key, (name, doc) in PROM_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)
        self._gauges = {}
        for key, (name, doc) in PROM_GAUGES.items():
            gauge = self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                    multiprocess_mode="mostrecent")  # fmt: skip
            self._gauges[key] = create_metric_per_engine(gauge, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in reduce_stats(transfer_stats_data).items():
            if value and key in self._counters:
                self._counters[key][engine_idx].inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)


@dataclass
class DpuKVConnectorMetadata(KVConnectorMetadata):
    loads: list[ReqLoad] = field(default_factory=list)
    stores: list[ReqStore] = field(default_factory=list)
    step_tokens: int = 0  # tokens the step computes: its forward measures the prefill rate


@dataclass(slots=True)
class _Tracked:
    """A request whose prompt chunks are stored as they are computed."""

    tokens: tuple[int, ...]
    block_ids: list[int]
    stored: int  # leading chunks the agent holds (at match) or that were stored since


def _layout(vllm_config: VllmConfig, chunk_tokens: int, tp_rank: int) -> ChunkLayout:
    """The same layout on the scheduler and every worker: from the model config."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = mc.dtype if cache_dtype in (None, "auto") else getattr(torch, str(cache_dtype))
    return ChunkLayout(
        model_id=str(mc.model),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        tp_rank=tp_rank,
        chunk_tokens=chunk_tokens,
    )


def _check_forward_binding() -> None:
    """Worker: warn when the forward's OpenMP threads leave the engine core no CPU. Under the
    multiprocess executor (the only one on the CPU build) the worker's parent is the engine
    core, whose CPUs are its affinity."""
    try:
        engine_core_cpus = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone or not ours to read: nothing to compare with
        return
    warning = forward_binding_warning(omp_bound_cpus(os.environ), engine_core_cpus)
    if warning:
        log.warning(warning)


class DpuKVConnector(KVConnectorBase_V1):
    """KV chunks of prompt prefixes in the DPU tier (load before the forward, save after)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._settings = s = ConnectorSettings.from_extra_config(extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        check_chunk_tokens(s.chunk_tokens, self._block_size)  # refuse to start, not mid-step
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self._layout = _layout(vllm_config, s.chunk_tokens, tp_rank)
        self._client = self._new_client()
        # scheduler side
        self._cost = TierCostModel()  # fed by the worker's samples (update_connector_output)
        self._decisions = DpuKVStats()
        self._decisions.reset()  # load/recompute counters since vLLM last took them
        self._lookups = SchedulerLookups(self._client, self._cost, self._layout)
        self._lookups_reported = self._lookups.counts()  # already in the stats
        self._decided: dict[str, tuple[bool, int]] = {}  # req -> (loaded?, matched tokens)
        self._hits: dict[str, int] = {}  # req -> chunks the agent held at the match
        self._leases: dict[str, int] = {}  # allocated req -> lease on the chunks it loads
        self._leases_by_step: deque[tuple[int, list[str]]] = deque()
        self._step = 0
        self._local_tokens: dict[str, int] = {}
        self._pending_loads: dict[str, ReqLoad] = {}
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._layers: list[torch.Tensor] = []
        self._paged: PagedLayout | None = None
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saver: AsyncSaver | None = None
        self._samples = CostSamples()  # timed loads, stores, forwards: to the scheduler
        self._bound_at = 0.0  # when this step's metadata was bound (before its forward)
        self._step_load_s = 0.0  # this step's loads (not part of its forward)
        if role == KVConnectorRole.WORKER:
            self._saver = AsyncSaver(self._new_client(), self._layout, samples=self._samples)
            _check_forward_binding()
        else:  # off the start-up path: a slow or absent agent must not hold the engine's start
            threading.Thread(target=self._probe, name="dpukv-probe", daemon=True).start()

    def _new_client(self) -> KVClient:
        """A client of the tier as configured: the lookups', the saver's, the probe's."""
        s = self._settings
        return KVClient(s.control, s.tenant, s.token, self._layout, s.salt,
                        transport=s.transport, node_deadline_s=s.node_deadline_s,
                        ssl_context=s.tls_context())  # fmt: skip

    def _probe(self) -> None:
        """Scheduler: time one chunk to the tier and back at start, so that the first
        load-or-recompute decision has a measured tier. The workers' measurements reach the
        scheduler only with a step's output, and a step after an idle spell comes after the
        decision it would have informed: a fresh server's first match, and every store that
        ended while it was idle, came too late. Its own client, so a slow tier does not hold
        the lookups; CPU staging, as the scheduler holds no KV."""
        samples = CostSamples()
        t0 = time.monotonic()
        try:
            with self._new_client() as client:
                ok = probe_tier(client, self._layout, samples, torch.device("cpu"))
            self._cost.feed(samples.take())
            took = time.monotonic() - t0
            if not ok:
                self._cost.probe_failed = True  # a second server's first match once loaded
                log.warning("dpukv: the tier did not answer the start-up probe: matches are "
                            "recomputed until a transfer measures it")  # fmt: skip
            elif took > PROBE_LOOKUP_WAIT_S_MAX:
                log.warning("dpukv: the start-up probe took %.1f s: matches were decided "
                            "before it ended, taking the tier for at least that slow",
                            took)  # fmt: skip
        except Exception:  # a measurement: log, never take the engine down
            self._cost.probe_failed = True
            log.exception("dpukv: tier probe failed")
        finally:  # the lookups waiting for it go on, measured or not
            self._lookups.probed.set()

    # --- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        req_id = request.request_id
        self._release(req_id)  # asked again after a preemption: its old load's lease
        self._decided.pop(req_id, None)  # decide anew
        if len(tokens) <= self._layout.chunk_tokens:
            return 0, False
        got = self._lookups.hits(req_id, tokens, num_computed_tokens)
        if got is None:
            return None, False  # the lookup is in flight (its own thread): vLLM asks again
        hits, rtt = got
        n = self._layout.chunk_tokens
        matched = matched_tokens(hits, len(tokens), num_computed_tokens, n)
        if matched and self._lookups.defer_for_probe():
            return None, False  # vLLM asks again next step; the answer and lease are kept
        if matched:
            if rtt:
                self._cost.observe_latency(rtt)
            # whole chunks move: a match that starts inside vLLM's own last block still loads
            # the chunk holding it (update_state_after_alloc's ReqLoad)
            chunks = (num_computed_tokens + matched) // n - num_computed_tokens // n
            load = self._cost.worth_loading(matched, chunks * self._layout.chunk_bytes)
            self._decided[req_id] = (load, matched)  # counted once allocated
            if not load:
                matched = 0  # a slow or loaded tier: recomputing is faster, never worse
        self._hits[req_id] = hits
        self._local_tokens[req_id] = num_computed_tokens  # vLLM's own prefix hit
        return matched, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        decided = self._decided.pop(req_id, None)
        if decided is not None:  # vLLM asks again while it has no blocks: one decision
            load, tokens = decided
            counts = self._decisions.data
            counts["load_decisions" if load else "recompute_decisions"] += 1
            counts["loaded_tokens" if load else "recomputed_tokens"] += tokens
        lease_id = self._lookups.take(req_id)
        if num_external_tokens <= 0:
            self._lookups.release(lease_id)
            self._release(req_id)
            return
        if lease_id:
            self._leases[req_id] = lease_id  # released LEASE_STEPS_MAX steps after the load
        n = self._layout.chunk_tokens
        computed = self._local_tokens.pop(req_id, 0)
        self._pending_loads[req_id] = ReqLoad(
            req_id=req_id,
            token_ids=tuple(request.prompt_token_ids or ()),
            block_ids=tuple(blocks.get_block_ids()[0]),
            first_chunk=computed // n,
            chunk_count=(computed + num_external_tokens) // n - computed // n,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = DpuKVConnectorMetadata(
            step_tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        )
        self._step += 1
        self._lookups.new_step()
        self._expire_leases()
        loaded: list[str] = []
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(
                    ReqLoad(
                        req_id=load.req_id,
                        token_ids=load.token_ids,
                        block_ids=tuple(new.block_ids[0]),
                        first_chunk=load.first_chunk,
                        chunk_count=load.chunk_count,
                    )
                )
                loaded.append(new.req_id)
            tokens = tuple(new.prompt_token_ids or ())
            hits = self._hits.pop(new.req_id, 0)
            self._tracked[new.req_id] = _Tracked(tokens, list(new.block_ids[0]), hits)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._add_store(meta, new.req_id, done)
        if loaded:
            self._leases_by_step.append((self._step, loaded))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._tracked:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                self._tracked[req_id].block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._add_store(meta, req_id, done)
        return meta

    def _add_store(self, meta: DpuKVConnectorMetadata, req_id: str, done: int) -> None:
        t = self._tracked[req_id]
        count = storable_chunks(done, len(t.tokens), self._layout.chunk_tokens)
        if count > t.stored:
            meta.stores.append(
                ReqStore(
                    req_id=req_id,
                    token_ids=t.tokens,
                    block_ids=tuple(t.block_ids),
                    chunk_count=count,
                    first_chunk=t.stored,
                )
            )
            t.stored = count
        if done >= len(t.tokens):
            del self._tracked[req_id]  # prompt fully computed: its chunks are stored this step

    def _expire_leases(self) -> None:
        """Release the leases of loads that ran at least LEASE_STEPS_MAX steps ago."""
        while self._leases_by_step and self._leases_by_step[0][0] <= self._step - LEASE_STEPS_MAX:
            for req_id in self._leases_by_step.popleft()[1]:
                self._release(req_id)

    def _release(self, req_id: str) -> None:
        lease_id = self._leases.pop(req_id, 0)
        if lease_id:
            self._lookups.release(lease_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' timed loads, stores and forwards of the last step, into the model."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        if isinstance(stats, KVConnectorStats) and self._cost.feed(stats.data.get("samples", ())):
            self._decisions.data.update(self._cost.snapshot())  # reported with the next stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler: its decisions since the last call; worker: its samples since then."""
        if self._role == KVConnectorRole.SCHEDULER:
            done = self._lookups.counts()
            before, self._lookups_reported = self._lookups_reported, done
            for name, count in done.items():
                self._decisions.data[name] += count - before[name]
            stats, self._decisions = self._decisions, DpuKVStats()
            self._decisions.reset()
            return None if stats.is_empty() else stats
        samples = self._samples.take()
        return DpuKVStats(data=merge_stats({"samples": samples}, {})) if samples else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        stats = DpuKVStats()
        stats.data = merge_stats(data or {}, {})
        return stats

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return DpuKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._release(req_id)
        self._lookups.forget(req_id)
        for state in (self._tracked, self._pending_loads, self._local_tokens, self._hits,
                      self._decided):  # fmt: skip
            state.pop(req_id, None)
        return False, None

    # --- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())  # insertion order is layer order
        lo = self._layout
        if len(layers) != lo.num_layers:
            raise ValueError(
                f"vLLM registered {len(layers)} KV layers; the model config says {lo.num_layers}"
            )
        kind = self._settings.paged_kind
        if kind == "auto":
            from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

            names = [b.get_name() for b in get_current_attn_backends(self._vllm_config)]
            kind = paged_kind_for(names, tuple(layers[0].shape))
        paged = PagedLayout(kind=kind, block_size=self._block_size)  # type: ignore[arg-type]
        for layer in layers:
            paged.check(layer, lo.num_kv_heads, lo.head_dim)
        self._layers, self._paged = layers, paged
        log.info("dpukv: %d KV layers of %s, layout %r", len(layers), list(layers[0].shape), kind)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bound before each step's loads and forward: the forward's time starts here."""
        super().bind_connector_metadata(connector_metadata)
        self._bound_at, self._step_load_s = time.perf_counter(), 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DpuKVConnectorMetadata)
        assert self._paged is not None, "start_load_kv before register_kv_caches"
        for load in meta.loads:
            t0 = time.perf_counter()
            loaded = load_request(self._client, self._layers, self._paged, self._layout, load)
            took = time.perf_counter() - t0
            self._step_load_s += took
            if loaded:
                self._samples.add("load", loaded * self._layout.chunk_bytes, took)
            if loaded < load.chunk_count:
                bs, n = self._paged.block_size, self._layout.chunk_tokens
                self._failed_blocks |= failed_block_ids(load, loaded, n, bs)
                self._failed_reqs.add(load.req_id)
                log.warning(
                    "dpukv: request %s: loaded %d of %d chunks; vLLM recomputes the rest",
                    load.req_id,
                    loaded,
                    load.chunk_count,
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer (a chunk spans all layers)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved whole in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        """Copies this step's computed chunks out of the blocks and queues their puts: the
        blocks are free to reuse when this returns, and the request waits for the copy only,
        never for the agent (AsyncSaver)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, DpuKVConnectorMetadata)
        # the forward ran since the metadata was bound; the step's loads are not compute
        forward_s = time.perf_counter() - self._bound_at - self._step_load_s
        if meta.step_tokens >= PREFILL_TOKENS_MIN:
            self._samples.add("prefill", meta.step_tokens, forward_s)
        assert self._paged is not None or not meta.stores, "wait_for_save before register"
        for store in meta.stores:
            if store.req_id in self._failed_reqs:
                continue  # computed over blocks that were not loaded: recomputed, not stored
            assert self._paged is not None and self._saver is not None
            self._saver.save(self._layers, self._paged, store)
        self._failed_reqs.clear()

    def shutdown(self) -> None:
        self._lookups.close()
        if self._saver is not None:
            self._saver.close()
        self._client.close()
