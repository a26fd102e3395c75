"""dpuctl provision: the generated bf.cfg passes `bash -n`; its bfb_modify_os hook, run against
a scratch directory standing in for /mnt, installs an agent whose dpuctl runs; the units pass
`systemd-analyze verify`; bfb-install's progress lines and its absence."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent import __version__
from dpu_agent import provision as pv
from dpu_agent.cli import cli

REPO = Path(__file__).parent.parent
DATA = Path(__file__).parent / "data" / "provision"
SPDK_EXAMPLE = REPO / "spdk_plugins" / "examples" / "agent-spdk.toml"
HOOK_TIMEOUT_S = 240  # venv + ~30 wheels + the AES-XTS build on a loaded 2-core machine
needs_verify = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze missing (apt-get install systemd)",
)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dpu-kvtier's wheel plus its runtime dependencies, for this interpreter (the script the
    docs give; pip takes them from the configured index)."""
    out = tmp_path_factory.mktemp("wheelhouse")
    env = {**os.environ, "PY": sys.executable}
    r = subprocess.run([str(REPO / "scripts/build-wheelhouse.sh"), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot build the wheelhouse (package index unreachable?): {r.stderr[-300:]}")
    return out


def _config(tmp_path: Path, extra: str = "", name: str = "agent.toml") -> Path:
    cfg = tmp_path / name
    cfg.write_text('[agent]\nnode_name = "dpu-a"\n[net]\n[[net.interfaces]]\nname = "p0"\n'
                   'mtu = 9000\naddresses = ["192.0.2.10/24"]\n' + extra)  # fmt: skip
    return cfg


def _fake_wheelhouse(tmp_path: Path, with_ours: bool = True) -> Path:
    """Names only: enough for bf.cfg syntax and refusal checks (nothing is installed)."""
    wh = tmp_path / "wh"
    wh.mkdir(parents=True)
    if with_ours:
        (wh / f"dpu_kvtier-{__version__}-py3-none-any.whl").write_bytes(b"PK")
    (wh / "click-8.1.7-py3-none-any.whl").write_bytes(b"PK")
    return wh


def _bash_n(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


def test_bf_cfg_passes_bash_n_and_carries_settings_units_and_spdk_json(tmp_path: Path) -> None:
    out = tmp_path / "bf.cfg"
    r = CliRunner().invoke(cli, ["provision", "--config", str(SPDK_EXAMPLE), "--wheelhouse",
                                 str(_fake_wheelhouse(tmp_path)), "--profile", "bf3-storage",
                                 "--set", "UPDATE_DPU_OS=yes", "--set", "ubuntu_PASSWORD=$1$x y",
                                 "--write-cfg", str(out), "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.output)["manifest"]
    assert manifest["spdk_json"] and manifest["firmware_profile"] == "bf3-storage"
    assert manifest["firmware_devices"] == [
        "/dev/mst/mt41692_pciconf0",
        "/dev/mst/mt41692_pciconf0.1",
    ]  # both PFs
    check = _bash_n(out)
    assert check.returncode == 0, check.stderr
    text = out.read_text()
    assert "UPDATE_DPU_OS=yes\n" in text and "ubuntu_PASSWORD='$1$x y'" in text
    assert "bfb_modify_os() {" in text and "DPUKV_PAYLOAD_END" in text
    sourced = subprocess.run(["bash", "-c", f"source {out} && dpukv_payload | tar -t"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    names = set(sourced.stdout.split())
    assert {"etc/dpukv/agent.toml", "etc/dpukv/spdk.json", "systemd/dpukv-agent.service",
            "systemd/dpukv-firstboot.service", "sysusers.d/dpukv.conf",
            "etc/dpukv/firmware_profiles/bf3-storage.toml"} <= names  # fmt: skip


def test_bad_inputs_are_refused_with_exit_4(tmp_path: Path) -> None:
    wh = _fake_wheelhouse(tmp_path)
    run = CliRunner().invoke
    cases = [
        (_config(tmp_path, '[tenants.a]\ntoken = "s3cret"\n', "tok.toml"), wh, [], "inline tokens"),
        (_config(tmp_path), wh, ["--set", "UPDATE_DPU_OSS=yes"], "unknown bf.cfg settings"),
        (_config(tmp_path), wh, ["--profile", "nope"], "no firmware profile"),
        (_config(tmp_path), tmp_path, [], "no dpu_kvtier wheel"),
    ]
    for cfg, house, extra, message in cases:
        r = run(cli, ["provision", "--config", str(cfg), "--wheelhouse", str(house),
                      "--write-cfg", str(tmp_path / "x.cfg"), "--json", *extra])  # fmt: skip
        assert r.exit_code == 4 and message in json.loads(r.output)["error"], (message, r.output)
    bfb = tmp_path / "x.bfb"
    bfb.write_bytes(b"\0")  # present: the refusal is about the missing --rshim
    r = run(cli, ["provision", "--config", str(_config(tmp_path)), "--bfb", str(bfb)])
    assert r.exit_code == 2 and "--rshim" in r.output


def test_bfb_install_absent_is_a_clear_error(tmp_path: Path) -> None:
    bfb = tmp_path / "dpu.bfb"
    bfb.write_bytes(b"\0" * 16)
    for exe in ("bfb-install", "no-such-bfb-install"):
        if exe == "bfb-install" and shutil.which(exe):
            continue  # a machine with the rshim package: only the explicit missing one
        r = CliRunner().invoke(cli, ["provision", "--config", str(_config(tmp_path)),
                                     "--wheelhouse", str(_fake_wheelhouse(tmp_path / exe)),
                                     "--bfb", str(bfb), "--rshim", "rshim0",
                                     "--bfb-install", exe, "--json"])  # fmt: skip
        doc = json.loads(r.output)
        assert r.exit_code == 3 and "rshim package" in doc["error"], r.output


def test_progress_lines_of_a_recorded_install() -> None:
    events = [e for ln in (DATA / "bfb-install.log").read_text().splitlines()
              if (e := pv.parse_progress(ln)) is not None]  # fmt: skip
    assert [e.percent for e in events if e.percent is not None] == [10, 45, 80, 95, 100]
    assert events[-1].step == "DPU is ready" and not any(e.failed for e in events)
    failed = pv.parse_progress("BFB-Installer: Installing NIC firmware failed, total 80% complete")
    assert failed is not None and failed.failed and failed.step == "NIC firmware"
    assert pv.parse_progress(" INFO[MISC]: CRITICAL ERROR: no disk").failed  # type: ignore[union-attr]
    assert pv.parse_progress("1.41GiB 0:01:42 [14.1MiB/s]") is None


def test_rshim_names() -> None:
    bfb, cfg = Path("a.bfb"), Path("bf.cfg")
    for ok in ("rshim0", "bmc-1:rshim0", "10.0.0.5:9527:rshim1"):
        assert pv.bfb_install_argv(bfb, ok, cfg)[4] == ok
    for bad in ("rshim", "/dev/rshim0", "host:rshimX", "rshim0; reboot"):
        with pytest.raises(pv.BfbInstallError, match="expected rshimN"):
            pv.bfb_install_argv(bfb, bad, cfg)


def _replay(tmp_path: Path, code: int) -> str:
    """Replays the recorded output (no BlueField here): exercises our streaming, not bfb-install."""
    script = tmp_path / f"replay-{code}"
    script.write_text(f"#!/bin/sh\ncat {DATA / 'bfb-install.log'}\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_streaming_reports_progress_and_failure_tail(tmp_path: Path) -> None:
    seen: list[pv.BfbProgress] = []
    tail = pv.run_bfb_install([_replay(tmp_path, 0), "--bfb", "x"], seen.append)
    assert seen[-1].step == "DPU is ready" and tail[-1].endswith("DPU is ready")
    with pytest.raises(pv.BfbInstallError, match=r"exit 1") as e:
        pv.run_bfb_install([_replay(tmp_path, 1)], lambda _: None)
    assert e.value.returncode == 1 and "DPU is ready" in e.value.tail[-1]


@needs_verify
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = tmp_path / "venv" / "bin" / "dpuctl"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    prefix = str(tmp_path)
    units = {
        pv.AGENT_UNIT: pv.agent_unit(prefix),
        pv.FIRSTBOOT_UNIT: pv.firstboot_unit("bf3-storage", ("03:00.0", "03:00.1"), True, prefix),
    }
    for name, text in units.items():
        path = tmp_path / name
        path.write_text(text)
        r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and "Unknown" not in r.stderr, (name, r.stderr)
    agent = units[pv.AGENT_UNIT]
    for line in ("Type=notify", "Restart=on-failure", "ProtectSystem=strict", "PrivateTmp=yes",
                 "CapabilityBoundingSet=\n", "WatchdogSec="):  # fmt: skip
        assert line in agent


@pytest.mark.slow
@needs_verify
def test_hook_installs_a_runnable_agent_into_a_scratch_root(
    tmp_path: Path, wheelhouse: Path
) -> None:
    cfg_path = tmp_path / "bf.cfg"
    inputs = pv.ProvisionInputs(
        config=_config(tmp_path), wheelhouse=wheelhouse, profile="bf3-storage-nocrypto"
    )
    text, manifest = pv.render_bf_cfg(inputs)
    assert manifest["net"] and len(manifest["wheels"]) > 10
    cfg_path.write_text(text)
    assert _bash_n(cfg_path).returncode == 0
    root = tmp_path / "mnt"
    root.mkdir()
    env = {**os.environ, "DPUKV_TARGET_ROOT": str(root), "DPUKV_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the installed agent must run from its own venv
    r = subprocess.run(["bash", "-c", f"source {cfg_path} && bfb_modify_os"], env=env,
                       capture_output=True, text=True, timeout=HOOK_TIMEOUT_S)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    dpuctl = root / "opt/dpukv/venv/bin/dpuctl"
    out = subprocess.run([str(dpuctl), "--version"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout, out
    profiles = root / "etc/dpukv/firmware_profiles"  # /etc/dpukv/... on the DPU
    penv = {**env, "DPUKV_FIRMWARE_PROFILES": str(profiles)}
    listed = subprocess.run([str(dpuctl), "firmware", "profiles", "--json"], env=penv,
                            capture_output=True, text=True)  # fmt: skip
    assert "bf3-storage-nocrypto" in json.loads(listed.stdout), listed.stderr
    query = REPO / "tests/data/firmware/bf3_nocrypto_query.json"
    plan = subprocess.run([str(dpuctl), "firmware", "plan", "--json", "--query-file", str(query),
                           "--profile", str(profiles / "bf3-storage-nocrypto.toml")],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert plan.returncode == 0 and json.loads(plan.stdout)["set"], plan.stderr  # schema.toml
    etc = root / "etc"
    assert (etc / "dpukv/agent.toml").read_text() == _config(tmp_path).read_text()
    assert (etc / "dpukv/firstboot").exists() and (etc / "dpukv/firmware_profiles").is_dir()
    assert (root / "usr/lib/sysusers.d/dpukv.conf").read_text().startswith("u dpukv")
    wants = etc / "systemd/system/multi-user.target.wants"
    assert os.readlink(wants / pv.AGENT_UNIT) == f"../{pv.AGENT_UNIT}"
    for unit in (pv.AGENT_UNIT, pv.FIRSTBOOT_UNIT):  # as installed, paths moved into the root
        text = (
            (etc / "systemd/system" / unit).read_text().replace("/opt/dpukv", f"{root}/opt/dpukv")
        )
        (tmp_path / unit).write_text(text)
        v = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit)],
                           capture_output=True, text=True)  # fmt: skip
        assert v.returncode == 0, v.stderr
    assert "installed: dpuctl, version" in r.stderr
