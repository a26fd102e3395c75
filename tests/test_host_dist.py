"""The GPU server's path: `make host-dist` builds a wheel of host_shim + kvproto alone, a fresh
venv with nothing else installs it, and a host enrolled with `dpuctl hosts enrol` puts and gets
chunks through it against a real agent, reading only the credentials file."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.integrations.credentials import load_credentials, parse_salt

ROOT = Path(__file__).resolve().parent.parent
PIP_TIMEOUT_S = 240  # an install from the local pip cache/index takes ~20 s on a loaded box

HOST_SCRIPT = """
import sys
import tomllib
import numpy as np
from host_shim import KVClient
from host_shim.integrations.credentials import load_credentials
from kvproto.keys import ChunkLayout

creds = load_credentials(sys.argv[1])
layout = ChunkLayout("host-dist-model", "float16", 2, 2, 64, chunk_tokens=16)
tokens = list(range(2 * layout.chunk_tokens))
src = [np.full(layout.chunk_shape, i + 3, np.float16) for i in range(2)]
dst = [np.zeros(layout.chunk_shape, np.float16) for _ in range(2)]
with KVClient(creds.control[0], creds.tenant, creds.token, layout, creds.salt) as c:
    assert c.put(tokens, src) == 2
    assert c.get(tokens, dst) == 2
assert all((a == b).all() for a, b in zip(src, dst))
for mod in ("dpu_agent", "click", "structlog"):
    try:
        __import__(mod)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{mod} is importable in the host venv")
print("PUT-GET-OK")
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("hostdist") / "var")
    yield a
    a.stop()


def _enrol(agent: AgentProcess, out: Path, *extra: str) -> dict:
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    r = CliRunner().invoke(
        cli, ["hosts", "enrol", "--tenant", "default", "--out", str(out), "--json", *extra], env=env
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_enrol_writes_one_0600_credentials_file_with_a_stable_tenant_salt(
    agent: AgentProcess, tmp_path: Path
) -> None:
    out = tmp_path / "acme.json"
    out.write_text("{}")
    out.chmod(0o644)  # an existing file is not left readable by others
    _enrol(agent, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    creds = load_credentials(out)
    assert creds.tenant == "default" and creds.token == agent.token
    assert creds.control == (agent.control_url,)
    again = load_credentials(_enrol(agent, tmp_path / "b.json")["file"])
    assert again.salt == creds.salt  # every host of a tenant shares its salt, hence its chunks
    assert len(creds.salt) == 32


def test_enrol_with_nqn_carries_the_hosts_issued_keys(agent: AgentProcess, tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    _enrol(agent, out, "--nqn", "nqn.2014-08.org.nvmexpress:uuid:host-dist-1")
    data = json.loads(out.read_text())
    assert data["hostnqn"] == "nqn.2014-08.org.nvmexpress:uuid:host-dist-1"
    assert data["subnqn"].startswith("nqn.")


def test_enrol_of_a_tenant_added_at_run_time(agent: AgentProcess, tmp_path: Path) -> None:
    """`dpuctl tenants add t1` then `hosts enrol --tenant t1` said "no tenant 't1'" (enrol
    looked only at the configuration's tenants) while `tenants list` showed it."""
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    added = CliRunner().invoke(cli, ["tenants", "add", "runtime-t1", "--json"], env=env)
    assert added.exit_code == 0, added.output
    out = tmp_path / "t1.json"
    r = CliRunner().invoke(
        cli, ["hosts", "enrol", "--tenant", "runtime-t1", "--out", str(out), "--json"], env=env
    )
    assert r.exit_code == 0, r.output
    creds = load_credentials(out)
    assert creds.tenant == "runtime-t1" and creds.token == json.loads(added.output)["token"]


def test_enrol_of_an_unknown_tenant_is_a_usage_error(agent: AgentProcess, tmp_path: Path) -> None:
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    r = CliRunner().invoke(
        cli, ["hosts", "enrol", "--tenant", "nope", "--out", str(tmp_path / "x")], env=env
    )
    assert r.exit_code == 2 and "no tenant 'nope'" in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", ["", "abc", "0" * 30, "0" * 130, "0" * 33, "zz" * 20])
def test_salt_outside_32_to_128_hex_digits_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="32 to 128 hex digits"):
        parse_salt(bad)


def test_credentials_file_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text('{"version": 1, "control": ["tcp://h:1"], "tenant": "t", "token": "x"}')
    with pytest.raises(ValueError, match=r"c\.json: 'salt' is missing"):
        load_credentials(p)
    p.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_credentials(p)
    p.write_text(json.dumps({"version": 1, "control": ["garbage"], "tenant": "t", "token": "x",
                             "salt": "ab" * 16}))  # fmt: skip
    with pytest.raises(ValueError, match=r"c\.json: control URL 'garbage': scheme must be"):
        load_credentials(p)  # it loaded, and failed at the first call


def test_enrol_refuses_a_control_url_no_host_could_use(agent: AgentProcess, tmp_path: Path) -> None:
    """`--control-url garbage` was written into the credentials file (0 exit)."""
    env = {"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    for bad in ("garbage", "tcp://nohost", "tcp://a:7400,b"):
        out = tmp_path / "x.json"
        r = CliRunner().invoke(
            cli,
            ["hosts", "enrol", "--tenant", "default", "--control-url", bad, "--out", str(out)],
            env=env,
        )
        assert r.exit_code == 2 and "--control-url" in r.output, (bad, r.output)
        assert not out.exists()


def test_host_wheel_has_no_dpuctl_and_no_agent(tmp_path: Path) -> None:
    wheel = _build(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("dpu_agent/", "spdk_plugins/"))]
    assert not [n for n in names if n.endswith("entry_points.txt")]  # no dpuctl on the path
    meta = next(n for n in names if n.endswith("METADATA"))
    requires = [
        line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]  # fmt: skip
    assert not [r for r in requires if any(a in r for a in ("click", "rich", "structlog"))]


def _build(tmp_path: Path) -> Path:
    dist = tmp_path / "dist"
    r = subprocess.run(
        ["make", "-s", "host-dist", f"DIST_DIR={dist}", f"PY={sys.executable}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("dpu_kvtier_host-*.whl")
    return wheel


@pytest.mark.slow
def test_clean_venv_with_the_host_wheel_puts_and_gets_through_an_enrolled_host(
    agent: AgentProcess, tmp_path: Path
) -> None:
    wheel = _build(tmp_path)
    env_dir = tmp_path / "hostvenv"
    venv.create(env_dir, with_pip=True, clear=True)
    py = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "10"}
    # offline first (pip's configured find-links / local wheels), then the configured index
    r = subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-index", str(wheel)],
        env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        r = subprocess.run(
            [py, "-m", "pip", "install", "-q", str(wheel)],
            env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
        )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"the host wheel's dependencies are not installable here: {r.stderr[-300:]}")
    creds = tmp_path / "host.json"
    _enrol(agent, creds)
    r = subprocess.run(
        [py, "-c", HOST_SCRIPT, str(creds)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0 and "PUT-GET-OK" in r.stdout, r.stdout + r.stderr
    assert not (env_dir / "bin" / "dpuctl").exists()


def _third_party_imports(packages: tuple[str, ...]) -> set[str]:
    """Top-level modules imported at module level by `packages` outside the standard library
    and the repository's own packages."""
    own = {"kvproto", "host_shim", "dpu_agent", "spdk_plugins"}
    found: set[str] = set()
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:  # module level only
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found |= {n.split(".")[0] for n in names}
    return {m for m in found if m not in own and m not in sys.stdlib_module_names}


def _requires(pyproject: Path) -> set[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def test_dpuctl_entry_point_needs_nothing_outside_the_agent_distributions_dependencies() -> None:
    """`pip install dpu-kvtier` put a dpuctl on the path that died with ModuleNotFoundError:
    click (the CLI's imports were an extra's)."""
    dists = importlib.metadata.packages_distributions()
    cli_imports = _third_party_imports(("dpu_agent/cli",))
    needed = {d.lower().replace("_", "-") for m in cli_imports for d in dists.get(m, [m])}
    assert "click" in needed
    assert needed <= _requires(ROOT / "pyproject.toml")


def test_host_distribution_declares_what_host_shim_imports_and_nothing_of_the_agents() -> None:
    dists = importlib.metadata.packages_distributions()
    optional = {"torch", "vllm", "lmcache", "nixl", "nixl_cu12", "transformers", "pyverbs"}
    imports = _third_party_imports(("host_shim", "kvproto")) - optional
    needed = {d.lower().replace("_", "-") for m in imports for d in dists.get(m, [m])}
    host = _requires(ROOT / "host" / "pyproject.toml")
    assert needed <= host
    assert not host & {"click", "rich", "structlog", "prometheus-client", "spdk", "pyroute2"}


def test_vllm_connector_reads_everything_from_the_credentials_file(
    agent: AgentProcess, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="host_shim.integrations.vllm needs torch")
    from host_shim.integrations.vllm import ConnectorSettings

    out = tmp_path / "c.json"
    _enrol(agent, out)
    s = ConnectorSettings.from_extra_config({"credentials_file": str(out), "chunk_tokens": 64})
    creds = load_credentials(out)
    assert (s.control, s.tenant, s.token, s.salt) == (
        creds.control[0], "default", agent.token, creds.salt,
    )  # fmt: skip
    assert s.chunk_tokens == 64
