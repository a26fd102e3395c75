"""A trace replayed through the real `Engine`: its index, its tiers (DRAM in memory, the NVMe
tier a file, on tmpfs when the caller points `data_dir` there), its placement and its eviction
policies, so the hit rates are the engine's own, not a model's.

Each trace block is a one-block chunk whose key is the block id. A request looks up its blocks
(the engine's longest-prefix lookup: the hits counted), then, block by block after the first
miss, uses a present block (a one-key lookup, as a hit would) or puts a missing one with the
previous block as its parent. The DRAM tier holds one block, too small for any chunk to be
placed there (a chunk above 1/8 of DRAM goes to NVMe), so the NVMe tier, `capacity` blocks,
and its policy decide: the same single cache the standalone
simulator (`replay.replay_request`) models, with the engine's rule that a put never evicts the
chunk it extends. The simulator is this replay's fast path: tests/test_replay_engine.py proves
the two give the same hits on every policy.

With `dram_blocks` the DRAM tier holds that many blocks and both tiers count: the engine
places each put (DRAM while it has room, else NVMe), its tick demotes DRAM's victims to NVMe
(keeping `dram_free_fraction` of DRAM free) and promotes NVMe chunks read twice within
PROMOTE_REREAD_S; the replay ticks the engine every TICK_S of the trace's time, as the agent
does (`[agent] tick_interval_s`). There is no fast path for two tiers: the engine is the model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpu_agent.bench.replay import Request, replay_hits
from dpu_agent.config import AgentSection
from dpu_agent.engine import Engine, EngineConfig
from dpu_agent.engine._restart_order import POLICY_ORDER
from dpu_agent.engine.engine import CLEAN_STOP
from dpu_agent.engine.errors import TierFull
from dpu_agent.eviction import EvictionPolicy, make_policy

__all__ = ["EngineReplay", "policy_hits", "replay_engine", "restarted_hits"]

BS = 4096
CHUNK_BYTES = BS - 64  # one block each (the engine adds no header to the block count)
TENANT = "replay"
TICK_S = AgentSection().tick_interval_s  # the agent's tick: demotion and promotion run in it


class _TraceClock:
    """The engine's clock, in seconds, moved by the replay to each request's timestamp."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True, slots=True)
class EngineReplay:
    hits: int  # prefix hits over the trace
    accesses: int  # blocks requested
    hits_by_tier: dict[str, int]  # of `hits`, per tier that served them
    per_request: list[int]  # prefix hits of each request, in trace order
    # what a restart of this engine would begin from (Engine.policy_state, at the end)
    policy_state: dict[str, Any] = field(default_factory=dict)
    promotions: int = 0  # NVMe -> DRAM moves (two tiers)
    demotions: int = 0  # DRAM -> NVMe moves (two tiers)


def _key(block: int) -> bytes:
    return block.to_bytes(16, "little")


def replay_engine(
    trace: Sequence[Request],
    policy: str,
    capacity: int,
    *,
    data_dir: Path | None = None,
    policy_state: Mapping[str, Any] | None = None,
    dram_blocks: int = 0,
    reopen_at: int | None = None,
    crash: bool = False,
) -> EngineReplay:
    """Prefix hits of `trace` replayed through a real Engine whose NVMe tier holds `capacity`
    one-block chunks and runs `policy`; with `dram_blocks`, a DRAM tier of that many blocks
    in front of it (0: one block, which holds no chunk). `policy_state`: an earlier run's
    `policy_state`, which this engine begins from (a restart whose tiers came back empty).
    `reopen_at`: before that request the engine is closed and a new one opened on the same
    directory, as the agent restarts: recovery brings the chunks back (the NVMe tier's; DRAM's
    are demoted at close), the policy begins from the state file its predecessor wrote.
    `crash`: that stop is a crash's: the replay ticks the engine every TICK_S (its tick saves
    the eviction order every `policy_order_save_s` of trace time), and the next start finds
    what a kill -9 leaves: the order file of the last save, no clean-stop marker (the engine
    is closed, which checkpoints but recovers the same records the WAL would; one tier only,
    since a crash would lose what DRAM held)."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least one block, got {capacity}")
    if dram_blocks < 0:
        raise ValueError(f"dram_blocks must be 0 or more, got {dram_blocks}")
    if reopen_at is not None and not 0 <= reopen_at <= len(trace):
        raise ValueError(f"reopen_at must be in 0..{len(trace)}, got {reopen_at}")
    if crash and (reopen_at is None or dram_blocks):
        raise ValueError("crash needs reopen_at, and one tier (dram_blocks 0)")
    clock = _TraceClock()
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        cfg = EngineConfig(
            data_dir=Path(tmp),
            dram_bytes=max(1, dram_blocks) * BS,
            nvme_bytes=capacity * BS,
            eviction_policy=policy,
            tenants={TENANT: 0},
        )
        eng = Engine(cfg, clock=clock)
        if policy_state:
            eng.restore_policies(policy_state)
        data = bytes(CHUNK_BYTES)
        per_request: list[int] = []
        accesses = 0
        by_nsid: dict[int, int] = {}
        try:
            clock.t = next_tick = 1.0
            for i, req in enumerate(trace):
                if i == reopen_at:
                    saved = (
                        _order_file(cfg).read_bytes()
                        if crash and _order_file(cfg).exists()
                        else None
                    )
                    eng.close()
                    if crash:
                        _as_after_kill9(cfg, saved)
                    eng = Engine(cfg, clock=clock)
                clock.t = max(clock.t, 1.0 + req.timestamp_ms / 1000.0)
                if (dram_blocks or crash) and clock.t >= next_tick:  # one tick covers a gap
                    eng.tick()
                    next_tick = clock.t + TICK_S
                keys = [_key(b) for b in req.hash_ids]
                accesses += len(keys)
                found = eng.lookup(TENANT, keys, lease=False).hits
                per_request.append(len(found))
                for loc in found:
                    by_nsid[loc.nsid] = by_nsid.get(loc.nsid, 0) + 1
                parent = keys[len(found) - 1] if found else None
                for key in keys[len(found) :]:
                    if not eng.lookup(TENANT, [key], lease=False).hits:
                        try:
                            eng.put_chunk(TENANT, key, data, parent=parent)
                        except TierFull:
                            break  # only the parent is held and it is kept: store what fits
                    parent = key
            state = eng.policy_state()
            moved = eng.stats(TENANT)
        finally:
            eng.close()
    names = {1: "dram", 2: "nvme"}
    by_tier = {names[n]: c for n, c in sorted(by_nsid.items())}
    return EngineReplay(
        sum(per_request), accesses, by_tier, per_request, state,
        promotions=int(moved["promotions"]), demotions=int(moved["demotions"]),
    )  # fmt: skip


def policy_hits(
    parts: Sequence[Sequence[Request]],
    policy: str,
    capacity: int,
    *,
    engine: bool = True,
    data_dir: Path | None = None,
) -> tuple[list[int], dict[str, int]]:
    """(each request's prefix hits, hits per tier) over `parts`, a trace cut where its cache
    restarts empty (one part: no restart): through the real Engine, or with `engine=False`
    through its fast path, the standalone simulator (the same hits, proven by
    tests/test_replay_engine.py on every policy; the simulator knows one tier only). Each
    restart begins from what the policy kept of the part before (`Engine.policy_state`, which
    the engine writes beside its checkpoint: `elect`'s leader)."""
    if not engine:
        fast = restarted_hits(parts, lambda: make_policy(policy, capacity), capacity)
        return fast, {"nvme": sum(fast)}
    per_request: list[int] = []
    by_tier: dict[str, int] = {}
    state: dict[str, Any] = {}
    for part in parts:
        got = replay_engine(part, policy, capacity, data_dir=data_dir, policy_state=state)
        per_request += got.per_request
        for tier, n in got.hits_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
        state = got.policy_state
    return per_request, by_tier


def _order_file(cfg: EngineConfig) -> Path:
    return cfg.journal_path / POLICY_ORDER


def _as_after_kill9(cfg: EngineConfig, saved_order: bytes | None) -> None:
    """The journal directory a kill -9 leaves: the order file of the last periodic save (or
    none), no clean-stop marker."""
    if saved_order is None:
        _order_file(cfg).unlink(missing_ok=True)
    else:
        _order_file(cfg).write_bytes(saved_order)
    (cfg.journal_path / CLEAN_STOP).unlink()


def restarted_hits(
    parts: Sequence[Sequence[Request]],
    new_policy: Callable[[], EvictionPolicy],
    capacity: int,
    *,
    carry: bool = True,
) -> list[int]:
    """The simulator over `parts` (the engine replay's fast path): a new policy from
    `new_policy()` for each part, begun from what the one before kept (`carry`, as the engine
    does from its `policy_state`; False: from nothing)."""
    per_request: list[int] = []
    kept: dict[str, Any] = {}
    for part in parts:
        p = new_policy()
        if carry and kept:
            p.restore(kept, 0.0)
        per_request += replay_hits(part, p, capacity)
        kept = p.state()
    return per_request
