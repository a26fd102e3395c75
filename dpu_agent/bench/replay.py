"""`dpuctl bench replay`: hit rate of the eviction policies on a prefix-cache request trace.

Trace format (Mooncake's, docs/EVICTION.md): JSON lines with `timestamp` (ms) and `hash_ids`
(prefix block ids, parent first). Per request the longest cached prefix is looked up first (a
block hits only if it and every block before it are cached); then every block of the request is
accessed or inserted with parent = the previous block, evicting as needed. A put never evicts
the block it extends (the engine's rule: `Placement.place`, `keep`); a request longer than the
whole cache evicts its own older blocks. This is the fast path of `replay_engine`
(`bench/replay_engine.py`), which drives the real Engine: the tests prove the two give the same
hits on every policy.

`opt` is Belady's MIN with bypass over the block next-use sequence, ties evicting the deeper
block. Because every request that uses a block uses its whole prefix, a parent's next use is
never later than its child's, so the cached set stays prefix-closed: every block it holds at a
request is a prefix hit. It therefore maximises the cached-at-access count, which bounds every
online policy's prefix hits from above; the report checks that it did, and the tests check it
against an exhaustive search on small traces. `a0` (cache the most used blocks of the whole
trace) is the second reference: the best online policy if references were independent.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import operator
import random
import time
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click

from dpu_agent.eviction import DEFAULT_POLICY, POLICY_NAMES, EvictionPolicy, make_policy

__all__ = [
    "BLOCK_BYTES_DEFAULT",
    "DEFAULT_FRACTIONS",
    "SYNTHETIC_SHAPES",
    "Request",
    "generate_trace",
    "load_trace",
    "replay",
    "replay_belady",
    "replay_hits",
    "replay_policy",
    "replay_popularity_oracle",
    "replay_request",
    "write_trace",
]

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.10)
TRACE_LINE_BYTES_MAX = 10_000_000  # one request line; 374 blocks is ~3 kB, a 1M-token one ~20 kB
TRACE_REQUESTS_MAX = 10_000_000  # keeps a mistaken input from eating the box
# two-tier load time: Mooncake's blocks are 512 tokens, Llama-3-8B's KV is 128 KiB per token
BLOCK_BYTES_DEFAULT = 512 * 128 * 1024
INF = math.inf


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: float
    hash_ids: tuple[int, ...]


def load_trace(path: Path) -> list[Request]:
    """Parse a JSON-lines trace; a malformed line raises ValueError naming the line."""
    trace: list[Request] = []
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if len(line) > TRACE_LINE_BYTES_MAX:
                raise ValueError(f"{path}:{line_no}: line longer than {TRACE_LINE_BYTES_MAX} B")
            if not line.strip():
                continue
            if len(trace) >= TRACE_REQUESTS_MAX:
                raise ValueError(f"{path}: more than {TRACE_REQUESTS_MAX} requests")
            trace.append(_parse_line(path, line_no, line))
    if not trace:
        raise ValueError(f"{path}: no requests in trace")
    return trace


def _parse_line(path: Path, line_no: int, line: bytes) -> Request:
    try:
        obj = json.loads(line)
        ts, ids = obj["timestamp"], obj["hash_ids"]
    except (ValueError, KeyError, TypeError) as e:
        msg = f"{path}:{line_no}: not a trace record ({e}); need timestamp, hash_ids"
        raise ValueError(msg) from e
    if not isinstance(ts, int | float) or not isinstance(ids, list):
        raise ValueError(f"{path}:{line_no}: timestamp must be a number, hash_ids a list")
    if not all(isinstance(i, int) for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{path}:{line_no}: hash_ids must be distinct integers")
    return Request(float(ts), tuple(ids))


def write_trace(path: Path, trace: Iterable[Request]) -> None:
    with path.open("w") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "hash_ids": list(r.hash_ids)}))
            f.write("\n")


def distinct_blocks(trace: Sequence[Request]) -> int:
    return len({b for r in trace for b in r.hash_ids})


def _prefix_hits(ids: tuple[int, ...], cached: Container[int]) -> int:
    count = 0
    for b in ids:
        if b not in cached:
            break
        count += 1
    return count


def replay_request(policy: EvictionPolicy, req: Request, capacity: int) -> int:
    """One request of a replay: its prefix hits, then its blocks accessed or inserted
    (`now` = timestamp in seconds; a request larger than the cache stores what fits)."""
    ids = req.hash_ids
    hits = _prefix_hits(ids, policy)
    now = req.timestamp_ms / 1000.0
    parent: int | None = None
    for b in ids:
        if b in policy:
            policy.access(b, now)
        else:
            if len(policy) >= capacity:
                victim = policy.victim(partial(operator.ne, parent))
                if victim is None:
                    break  # the request is larger than the cache: store what fits
                policy.remove(victim)
            policy.insert(b, parent, now)
        parent = b
    assert len(policy) <= capacity, (len(policy), capacity)
    return hits


def replay_hits(trace: Sequence[Request], policy: EvictionPolicy, capacity: int) -> list[int]:
    """Each request's prefix hits, replaying `trace` through `policy` at `capacity` blocks."""
    return [replay_request(policy, req, capacity) for req in trace]


def replay_policy(trace: Sequence[Request], policy_name: str, capacity: int) -> int:
    """Prefix hits of one online policy at `capacity` blocks."""
    return sum(replay_hits(trace, make_policy(policy_name, capacity), capacity))


def _next_uses(trace: Sequence[Request]) -> list[list[float]]:
    """For each request and position, the index of the next request using that block."""
    last: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace]
    for r in range(len(trace) - 1, -1, -1):
        ids = trace[r].hash_ids
        out[r] = [last.get(b, INF) for b in ids]
        for b in ids:
            last[b] = r
    return out


def replay_belady(trace: Sequence[Request], capacity: int) -> int:
    """Prefix hits of Belady's MIN with bypass (see the module docstring)."""
    assert capacity > 0, capacity
    next_uses = _next_uses(trace)
    cached: dict[int, tuple[float, int]] = {}  # block -> (next use, depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, block); lazy deletion
    hits = 0
    for r, req in enumerate(trace):
        hits += _prefix_hits(req.hash_ids, cached)
        for depth, (b, nxt) in enumerate(zip(req.hash_ids, next_uses[r], strict=True)):
            key = (nxt, depth)
            if b not in cached and len(cached) >= capacity:
                while cached.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)
                far = (-heap[0][0], -heap[0][1])
                if far <= key:
                    continue  # bypass: the new block is needed later than everything cached
                del cached[heapq.heappop(heap)[2]]
            cached[b] = key
            heapq.heappush(heap, (-nxt, -depth, b))
            if len(heap) > 4 * len(cached) + 64:
                heap = [(-k[0], -k[1], i) for i, k in cached.items()]
                heapq.heapify(heap)
    return hits


def replay_popularity_oracle(trace: Sequence[Request], capacity: int) -> int:
    """Prefix hits of A0: cache the `capacity` blocks used most often over the whole trace.

    Under the independent reference model A0 is the best online policy, so this shows how much
    of Belady's lead comes from knowing *when* blocks return rather than *how often*. Offline
    (it reads the whole trace first); a block hits from its second use on. Counts are
    prefix-monotone (a parent is used whenever its child is), ties go to the shallower block.
    """
    assert capacity > 0, capacity
    counts: dict[int, int] = {}
    depths: dict[int, int] = {}
    for req in trace:
        for depth, b in enumerate(req.hash_ids):
            counts[b] = counts.get(b, 0) + 1
            depths[b] = depth
    keep = set(heapq.nsmallest(capacity, counts, key=lambda b: (-counts[b], depths[b])))
    seen: set[int] = set()
    hits = 0
    for req in trace:
        hits += _prefix_hits(req.hash_ids, _Both(keep, seen))
        seen.update(req.hash_ids)
    return hits


class _Both:
    """Membership in two sets at once, for _prefix_hits."""

    def __init__(self, a: set[int], b: set[int]) -> None:
        self.a, self.b = a, b

    def __contains__(self, item: object) -> bool:
        return item in self.a and item in self.b


# --- synthetic traces -------------------------------------------------------------------------

SYNTHETIC_SHAPES = ("chat", "docs", "agent", "mix", "conv", "scan", "tenants")
TENANT_SHAPES = ("chat", "docs", "agent", "conv", "scan")  # `tenants`: one client of each
TENANT_ID_SHIFT = 40  # tenant t's ids are t << 40 plus its own: a shape makes far fewer
SYNTHETIC_REQUESTS_MAX = 1_000_000


class _TraceBuilder:
    """Block ids from a trie, so equal prefixes get equal ids and every id has one parent."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._ids: dict[tuple[int, object], int] = {}
        self._cum_weights: dict[tuple[int, float], list[float]] = {}
        self.now_ms = 0.0
        self.tag = 0  # a new tag starts a new namespace of segments (the mix's second half)

    def extend(self, prefix: list[int], segment: object, blocks: int) -> list[int]:
        out = list(prefix)
        for i in range(blocks):
            parent = out[-1] if out else -1
            key = (parent, (segment, i) if not self.tag else (self.tag, segment, i))
            out.append(self._ids.setdefault(key, len(self._ids)))
        return out

    def zipf(self, n: int, s: float) -> int:
        """Index in 0..n-1 with probability proportional to 1/(i+1)^s."""
        cum = self._cum_weights.get((n, s))
        if cum is None:
            cum = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))
            self._cum_weights[(n, s)] = cum
        return min(n - 1, bisect.bisect_left(cum, self.rng.random() * cum[-1]))

    def request(self, ids: list[int], rate_per_s: float) -> Request:
        self.now_ms += self.rng.expovariate(rate_per_s) * 1000.0
        return Request(round(self.now_ms, 3), tuple(ids))


def generate_trace(shape: str, requests: int, seed: int = 0) -> list[Request]:
    """A seeded synthetic trace.

    chat: multi-turn conversations (each prompt extends the previous turn) over Zipf-popular
    system prompts, plus 15% one-off long documents. docs: questions over Zipf-popular shared
    documents behind a few system prompts, plus 30% one-off documents. agent: few long agent
    sessions that grow by many short steps, little sharing between sessions. mix: the shape
    changes halfway: `docs` for the first half of the requests, then `chat` over new prompts.
    conv: conversation-like: 45% one-off questions with a long unique context, conversations
    whose first turn is as long and which come back after long gaps (up to 400 open at once),
    all behind a Zipf-skewed set of 300 shared prefixes: most blocks are used once, and which
    policy is best changes as the open conversations pile up. scan: Zipf-popular documents,
    interrupted by scans (runs of 20-120 requests over new documents). tenants: one tenant of
    each of chat, docs, agent, conv and scan (a fifth of the requests each, ids disjoint)
    sharing one tier, their requests interleaved by timestamp.
    """
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; valid: {', '.join(SYNTHETIC_SHAPES)}")
    if not 0 < requests <= SYNTHETIC_REQUESTS_MAX:
        raise ValueError(f"requests must be in 1..{SYNTHETIC_REQUESTS_MAX}, got {requests}")
    if shape == "tenants":
        return _gen_tenants(requests, seed)
    tb = _TraceBuilder(seed)
    if shape == "chat":
        return _gen_chat(tb, requests)
    if shape == "agent":
        return _gen_sessions(tb, requests, systems=4, one_off=0.02, turns_mean=40, grow=(1, 2))
    if shape == "conv":
        return _gen_conv(tb, requests)
    if shape == "scan":
        return _gen_scan(tb, requests)
    if shape == "mix":
        first = _gen_docs(tb, requests // 2)
        tb.tag = 1
        return first + _gen_chat(tb, requests - requests // 2)
    return _gen_docs(tb, requests)


def _gen_tenants(requests: int, seed: int) -> list[Request]:
    merged: list[Request] = []
    for t, shape in enumerate(TENANT_SHAPES):
        share = requests // len(TENANT_SHAPES) + (t < requests % len(TENANT_SHAPES))
        if not share:
            continue
        offset = (t + 1) << TENANT_ID_SHIFT
        for r in generate_trace(shape, share, seed * len(TENANT_SHAPES) + t):
            merged.append(Request(r.timestamp_ms, tuple(offset + b for b in r.hash_ids)))
    merged.sort(key=lambda r: r.timestamp_ms)  # stable: a tenant's own order is kept
    return merged


def _gen_chat(tb: _TraceBuilder, requests: int) -> list[Request]:
    return _gen_sessions(tb, requests, systems=30, one_off=0.15, turns_mean=6, grow=(1, 4))


def _gen_sessions(
    tb: _TraceBuilder,
    requests: int,
    *,
    systems: int,
    one_off: float,
    turns_mean: int,
    grow: tuple[int, int],
) -> list[Request]:
    rng = tb.rng
    system_lens = [rng.randint(2, 16) for _ in range(systems)]
    active: list[tuple[list[int], int]] = []  # (prompt so far, turns left)
    out: list[Request] = []
    for n in range(requests):
        if rng.random() < one_off:
            sys_i = tb.zipf(systems, 1.0)
            base = tb.extend([], ("sys", sys_i), system_lens[sys_i])
            out.append(tb.request(tb.extend(base, ("doc", n), rng.randint(20, 120)), 4.0))
            continue
        if not active or (len(active) < 64 and rng.random() < 1.0 / turns_mean):
            sys_i = tb.zipf(systems, 1.0)
            base = tb.extend([], ("sys", sys_i), system_lens[sys_i])
            active.append((base, max(1, int(rng.expovariate(1.0 / turns_mean)))))
        k = rng.randrange(len(active))
        prompt, left = active[k]
        prompt = tb.extend(prompt, ("turn", n), rng.randint(*grow))
        out.append(tb.request(prompt, 4.0))
        if left <= 1:
            active.pop(k)
        else:
            active[k] = (prompt, left - 1)
    return out


CONV_ACTIVE_MAX = 400  # conversations open at once in `conv`: long think times interleave many


def _gen_conv(tb: _TraceBuilder, requests: int) -> list[Request]:
    """Conversation-like: most blocks are used once, a frequency-skewed set is reused."""
    rng = tb.rng
    shared = 300
    shared_lens = [rng.randint(2, 12) for _ in range(shared)]
    active: list[tuple[list[int], int]] = []  # (prompt so far, turns left)
    out: list[Request] = []
    for n in range(requests):
        s = tb.zipf(shared, 1.1)
        base = tb.extend([], ("shared", s), shared_lens[s])
        if rng.random() < 0.45:  # a one-off question with a long unique context
            out.append(tb.request(tb.extend(base, ("oneoff", n), rng.randint(10, 40)), 2.0))
            continue
        if not active or (len(active) < CONV_ACTIVE_MAX and rng.random() < 0.3):
            ids = tb.extend(base, ("first", n), rng.randint(10, 40))
            active.append((ids, max(1, int(rng.expovariate(1.0 / 3)))))
            out.append(tb.request(ids, 2.0))
            continue
        k = rng.randrange(len(active))
        prompt, left = active[k]
        prompt = tb.extend(prompt, ("turn", n), rng.randint(1, 4))
        out.append(tb.request(prompt, 2.0))
        if left <= 1:
            active[k] = active[-1]
            active.pop()
        else:
            active[k] = (prompt, left - 1)
    return out


def _gen_scan(tb: _TraceBuilder, requests: int) -> list[Request]:
    """A frequency-skewed reusable set of documents, interrupted by scans of new documents."""
    rng = tb.rng
    doc_lens = [rng.randint(4, 30) for _ in range(600)]
    out: list[Request] = []
    scan_left = 0
    for n in range(requests):
        base = tb.extend([], ("sys", tb.zipf(8, 1.0)), 2)
        if scan_left == 0 and rng.random() < 0.02:
            scan_left = rng.randint(20, 120)
        if scan_left:
            scan_left -= 1
            ids = tb.extend(base, ("scan", n), rng.randint(10, 60))
        else:
            d = tb.zipf(len(doc_lens), 0.8)
            ids = tb.extend(base, ("doc", d), doc_lens[d])
        out.append(tb.request(tb.extend(ids, ("q", n), 1), 4.0))
    return out


def _gen_docs(tb: _TraceBuilder, requests: int) -> list[Request]:
    rng = tb.rng
    doc_lens = [rng.randint(10, 80) for _ in range(400)]
    out: list[Request] = []
    for n in range(requests):
        base = tb.extend([], ("sys", tb.zipf(3, 1.0)), 4)
        if rng.random() < 0.3:
            ids = tb.extend(base, ("oneoff", n), rng.randint(10, 80))
        else:
            d = tb.zipf(len(doc_lens), 0.9)
            ids = tb.extend(base, ("doc", d), doc_lens[d])
        out.append(tb.request(tb.extend(ids, ("q", n), rng.randint(1, 2)), 4.0))
    return out


# --- the report -------------------------------------------------------------------------------


def _gap_closed(hit: float, lru: float, opt: float) -> float | None:
    """(hit - lru) / (opt - lru); None when LRU is already optimal (no gap to close)."""
    if opt - lru <= 1e-12:
        return None
    return (hit - lru) / (opt - lru)


def replay(
    trace: Sequence[Request],
    fractions: Sequence[float],
    policy: str = DEFAULT_POLICY,
    policies: Sequence[str] = POLICY_NAMES,
    *,
    engine: bool = True,
    data_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """One result row per capacity fraction, hit rates as fractions of all block accesses,
    every policy replayed through the real Engine (`engine=False`: its fast path, the
    simulator, which gives the same hits)."""
    from dpu_agent.bench.replay_engine import policy_hits

    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown eviction policy {policy!r}; valid: {', '.join(POLICY_NAMES)}")
    accesses = sum(len(r.hash_ids) for r in trace)
    distinct = distinct_blocks(trace)
    names = list(dict.fromkeys([policy, "lru", *policies]))
    rows = []
    for f in fractions:
        if not 0.0 < f <= 1.0:
            raise ValueError(f"capacity fraction must be in (0, 1], got {f}")
        capacity = max(1, round(f * distinct))
        started = time.monotonic()
        rates, by_tier = {}, {}
        for n in names:
            per_request, by_tier[n] = policy_hits(
                [trace], n, capacity, engine=engine, data_dir=data_dir
            )
            rates[n] = sum(per_request) / accesses
        opt = replay_belady(trace, capacity) / accesses
        a0 = replay_popularity_oracle(trace, capacity) / accesses
        hit, lru = rates[policy], rates["lru"]
        rows.append(
            {
                "capacity_fraction": f,
                "capacity_blocks": capacity,
                "replayed_through": "engine" if engine else "simulator",
                "hit_rate": hit,
                "lru_hit_rate": lru,
                "opt_hit_rate": opt,
                "gap_closed": _gap_closed(hit, lru, opt),
                "opt_is_upper_bound": all(r <= opt + 1e-12 for r in (*rates.values(), a0)),
                "a0_hit_rate": a0,
                "policies": rates,
                "hits_by_tier": by_tier,
                "elapsed_s": round(time.monotonic() - started, 3),
            }
        )
    return rows


def plot_report(report: dict[str, Any], out: Path) -> None:
    """Hit rate against capacity fraction, one line per policy plus Belady and A0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    xs = [r["capacity_fraction"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in rows[0]["policies"]:
        style = "-o" if name == report["policy"] else "--."
        ax.plot(xs, [r["policies"][name] * 100 for r in rows], style, label=name)
    ax.plot(xs, [r["opt_hit_rate"] * 100 for r in rows], "k-s", label="belady (offline)")
    ax.plot(xs, [r["a0_hit_rate"] * 100 for r in rows], "k:^", label="A0 popularity (offline)")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}%" for x in xs])
    ax.set_xlabel("cache capacity (% of distinct blocks)")
    ax.set_ylabel("prefix block hit rate (%)")
    ax.set_title(f"trace replay: {Path(report['trace']).name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _format_table(report: dict[str, Any]) -> str:
    rows = report["results"]
    names = list(rows[0]["policies"])
    head = ["capacity", *names, "A0 oracle", "belady", "gap closed"]
    lines = [" | ".join(head)]
    for r in rows:
        gap = "n/a" if r["gap_closed"] is None else f"{r['gap_closed'] * 100:.0f}%"
        cells = [f"{r['capacity_fraction'] * 100:g}% ({r['capacity_blocks']})"]
        cells += [f"{r['policies'][n] * 100:.2f}%" for n in names]
        cells += [f"{r['a0_hit_rate'] * 100:.2f}%", f"{r['opt_hit_rate'] * 100:.2f}%", gap]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


@click.command("replay")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON-lines trace (timestamp ms, hash_ids), as in docs/EVICTION.md. With --family: "
    "a real trace added to the report set.",
)
@click.option(
    "--synthetic",
    type=click.Choice(SYNTHETIC_SHAPES),
    help="Replay a generated trace of this shape instead of --trace.",
)
@click.option("--requests", default=4000, show_default=True, help="Requests of --synthetic.")
@click.option("--seed", default=0, show_default=True, help="Seed of --synthetic.")
@click.option(
    "--capacity-fraction",
    "fractions",
    type=float,
    multiple=True,
    help="Cache size as a fraction of distinct blocks (repeatable). "
    f"Default: {' '.join(map(str, DEFAULT_FRACTIONS))}.",
)
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default=DEFAULT_POLICY,
    show_default=True,
    help="The policy whose hit_rate and gap_closed are reported.",
)
@click.option("--all", "all_policies", is_flag=True, help="Also replay every other policy.")
@click.option(
    "--family",
    is_flag=True,
    help="Replay the trace family (choose, report and held-out sets, or --family-set; plus "
    "--trace if given) through the engine: per cell the best fixed policy, the --policy's gap "
    "to it and to LRU, prefix-run and LRU, and whether the trace decides the cell (z), as a "
    "Markdown table.",
)
@click.option(
    "--family-set",
    "family_sets",
    type=click.Choice(["choose", "report", "held-out", "none"]),
    multiple=True,
    help="With --family: only these sets (repeatable; default: all three; none: only the "
    "--trace file).",
)
@click.option(
    "--head",
    type=click.IntRange(1),
    default=None,
    help="Replay only the first N requests of --trace (a bounded run; the report says so).",
)
@click.option(
    "--jobs",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Worker processes for --family.",
)
@click.option(
    "--dram-fraction",
    type=float,
    help="Two tiers: DRAM size as a fraction of distinct blocks (with --nvme-fraction): hits "
    "per tier through the engine and expected load time per request, against NVMe alone.",
)
@click.option("--nvme-fraction", type=float, help="Two tiers: NVMe size, as --dram-fraction.")
@click.option(
    "--block-bytes",
    type=click.IntRange(1),
    default=BLOCK_BYTES_DEFAULT,
    show_default=True,
    help="Bytes per block for the two-tier load time (default: 512 tokens of Llama-3-8B bf16).",
)
@click.option(
    "--simulator",
    is_flag=True,
    help="Replay through the standalone simulator instead of the real Engine: the fast path, "
    "which gives the engine's hits on every policy (tests/test_replay_engine.py), one tier.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the engine replay keeps its tiers (default: a temporary directory; /dev/shm "
    "puts them on tmpfs).",
)
@click.option(
    "--cost",
    is_flag=True,
    help="Cost of each policy instead of hit rates: CPU per put and per lookup hit in the "
    "engine, per block access in the replay, and memory per item held.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG of hit rate against capacity for every policy and Belady.",
)
def replay_command(
    trace_path: Path | None,
    synthetic: str | None,
    requests: int,
    seed: int,
    fractions: tuple[float, ...],
    policy: str,
    all_policies: bool,
    family: bool,
    family_sets: tuple[str, ...],
    head: int | None,
    jobs: int,
    dram_fraction: float | None,
    nvme_fraction: float | None,
    block_bytes: int,
    simulator: bool,
    data_dir: Path | None,
    cost: bool,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Replay a prefix-cache trace: hit rate of a policy against LRU and Belady's optimum."""
    if cost:
        from dpu_agent.bench.replay_cost import cost_command

        cost_command(policy, all_policies, as_json)
        return
    if family:
        if dram_fraction is not None or nvme_fraction is not None:
            raise click.UsageError("--family replays one tier; drop --dram/--nvme-fraction")
        _family_command(
            trace_path,
            synthetic,
            fractions,
            policy,
            jobs,
            as_json,
            not simulator,
            family_sets,
            head,
            data_dir,
        )
        return
    if (trace_path is None) == (synthetic is None):
        raise click.UsageError("give exactly one of --trace FILE or --synthetic SHAPE")
    if (dram_fraction is None) != (nvme_fraction is None):
        raise click.UsageError("give both --dram-fraction and --nvme-fraction, or neither")
    try:
        if trace_path is not None:
            trace, name = load_trace(trace_path), str(trace_path)
            if head is not None:
                trace, name = trace[:head], f"{trace_path} (first {head} requests)"
        else:
            assert synthetic is not None
            trace = generate_trace(synthetic, requests, seed)
            name = f"synthetic:{synthetic}:requests={requests}:seed={seed}"
        if dram_fraction is not None and nvme_fraction is not None:
            from dpu_agent.bench.replay_tiers import format_two_tiers, two_tier_report

            tiers = two_tier_report(
                trace, policy, dram_fraction, nvme_fraction, block_bytes=block_bytes,
                data_dir=data_dir,
            )  # fmt: skip
            tiers["trace"] = name
            click.echo(json.dumps(tiers, indent=2) if as_json else format_two_tiers(tiers))
            return
        names = POLICY_NAMES if (all_policies or plot) else (policy,)
        rows = replay(
            trace,
            fractions or DEFAULT_FRACTIONS,
            policy,
            names,
            engine=not simulator,
            data_dir=data_dir,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    report = {"trace": name, "policy": policy, "results": rows}
    if plot is not None:
        plot_report(report, plot)
    click.echo(json.dumps(report, indent=2) if as_json else _format_table(report))


def _family_command(
    trace_path: Path | None,
    synthetic: str | None,
    fractions: tuple[float, ...],
    policy: str,
    jobs: int,
    as_json: bool,
    engine: bool,
    family_sets: tuple[str, ...],
    head: int | None,
    data_dir: Path | None,
) -> None:
    from dpu_agent.bench.replay_family import (
        CHOOSE_SET,
        HELD_OUT_SET,
        REPORT_SET,
        FamilyTrace,
        format_family,
        policy_memory_bytes,
        run_family,
    )

    if synthetic is not None:
        raise click.UsageError("--family replays its own synthetic traces; drop --synthetic")
    sets = {"choose": CHOOSE_SET, "report": REPORT_SET, "held-out": HELD_OUT_SET, "none": ()}
    traces = [t for name in family_sets or tuple(sets) for t in sets[name]]
    if trace_path is not None:
        traces.append(FamilyTrace(role="report", path=trace_path, requests=head or 0))
    try:
        for f in fractions:
            if not 0.0 < f <= 1.0:
                raise ValueError(f"capacity fraction must be in (0, 1], got {f}")
        rows = run_family(
            traces, fractions or DEFAULT_FRACTIONS, policy, jobs, engine=engine, data_dir=data_dir
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    memory = {n: policy_memory_bytes(n) for n in rows[0]["policies"]}
    if as_json:
        click.echo(json.dumps({"cells": rows, "memory_bytes_per_item": memory}, indent=2))
    else:
        click.echo(format_family(rows, memory))
