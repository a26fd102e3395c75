"""SPDK mode speaks v26.05: a target of another release, or one lacking a method the driver
sends, is refused at start with its version named, before any plan (against the simulator
built from the v26.05 peer's recordings, with its version or methods changed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from spdk_sim.fixtures import config_text
from spdk_sim.sim import SpdkSimulator

from dpu_agent.config import load_config
from dpu_agent.crypto import KeyStore
from dpu_agent.spdk_mode import SpdkModeError, check_spdk
from spdk_plugins import SpdkClient
from spdk_plugins.versions import (
    REQUIRED_METHODS,
    SUPPORTED_RELEASES,
    SpdkVersionError,
    check_target_version,
    recorded_release,
)

ROOT = Path(__file__).resolve().parent.parent
# Methods of SPDK modules a build may leave out (liburing, mlx5): only configs that use them
# send them, and SPDK's own "Method not found" names them.
BUILD_OPTIONAL = {"bdev_uring_create", "bdev_uring_delete", "mlx5_scan_accel_module"}


def _sim(tmp_path: Path) -> SpdkSimulator:
    sim = SpdkSimulator(str(tmp_path / "spdk.sock"), file_sizes={str(tmp_path / "d.img"): 64 << 20})
    return sim


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(
        f'[agent]\nmode = "spdk"\ndata_dir = "{tmp_path / "var"}"\n'
        + config_text(str(tmp_path / "d.img"), str(tmp_path / "spdk.sock"))
    )
    return path


def test_an_older_spdk_release_is_refused_at_start_naming_its_version(tmp_path: Path) -> None:
    sim = _sim(tmp_path)
    sim.target.data["spdk_get_version"] = {
        "version": "SPDK v24.09 git sha1 0123456789",
        "fields": {"major": 24, "minor": 9, "patch": 0, "suffix": "", "commit": "0123456789"},
    }
    cfg = load_config(_config(tmp_path), environ={})
    assert cfg.spdk is not None
    with sim, pytest.raises(SpdkModeError, match=r"SPDK v24\.09 .* not a release .*v26\.05"):
        check_spdk(cfg.spdk, KeyStore(tmp_path / "keys.json"), apply_on_start=True)
    planned = [r.get("method") for r in sim.requests]
    assert "bdev_malloc_create" not in planned  # refused before anything was applied


def test_a_target_without_a_method_the_driver_sends_is_refused_naming_it(tmp_path: Path) -> None:
    sim = _sim(tmp_path)
    sim.target.data["rpc_methods"] = [
        m for m in sim.target.data["rpc_methods"] if m != "nvmf_subsystem_add_host"
    ]
    with sim, SpdkClient(sim.socket_path) as client:
        with pytest.raises(SpdkVersionError, match=r"lacks RPC methods .*nvmf_subsystem_add_host"):
            check_target_version(client)


def test_the_v26_05_target_is_accepted(tmp_path: Path) -> None:
    with _sim(tmp_path) as sim, SpdkClient(sim.socket_path) as client:
        assert check_target_version(client) == "v26.05"


def test_each_supported_release_is_recorded_with_what_the_driver_sends() -> None:
    """Every method name the driver's code sends is in each supported release's recording,
    and the required set is a subset of it."""
    sent = set()
    for path in [*(ROOT / "spdk_plugins").glob("*.py"), ROOT / "dpu_agent" / "spdk_mode.py"]:
        sent |= set(re.findall(r'call\(\s*"([a-z0-9]+_[a-z0-9_]+)"', path.read_text()))
    assert len(sent) > 30  # the pattern still finds the driver's calls
    sent -= BUILD_OPTIONAL
    for (major, minor), name in SUPPORTED_RELEASES.items():
        rec = recorded_release(name)
        assert rec["spdk_get_version"]["fields"]["major"] == major
        assert rec["spdk_get_version"]["fields"]["minor"] == minor
        methods = set(rec["rpc_get_methods"])
        assert REQUIRED_METHODS <= methods
        assert sent - methods == set(), f"{name} does not serve {sorted(sent - methods)}"
