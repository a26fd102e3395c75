"""`dpuctl bench lmcache`: LMCache's remote-storage throughput, the agent (through the dpukv
plugin) against LMCache's own ``lm://`` server, the same objects in the same run.

Real LMCache 0.5.6 in its own venv (`make test-engines` builds ``.venv-lmcache``) runs
`dpu_agent.bench.lmcache_run` in ``bench`` mode: LMCache's `RemoteBackend` puts `--mib` MiB of
memory objects (SmolLM2-135M's 256-token chunks, 11.25 MiB each) in one batch and gets them
back, first through its ``lm://`` server (started by the driver), then through the agent (an
embedded agent started here, on loopback, its DRAM tier sized to hold every repeat's
objects), `--repeats` times interleaved; the best of each
counts (this machine is shared: interference only ever slows a run).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import click

from host_shim.client import IO_QUEUES_MAX

__all__ = ["lmcache_cmd", "run_lmcache_bench"]

MIB_MAX = 4096  # LMCache's local CPU buffer holds the objects twice (written and read back)
REPEATS_MAX = 20
# The agent's DRAM tier holds every repeat's objects (LMCache's lm:// server keeps them all in
# memory too; the embedded default of 256 MiB would spill most of them to the file tier,
# demoting while the next put runs). Bounded: the tier is an anonymous mapping of this size.
DRAM_TIER_MIB_MAX = 8192


def run_lmcache_bench(
    *, mib: int = 256, repeats: int = 3, io_queues: int | None = None
) -> dict[str, Any]:
    """The report: per backend, each repeat's put/get GB/s and the best; and the ratios."""
    if not 16 <= mib <= MIB_MAX:
        raise click.BadParameter(f"--mib {mib} outside [16, {MIB_MAX}]")
    if not 1 <= repeats <= REPEATS_MAX:
        raise click.BadParameter(f"--repeats {repeats} outside [1, {REPEATS_MAX}]")
    if io_queues is not None and not 1 <= io_queues <= IO_QUEUES_MAX:
        raise click.BadParameter(f"--io-queues {io_queues} outside [1, {IO_QUEUES_MAX}]")
    dram_mib = mib * repeats * 5 // 4 + 64  # objects round up to whole 4 KiB blocks
    if dram_mib > DRAM_TIER_MIB_MAX:
        raise click.BadParameter(
            f"--mib {mib} x --repeats {repeats}: the agent's DRAM tier would need {dram_mib} "
            f"MiB, over {DRAM_TIER_MIB_MAX}"
        )
    from dpu_agent.bench.engines import engine_python, run_lmcache
    from dpu_agent.testing import spawn_agent

    python = engine_python("lmcache")
    if python is None:
        raise click.ClickException("LMCache's venv is missing: run make test-engines")
    with tempfile.TemporaryDirectory(prefix="dpukv-lmcache-") as tmp:
        env = {"DPUKV_STORAGE_DRAM_BYTES": str(dram_mib << 20), "DPUKV_METRICS_ENABLED": "false"}
        agent = spawn_agent(tmp, env=env)
        try:
            spec = {
                "mode": "bench", "mib": mib, "repeats": repeats,
                "control": agent.control_url, "tenant": "default", "token": agent.token,
                "salt": os.urandom(32).hex(), "max_local_cpu_gb": 2 * mib / 1024 + 0.5,
                "io_queues": io_queues,
            }  # fmt: skip
            row = run_lmcache(spec, python)
        finally:
            agent.stop()
    best = row["best"]
    row["ratio"] = {k: round(best["dpukv"][k] / best["lm"][k], 2) for k in ("put_gbps", "get_gbps")}
    return row


@click.command("lmcache")
@click.option("--mib", default=256, show_default=True, help="MiB of LMCache objects per run.")
@click.option("--repeats", default=3, show_default=True, help="Interleaved runs; best counts.")
@click.option(
    "--io-queues",
    type=int,
    default=None,
    help="The plugin's NVMe/TCP queues (extra_config dpukv.io_queues; default: the plugin's).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def lmcache_cmd(mib: int, repeats: int, io_queues: int | None, as_json: bool) -> None:
    """LMCache remote storage: the agent (dpukv plugin) against LMCache's lm:// server."""
    report = run_lmcache_bench(mib=mib, repeats=repeats, io_queues=io_queues)
    if as_json:
        click.echo(json.dumps(report))
        return
    b, r = report["best"], report["ratio"]
    click.echo(f"{report['objects']} objects of {report['object_bytes'] / 2**20:.2f} MiB")
    click.echo(f"{'backend':<16} {'put GB/s':>9} {'get GB/s':>9}")
    click.echo(f"{'lm:// server':<16} {b['lm']['put_gbps']:>9.2f} {b['lm']['get_gbps']:>9.2f}")
    click.echo(f"{'dpukv agent':<16} {b['dpukv']['put_gbps']:>9.2f} {b['dpukv']['get_gbps']:>9.2f}")
    click.echo(f"{'ratio':<16} {r['put_gbps']:>8.2f}x {r['get_gbps']:>8.2f}x")
