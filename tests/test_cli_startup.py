"""dpuctl answers quickly: `dpuctl --help` and `dpuctl status` import only the CLI and what status
needs (config, the control channel), not the benchmarks, the cluster, the engine or the agent's
service. Measured in CPU time (a loaded box stretches wall time, not CPU time), as a ratio to a
bare `python -c pass` so a slower machine moves both sides."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dpu_agent.cli import BENCH_COMMANDS, COMMANDS, bench, cli

# Modules `dpuctl status` must not load: each costs tenths of a second and none is needed to ask
# the agent one question.
HEAVY_PREFIXES = (
    "dpu_agent.bench",
    "dpu_agent.cluster",
    "dpu_agent.service",
    "dpu_agent.engine",
    "dpu_agent.nvmf",
    "host_shim.nvme",
    "host_shim.client",
    "torch",
    "transformers",
    "matplotlib",
    # numpy (~0.2 s of CPU here, through kvproto's key and placement modules) and structlog
    # (through spdk_plugins' RPC client) were loaded by reading the config; status needs neither
    "numpy",
    "structlog",
    "spdk_plugins.rpc",
)
# A bare interpreter costs ~15 ms of CPU here; the CLI's entry point ~40 ms after lazy imports
# and ~500 ms before. 8x leaves room for a slow or loaded machine and still fails the old code.
IMPORT_RATIO_MAX = 8.0
# `dpuctl status` against no agent (config, control channel, the error): ~0.12-0.2 s of CPU here
# (~8x a bare interpreter); ~0.3 s (~16x) when reading the config loaded numpy and structlog,
# ~0.6 s (~31x) when the CLI imported every command's module.
STATUS_RATIO_MAX = 13.0
RUNS = 3  # best of: CPU time of one short process varies with caches


def _cpu_s(argv: list[str], env: dict[str, str]) -> float:
    """CPU time (user + system) of the child, the best of RUNS."""
    best = float("inf")
    for _ in range(RUNS):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, env=env, capture_output=True, timeout=60, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, spent)
    return best


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["DPUKV_DATA_DIR"] = str(tmp_path / "nothing-here")  # no agent: status exits 3 at once
    env.pop("DPUKV_CONFIG", None)
    return env


def test_cli_entry_point_imports_quickly_relative_to_a_bare_interpreter(tmp_path: Path) -> None:
    env = _env(tmp_path)
    bare = _cpu_s([sys.executable, "-c", "pass"], env)
    cli_import = _cpu_s([sys.executable, "-c", "import dpu_agent.cli"], env)
    ratio = cli_import / max(bare, 0.005)
    assert ratio < IMPORT_RATIO_MAX, (
        f"import dpu_agent.cli: {cli_import:.3f} s CPU, {ratio:.1f}x python -c pass "
        f"({bare:.3f} s); something heavy is imported at module level"
    )


def test_dpuctl_status_cpu_time_is_a_small_multiple_of_a_bare_interpreter(
    tmp_path: Path,
) -> None:
    env = _env(tmp_path)
    bare = _cpu_s([sys.executable, "-c", "pass"], env)
    status = _cpu_s([sys.executable, "-c", "from dpu_agent.cli import main; main()",
                     "status", "--json"], env)  # fmt: skip
    ratio = status / max(bare, 0.005)
    assert ratio < STATUS_RATIO_MAX, f"dpuctl status: {status:.3f} s CPU, {ratio:.1f}x bare"


_PROBE = """
import json, sys
sys.argv = ["dpuctl", *sys.argv[1:]]
from dpu_agent.cli import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["status", "--json"], ["--help"], ["stats", "--json"]])
def test_dpuctl_status_and_help_do_not_import_heavy_modules(
    tmp_path: Path, argv: list[str]
) -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    modules = json.loads(out.stderr.strip().splitlines()[-1])
    heavy = sorted(m for m in modules if m.startswith(HEAVY_PREFIXES))
    assert not heavy, f"dpuctl {' '.join(argv)} imported {heavy[:12]}"
    if argv[0] == "status":  # it did run: no agent there, exit 3 with a JSON error
        assert json.loads(out.stdout)["exit_code"] == 3


@pytest.mark.parametrize(("group", "table"), [(cli, COMMANDS), (bench, BENCH_COMMANDS)])
def test_every_lazy_command_loads_under_its_own_name(
    group: click.Group, table: dict[str, tuple[str, str, str]]
) -> None:
    ctx = click.Context(group)
    for name in table:
        command = group.get_command(ctx, name)
        assert command is not None and command.name == name, (name, command)
