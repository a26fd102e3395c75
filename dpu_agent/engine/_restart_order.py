"""The eviction order across a restart: what each tenant's NVMe policy held, saved while the
agent runs and at a clean close, and taken over at the next start.

Recovery rebuilds the index from the journal alone (numpy work), so the policies start empty:
recovered chunks wait in the tier's cold list, evicted before anything the policy holds and
joining it, as new, when used. That forgets what the policy had learnt: a chunk it protected
(used again and again) is evicted after the restart before a one-off chunk put since. Measured
through the engine (docs/EVICTION.md, "A restart that keeps the tier"): on `docs` at 5% the
second half of the trace hit 24.3% after such a restart against 28.8% without one, nearly a cold
restart's 23.7% (28.0% with the saved order).

So the engine saves, per tenant, its NVMe policy's order (`EvictionPolicy.resident()`: items
first-to-go first, each with whether it was used) to `policy-order.npz`: every
`policy_order_save_s` from `tick()` (a crash, a kill -9 or a power loss keeps the order of the
last save) and at a clean close. The copy is taken under the engine lock
(`resident_later(ADOPT_ITEMS_MAX)`: shallow copies, of the hottest only where the policy keeps
its items in order), the ordering and the write after it. The next start hands
the hottest `ADOPT_ITEMS_MAX` of them (shared among the tenants) back to the policy
(`EvictionPolicy.adopt`, the same handover `elect` uses at a switch), before the policy's own
state (`policy-state.json`) is restored. The rest stay in the cold list, as do the chunks put
after the save. The file stays until the next save replaces it (a start that crashes before
that adopts it again); anything unreadable or inconsistent is logged and removed, and the start
goes on as before.
"""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import numpy as np

from dpu_agent.engine import journal as jr
from dpu_agent.engine._records import ITEM_ROW_BITS, ROW_MASK, Records, items_of
from dpu_agent.engine._tenants import Tenants
from dpu_agent.engine.index import STATE_LIVE
from dpu_agent.engine.tiers import NVME, Tier
from dpu_agent.engine.types import TenantState
from dpu_agent.eviction import Ordering
from dpu_agent.files import read_small_file
from dpu_agent.log import get_logger

__all__ = [
    "ADOPT_ITEMS_MAX",
    "POLICY_ORDER",
    "adopt_saved_order",
    "held",
    "save_order",
    "shares",
    "take_order",
]

log = get_logger(__name__)

POLICY_ORDER = "policy-order.npz"
# Items handed back at a start, all tenants together: adoption is Python work, about 9 us an
# item under `elect` (`dpuctl bench recovery`, docs/bench/recovery.json: 1e6 records restart in
# 0.69 s, and in 1.65 s with 2^17 of them adopted); the coldest beyond it stay in the cold list,
# as every item did.
ADOPT_ITEMS_MAX = 1 << 17
_FILE_BYTES_MAX = ADOPT_ITEMS_MAX * 9 + (1 << 20)  # items, flags, and the zip's own bytes
_ITEM_MAX = 1 << 64  # items at or above it are collision stand-ins (COLLIDED | row)


def held(ts: TenantState) -> int:
    """Under the engine lock: the items the tenant's NVMe policy holds (for `shares`)."""
    return len(ts.tiers[NVME].policy)


def take_order(ts: TenantState, share: int) -> Ordering | None:
    """Under the engine lock: the tenant's NVMe policy order, copied (`resident_later`) to be
    computed by `save_order` after the lock is let go; None if its policy cannot hand its
    items over. Only the hottest `share` (the tenant's part of ADOPT_ITEMS_MAX, `shares`: no
    more is handed back), so a policy that keeps its items in order (`lru`, `s3fifo`, an
    `elect` they lead) holds the lock for those alone, whatever the tier holds."""
    try:
        return ts.tiers[NVME].policy.resident_later(share)
    except NotImplementedError:
        return None


def save_order(orders: list[tuple[str, Ordering]], journal_dir: Path) -> int:
    """Write what `take_order` copied, by tenant name (the hottest ADOPT_ITEMS_MAX of all,
    shared as `shares` says); returns the items written. A write failure is logged: the next
    start has the file of the save before, or none."""
    computed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, later in orders:
        resident = later()
        if resident:
            items = np.fromiter((i for i, _ in resident if i < _ITEM_MAX), np.uint64)
            used = np.fromiter((u for i, u in resident if i < _ITEM_MAX), np.bool_)
            computed[name] = (items, used)
    parts = shares({name: len(items) for name, (items, _) in computed.items()})
    arrays: dict[str, np.ndarray] = {}
    for name, (items, used) in computed.items():
        share = parts[name]
        arrays[f"items/{name}"] = items[len(items) - share :]  # the last to go are the hottest
        arrays[f"used/{name}"] = used[len(used) - share :]
    path = journal_dir / POLICY_ORDER
    if not arrays:  # nothing held: nothing to hand back
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("engine.policy_order_not_removed", path=str(path), error=str(e))
        return 0
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    try:
        jr.replace_file(path, buf.getvalue())
    except OSError as e:
        log.warning("engine.policy_order_not_written", error=str(e))
        return 0
    return sum(len(a) for k, a in arrays.items() if k.startswith("items/"))


def shares(sizes: dict[str, int]) -> dict[str, int]:
    """ADOPT_ITEMS_MAX shared among tenants holding `sizes` items, evenly but never more than a
    tenant holds (water-filling): a small tenant's unused share goes to the larger ones, where
    an even split left it unused."""
    shares: dict[str, int] = {}
    left, budget = len(sizes), ADOPT_ITEMS_MAX
    for name, size in sorted(sizes.items(), key=lambda kv: kv[1]):
        shares[name] = min(size, budget // left)
        budget -= shares[name]
        left -= 1
    return shares


def _read(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """The saved orders by tenant name; None (the file logged and removed where it is there)
    if there is none this engine can use. The file is a hint: anything wrong with it, whatever
    numpy or zipfile raise on it, costs the order and nothing else."""
    try:
        raw = read_small_file(path, _FILE_BYTES_MAX)
    except FileNotFoundError:
        return None
    except OSError as e:
        _discard(path, str(e))
        return None
    if len(raw) > _FILE_BYTES_MAX:
        _discard(path, "too large")
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:  # what it inflates to, before it does
            inflated = sum(info.file_size for info in zf.infolist())
        if inflated > 2 * _FILE_BYTES_MAX:
            raise ValueError(f"{inflated} bytes uncompressed")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # damage makes numpy and zipfile raise anything
        _discard(path, f"{type(e).__name__}: {e}")
        return None
    out = {}
    for key, items in arrays.items():
        kind, _, name = key.partition("/")
        used = arrays.get(f"used/{name}")
        if kind != "items" or used is None:
            continue
        if not (
            isinstance(items, np.ndarray)
            and isinstance(used, np.ndarray)
            and items.dtype == np.uint64
            and used.dtype == np.bool_
            and items.ndim == 1
            and items.shape == used.shape
        ):
            _discard(path, f"bad arrays for {name!r}")  # damaged: none of it is trusted
            return None
        out[name] = (items[-ADOPT_ITEMS_MAX:], used[-ADOPT_ITEMS_MAX:])
    return out


def _discard(path: Path, error: str) -> None:
    """A file this engine cannot use: logged and removed (it would be at every start)."""
    log.warning("engine.policy_order_unreadable", path=str(path), error=error)
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("engine.policy_order_not_removed", path=str(path), error=str(e))


def adopt_saved_order(
    tenants: Tenants, records: Records, journal_dir: Path, *, previous_stop: str, now: float
) -> int:
    """Hand each tenant's NVMe policy the recovered chunks the saved order names, in that
    order. Returns the items adopted."""
    path = journal_dir / POLICY_ORDER
    orders = _read(path)
    if orders is None:
        return 0
    t0 = time.perf_counter()
    adopted = 0
    budget = ADOPT_ITEMS_MAX
    for name, (items, used) in orders.items():
        ts = tenants.find(name)
        if ts is None or budget <= 0:
            continue
        n = _adopt(records, ts.tiers[NVME], items[-budget:], used[-budget:], now)
        adopted += n
        budget -= n
    log.info("engine.policy_order_adopted", items=adopted, previous_stop=previous_stop,
             s=round(time.perf_counter() - t0, 3))  # fmt: skip
    return adopted


def _adopt(records: Records, tier: Tier, items: np.ndarray, used: np.ndarray, now: float) -> int:
    """The saved items found among the tier's recovered chunks, handed to its policy in the
    saved order; the others stay in the cold list (adopted entries there are skipped)."""
    if len(tier.policy) or tier.cold_pos >= len(tier.cold) or not len(items):
        return 0
    cols = records.index.cols
    cold = tier.cold[tier.cold_pos :]
    rows = (cold & np.uint64(ROW_MASK)).astype(np.int64)
    live = (cols["state"][rows] == STATE_LIVE) & (
        cols["seq"][rows].astype(np.uint64) == (cold >> np.uint64(ITEM_ROW_BITS))
    )
    rows = rows[live]
    row_items = items_of(cols["k0"][rows], cols["k1"][rows])
    by_item = np.argsort(row_items, kind="stable")
    sorted_items = row_items[by_item]
    pos = np.minimum(np.searchsorted(sorted_items, items), max(0, len(sorted_items) - 1))
    found = (sorted_items[pos] == items) if len(sorted_items) else np.zeros(len(items), bool)
    # one entry per item (a duplicate in a damaged file would be adopted twice): the hottest
    items, used, pos = items[found], used[found], pos[found]
    _, last = np.unique(items[::-1], return_index=True)
    keep = np.sort(len(items) - 1 - last)
    chosen = rows[by_item[pos[keep]]]
    return records.adopt(tier, chosen.tolist(), items[keep].tolist(), used[keep].tolist(), now)
