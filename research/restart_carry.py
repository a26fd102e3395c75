"""Research, not packaged: `elect` variants on one family seed (a rule's fresh seed;
elect_choose.py keeps to the development seeds), each against the same fixed policies. By
default the leader carried across a restart or not, on the restarting traces (the fixed
policies restart from nothing either way: they keep no state); `--all` takes every trace of
the seed, `--variant LABEL:JSON` other `elect` arguments (elect_choose.py's).

    PYTHONPATH=$PWD python research/restart_carry.py --seed N --jobs 2
    PYTHONPATH=$PWD python research/restart_carry.py --seed N --all \
        --variant 'z25:{}' --variant 'z30:{"switch_z": 3.0}'
"""

from __future__ import annotations

import argparse
import json
from multiprocessing import Pool

from dpu_agent.bench.replay import DEFAULT_FRACTIONS
from dpu_agent.bench.replay_family import _set
from research.elect_choose import _fixed, _score, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--all", action="store_true", help="every trace, not only the restarting")
    ap.add_argument("--variant", action="append", default=[])
    a = ap.parse_args()
    traces = [t for t in _set("rule", a.seed, 1500) if a.all or t.restart]
    cells = [(t, f) for t in traces for f in DEFAULT_FRACTIONS]
    variants = [
        (label, json.loads(js or "{}")) for label, _, js in (v.partition(":") for v in a.variant)
    ] or [("prior", {"carry": False}), ("carry", {"carry": True})]
    with Pool(a.jobs) as pool:
        fixed = pool.map(_fixed, cells, chunksize=1)
        for label, kwargs in variants:
            args = [(c, f["capacity"], kwargs, "elect") for c, f in zip(cells, fixed, strict=True)]
            got = pool.map(_score, args, chunksize=1)
            report(label, cells, fixed, got)


if __name__ == "__main__":
    main()
