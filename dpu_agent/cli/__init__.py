"""dpuctl: the operator CLI of the context-memory tier.

Not SONiC's `dpuctl` (smart-switch DPU power control): this one manages the KV-cache agent.
Each area registers its commands below; commands stay one to three lines (parse, call, print).
"""

from __future__ import annotations

import json
import signal
import sys

import click

from dpu_agent import __version__
from dpu_agent.bench.cluster import cluster_cmd as cluster_bench
from dpu_agent.bench.crypto import crypto_cmd
from dpu_agent.bench.datapath import datapath
from dpu_agent.bench.index import index_cmd
from dpu_agent.bench.lmcache import lmcache_cmd
from dpu_agent.bench.nvme import nvme as nvme_bench
from dpu_agent.bench.recovery import recovery_cmd
from dpu_agent.bench.replay import replay_command
from dpu_agent.bench.ttft import ttft_cmd
from dpu_agent.cli import ops
from dpu_agent.cli.cluster import cluster_group
from dpu_agent.cli.config_check import config_check
from dpu_agent.cli.firmware import firmware_group
from dpu_agent.cli.hosts import hosts
from dpu_agent.cli.net import net_group
from dpu_agent.cli.plan import plan_group
from dpu_agent.cli.provision import provision_cmd
from dpu_agent.cli.spdk import spdk_group


@click.group(
    help="Manage the BlueField context-memory tier (KV-cache agent). "
    "Not the SONiC dpuctl for DPU power control."
)
@click.version_option(__version__, prog_name="dpuctl")
def cli() -> None:
    pass


BENCH_MODULES = frozenset({"redis", "hiredis", "matplotlib"})  # the `bench` extra


class _BenchGroup(click.Group):
    """Benchmarks need the `bench` extra (Redis client, matplotlib), which a DPU image lacks:
    say so instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in BENCH_MODULES:
                raise
            raise click.ClickException(
                f"this benchmark needs {e.name}: pip install 'dpu-kvtier[bench]'"
            ) from None


@cli.group(cls=_BenchGroup, help="Benchmarks; each prints a JSON report with --json.")
def bench() -> None:
    pass


# --- registrations (one line per command) ---
bench.add_command(ttft_cmd)
cli.add_command(spdk_group)
bench.add_command(crypto_cmd)
ops.register(cli)
ops.config_group.add_command(config_check)
cli.add_command(hosts)
bench.add_command(datapath)
bench.add_command(replay_command)
bench.add_command(nvme_bench)
bench.add_command(index_cmd)
bench.add_command(recovery_cmd)
cli.add_command(cluster_group)
bench.add_command(cluster_bench)
cli.add_command(firmware_group)
cli.add_command(net_group)
cli.add_command(provision_cmd)
cli.add_command(plan_group)
bench.add_command(lmcache_cmd)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    """dpuctl's entry point: click's own handling, except that under --json a usage error is
    printed as JSON too (exit 2), so scripts always get JSON back. SIGTERM (a timeout, a
    kill) ends a command as Ctrl-C would, through its cleanup: a benchmark stops the targets
    and peers it started instead of leaving them running (the agent's own loop takes SIGTERM
    over for its orderly stop)."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        rv = cli.main(prog_name="dpuctl", standalone_mode=False)
    except click.UsageError as e:
        if "--json" in sys.argv[1:]:
            error = {"ok": False, "error": e.format_message(), "exit_code": e.exit_code}
            click.echo(json.dumps(error))
            sys.exit(e.exit_code)
        e.show()
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)
