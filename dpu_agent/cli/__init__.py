"""dpuctl: the operator CLI of the context-memory tier.

Not SONiC's `dpuctl` (smart-switch DPU power control): this one manages the KV-cache agent.
Each area registers its commands below; commands stay one to three lines (parse, call, print).
"""

from __future__ import annotations

import click

from dpu_agent import __version__
from dpu_agent.bench.crypto import crypto_cmd
from dpu_agent.bench.datapath import datapath
from dpu_agent.bench.index import index_cmd
from dpu_agent.bench.lmcache import lmcache_cmd
from dpu_agent.bench.nvme import nvme as nvme_bench
from dpu_agent.bench.recovery import recovery_cmd
from dpu_agent.bench.replay import replay_command
from dpu_agent.bench.ttft import ttft_cmd
from dpu_agent.cli import ops
from dpu_agent.cli.spdk import spdk_group


@click.group(
    help="Manage the BlueField context-memory tier (KV-cache agent). "
    "Not the SONiC dpuctl for DPU power control."
)
@click.version_option(__version__, prog_name="dpuctl")
def cli() -> None:
    pass


@cli.group(help="Benchmarks; each prints a JSON report with --json.")
def bench() -> None:
    pass


# --- registrations (one line per command) ---
bench.add_command(ttft_cmd)
cli.add_command(spdk_group)
bench.add_command(crypto_cmd)
ops.register(cli)
bench.add_command(datapath)
bench.add_command(replay_command)
bench.add_command(nvme_bench)
bench.add_command(index_cmd)
bench.add_command(recovery_cmd)
bench.add_command(lmcache_cmd)


def main() -> None:
    cli()
