"""The composite operations behind `dpuctl spdk ...` and the rpc.py plugin (spdk_rpc_plugin).

They live in the agent (not in spdk_plugins) because they read the agent's key store:
spdk_plugins never imports dpu_agent.

Each takes a config path and returns plain JSON-able data, so both front ends stay thin.
Key material comes from the agent's key store: a key file (`--key-file`) or, without one,
the environment (`DPUKV_XTS_KEY_<TENANT>`); it never appears in what these return.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpu_agent.crypto.keystore import KeyStore
from spdk_plugins.apply import apply, status
from spdk_plugins.bootconfig import boot_config
from spdk_plugins.desired import KeyProvider, SpdkDesired, load_desired
from spdk_plugins.keys import keystore_provider
from spdk_plugins.plan import plan, plan_saved
from spdk_plugins.rpc import SpdkClient
from spdk_plugins.saved import load_saved
from spdk_plugins.tiers import agent_tiers

__all__ = [
    "run_apply",
    "run_boot_config",
    "run_plan",
    "run_status",
    "run_tiers",
    "session",
]


def key_provider_for(desired: SpdkDesired, key_file: str | None) -> KeyProvider:
    return keystore_provider(desired, KeyStore(key_file))


@contextlib.contextmanager
def session(
    config: str | Path, socket: str | None, key_file: str | None
) -> Iterator[tuple[SpdkDesired, SpdkClient, KeyProvider]]:
    desired = load_desired(config)
    keys = key_provider_for(desired, key_file)
    with SpdkClient(socket or desired.socket, timeout_s=desired.rpc_timeout_s) as client:
        yield desired, client, keys


def run_plan(
    config: str | Path,
    socket: str | None = None,
    key_file: str | None = None,
    saved: str | Path | None = None,
) -> Any:
    """The plan against the live target, or offline against a saved configuration."""
    if saved is None:
        with session(config, socket, key_file) as (desired, client, keys):
            return plan(desired, client, keys).to_json()
    desired = load_desired(config)
    doc = load_saved(saved)
    result, notes = plan_saved(desired, doc, key_provider_for(desired, key_file))
    return {**result.to_json(), "offline": str(saved), "assumed": list(notes)}


def run_apply(config: str | Path, socket: str | None = None, key_file: str | None = None) -> Any:
    with session(config, socket, key_file) as (desired, client, keys):
        return apply(desired, client, keys).to_json()


def run_status(config: str | Path, socket: str | None = None, key_file: str | None = None) -> Any:
    with session(config, socket, key_file) as (desired, client, keys):
        return status(desired, client, keys).to_json()


def run_tiers(config: str | Path) -> Any:
    return [t.to_json() for t in agent_tiers(load_desired(config))]


def run_boot_config(
    config: str | Path,
    output: str | None = None,
    *,
    with_keys: bool = False,
    key_file: str | None = None,
    provisioned: bool = False,
) -> Any:
    """The boot JSON; with_keys writes real key material, only to a new 0600 file."""
    desired = load_desired(config)
    if not with_keys:
        doc = boot_config(desired, provisioned=provisioned)
        if output is not None:
            Path(output).write_text(json.dumps(doc, indent=2) + "\n")
        return doc
    if output is None:
        raise ValueError("--with-keys writes key material: give --output FILE (created 0600)")
    doc = boot_config(desired, key_provider_for(desired, key_file), provisioned=provisioned)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    return {"written": output, "mode": "0600", "keys": [k.name for k in desired.keys]}
