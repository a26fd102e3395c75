"""dpuctl: the operator CLI of the context-memory tier.

Not SONiC's `dpuctl` (smart-switch DPU power control): this one manages the KV-cache agent.
Each area registers its commands below; commands stay one to three lines (parse, call, print).
"""

from __future__ import annotations

import click

from dpu_agent import __version__


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


def main() -> None:
    cli()
