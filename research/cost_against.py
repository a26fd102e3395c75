"""Research, not packaged: the cost bench with an earlier `prefix-run` measured in the same rounds.

The bar's baseline is `prefix-run`'s CPU; when `prefix-run` itself changes, this puts the earlier
one beside it (registered as `prefix-run-old`), with `elect`:

    git worktree add /tmp/old 3d3c00d
    PYTHONPATH=$PWD python research/cost_against.py /tmp/old > cost.json

The earlier module is loaded from the checkout's `dpu_agent/eviction/_prefix_run.py`; it builds on
this tree's `prefix` (unchanged in between).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from dpu_agent.bench.replay_cost import policy_cost
from dpu_agent.eviction import _registry


def main() -> None:
    old = Path(sys.argv[1]) / "dpu_agent" / "eviction" / "_prefix_run.py"
    spec = importlib.util.spec_from_file_location("prefix_run_old", old)
    assert spec is not None and spec.loader is not None, old
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _registry._FACTORIES["prefix-run-old"] = module.RunAwarePrefixPolicy
    print(json.dumps(policy_cost(["prefix-run-old", "elect"]), indent=1))


if __name__ == "__main__":
    main()
