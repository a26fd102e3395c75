"""An rpc.py plugin: the project's composite SPDK operations for operators who live in rpc.py.

    rpc.py -s /var/tmp/spdk.sock --plugin dpu_agent.spdk_rpc_plugin kvtier_plan -c agent.toml
    rpc.py -s /var/tmp/spdk.sock --plugin dpu_agent.spdk_rpc_plugin kvtier_apply -c agent.toml
    rpc.py -s /var/tmp/spdk.sock --plugin dpu_agent.spdk_rpc_plugin kvtier_status -c agent.toml
    rpc.py --plugin dpu_agent.spdk_rpc_plugin kvtier_boot_config -c agent.toml

rpc.py's `-s` socket is used (not `[spdk].socket`); output is JSON with key material redacted.
SPDK's loader imports the module named by `--plugin` and calls
`spdk_rpc_plugin_initialize(subparsers)`; each command's `func(args)` runs with `args.client`
already connected, which these composite commands do not need (they open their own, bounded
by wall-clock time).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from dpu_agent import spdk_ops as ops
from spdk_plugins.desired import DesiredStateError
from spdk_plugins.rpc import SpdkError

__all__ = ["spdk_rpc_plugin_initialize"]


def _run(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], None]:
    def func(args: argparse.Namespace) -> None:
        try:
            doc = fn(args)
        except (SpdkError, DesiredStateError, OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        print(json.dumps(doc, indent=2))

    return func


def _socket(args: argparse.Namespace) -> str | None:
    return getattr(args, "server_addr", None)


def spdk_rpc_plugin_initialize(subparsers: Any) -> None:
    commands: list[tuple[str, str, Callable[[argparse.Namespace], Any]]] = [
        (
            "kvtier_plan",
            "RPCs that would reconcile SPDK with [spdk] of the agent config",
            lambda a: ops.run_plan(a.config, _socket(a), a.key_file),
        ),
        (
            "kvtier_apply",
            "run the plan, stop at the first error, re-plan",
            lambda a: ops.run_apply(a.config, _socket(a), a.key_file),
        ),
        (
            "kvtier_status",
            "drift between the live state and the desired one",
            lambda a: ops.run_status(a.config, _socket(a), a.key_file),
        ),
        (
            "kvtier_boot_config",
            "the boot JSON config (keys redacted)",
            lambda a: ops.run_boot_config(a.config),
        ),
    ]
    for name, help_text, fn in commands:
        p = subparsers.add_parser(name, help=help_text)
        p.add_argument("-c", "--config", required=True, help="agent TOML config with [spdk]")
        p.add_argument("--key-file", default=None, help="agent key file (default: environment)")
        p.set_defaults(func=_run(fn))
