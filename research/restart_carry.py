"""Research, not packaged: `elect` with and without the leader carried across a restart, on the
restarting traces of one family seed (the rule's fresh seed; elect_choose.py keeps to the
development seeds). The fixed policies restart from nothing either way (they keep no state).

    PYTHONPATH=$PWD python research/restart_carry.py --seed N --jobs 2
"""

from __future__ import annotations

import argparse
from multiprocessing import Pool

from dpu_agent.bench.replay import DEFAULT_FRACTIONS
from dpu_agent.bench.replay_family import BAR_POINTS, SEPARABLE_Z, _set, separation_z
from research.elect_choose import _fixed, _score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    cells = [(t, f) for t in _set("rule", a.seed, 1500) if t.restart for f in DEFAULT_FRACTIONS]
    with Pool(a.jobs) as pool:
        fixed = pool.map(_fixed, cells, chunksize=1)
        for label, carry in (("prior", False), ("carry", True)):
            args = [
                (c, f["capacity"], {"carry": carry}, "elect")
                for c, f in zip(cells, fixed, strict=True)
            ]
            got = pool.map(_score, args, chunksize=1)
            decided = within = under = 0
            gaps = []
            for (spec, frac), f, e in zip(cells, fixed, got, strict=True):
                acc = f["accesses"]
                rates = {n: sum(h) / acc * 100 for n, h in f["hits"].items()}
                best = max(rates, key=rates.__getitem__)
                gap = sum(e) / acc * 100 - rates[best]
                sep = separation_z(f["hits"], acc)
                dec = sep is not None and sep[0] >= SEPARABLE_Z
                decided += dec
                within += dec and gap >= -BAR_POINTS
                lru = sum(e) / acc * 100 - rates["lru"]
                under += lru < 0
                gaps.append(gap)
                if (dec and gap < -BAR_POINTS) or lru < 0:
                    print(f"  {label} {spec.name} {frac * 100:g}%: gap {gap:+.2f} lru {lru:+.2f}"
                          f" best {best} {'DECIDED' if dec else ''}")  # fmt: skip
            misses = decided - within + under
            print(f"{label}: decided within {within}/{decided}, under LRU {under}/{len(cells)}, "
                  f"misses {misses}, mean gap {sum(gaps) / len(gaps):+.3f}, worst {min(gaps):+.2f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
