"""Every TOML file of the project goes through one bounded reader (kvproto/tomlfile.py): the
SPDK desired-state reader had no size bound and read any file whole; four copies of the same
read-check-parse each said it their own way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dpu_agent.config import ConfigError, load_config
from dpu_agent.firmware._profile import PROFILE_BYTES_MAX, ProfileError, load_profile
from dpu_agent.net import NetConfigError, load_net
from kvproto.tomlfile import CONFIG_BYTES_MAX, TomlFileError, load_toml
from spdk_plugins.desired import DesiredStateError, load_desired

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("dpu_agent", "host_shim", "kvproto", "spdk_plugins")


def _oversized(tmp_path: Path, nbytes: int) -> Path:
    p = tmp_path / "big.toml"
    p.write_text("# padding\n" * (nbytes // 10 + 1))  # a valid TOML document, only too big
    return p


def test_a_file_over_the_bound_is_refused_naming_file_and_bound(tmp_path: Path) -> None:
    p = _oversized(tmp_path, 4096)
    with pytest.raises(TomlFileError, match=rf"^config {p} is over 4096 bytes$"):
        load_toml(p, max_bytes=4096)
    p.write_text("# padding\n" * 400)  # 4000 bytes: within the bound
    assert load_toml(p, max_bytes=4096) == {}


def test_bad_toml_and_unreadable_files_say_what_is_wrong(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[net\n")
    with pytest.raises(TomlFileError, match=rf"^firmware profile {p} is not valid TOML: "):
        load_toml(p, what="firmware profile")
    p.write_bytes(b"a = '\xff'\n")
    with pytest.raises(TomlFileError, match="is not valid TOML"):
        load_toml(p)
    with pytest.raises(TomlFileError, match=rf"^cannot read config {tmp_path}/none.toml: "):
        load_toml(tmp_path / "none.toml")


def test_spdk_desired_state_refuses_an_oversized_config(tmp_path: Path) -> None:
    p = _oversized(tmp_path, CONFIG_BYTES_MAX)
    with pytest.raises(DesiredStateError, match=f"over {CONFIG_BYTES_MAX} bytes"):
        load_desired(p)


def test_every_reader_refuses_an_oversized_file_the_same_way(tmp_path: Path) -> None:
    big = _oversized(tmp_path, CONFIG_BYTES_MAX)
    for load, err in ((load_config, ConfigError), (load_net, NetConfigError)):
        with pytest.raises(err, match=rf"^config {big} is over {CONFIG_BYTES_MAX} bytes$"):
            load(big)
    prof = _oversized(tmp_path, PROFILE_BYTES_MAX)
    with pytest.raises(ProfileError, match=f"^firmware profile {prof} is over"):
        load_profile(str(prof))


def test_no_other_module_parses_toml() -> None:
    """tomllib is imported by the loader only: a new reader would bring back an unbounded one."""
    users = []
    for pkg in RUNTIME:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if "tomllib" in names:
                    users.append(str(path.relative_to(ROOT)))
    assert users == ["kvproto/tomlfile.py"], users
