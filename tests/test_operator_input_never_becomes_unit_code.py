"""Operator input used to become root code: a firmware profile whose `name` held a newline put
`ExecStartPre=/bin/sh -c ...` into the root-run dpukv-firstboot.service that the bf.cfg hook
installs and enables (and `systemd-analyze verify` accepted it); the same through
`--firmware-device`. bf.cfg was written 0644 while holding `--set ubuntu_PASSWORD`. An
interface name check accepted `p0\\n`, `.` and `..`; a netns of `../..` ended in a traceback.

Now every value written into a unit or bf.cfg is checked against a strict pattern where it
enters (exit 4 naming it) and written quoted for the language it lands in; bf.cfg is 0600 when
it holds a secret; interface and netns names follow the kernel's rules, strictly.
"""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_provision import _config, _fake_wheelhouse, needs_verify

from dpu_agent import net
from dpu_agent import provision as pv
from dpu_agent.cli import cli

REPO = Path(__file__).parent.parent
INJECTED = "ExecStartPre=/bin/sh -c 'touch /tmp/dpukv-pwned'"


def _provision(tmp_path: Path, *extra: str) -> tuple[int, dict, Path]:
    out = tmp_path / "bf.cfg"
    wheelhouse = tmp_path / "wh" if (tmp_path / "wh").is_dir() else _fake_wheelhouse(tmp_path)
    r = CliRunner().invoke(cli, ["provision", "--config", str(_config(tmp_path)), "--wheelhouse",
                                 str(wheelhouse), "--write-cfg", str(out),
                                 "--json", *extra])  # fmt: skip
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), (
        r.output,
        r.exception,
    )  # a clear error, never a traceback
    return r.exit_code, json.loads(r.output), out


def _firstboot_unit(bf_cfg: Path) -> str:
    r = subprocess.run(["bash", "-c", f"source {bf_cfg} && dpukv_payload | tar -xO "
                        "systemd/dpukv-firstboot.service"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    return r.stdout


def test_profile_name_with_a_newline_cannot_add_a_unit_directive(tmp_path: Path) -> None:
    profile = tmp_path / "evil.toml"
    source = (REPO / "firmware_profiles" / "bf3-storage.toml").read_text()
    hostile = json.dumps(f"bf3-storage.toml\n{INJECTED}\n#")  # a TOML basic string
    profile.write_text(source.replace('name = "bf3-storage"', f"name = {hostile}"))
    code, doc, out = _provision(tmp_path, "--profile", str(profile))
    # used to be exit 0 with the injected line in the root-run first-boot unit
    assert code == 4 and "name" in doc["error"], doc
    assert not out.exists() or "/tmp/dpukv-pwned" not in _firstboot_unit(out)


@pytest.mark.parametrize(
    "device",
    [f"03:00.0\n{INJECTED}", "03:00.0 --profile /tmp/x.toml", "/dev/mst/../../bin/sh", "$(id)"],
)
def test_firmware_device_cannot_add_a_directive_or_an_argument(tmp_path: Path, device: str) -> None:
    code, doc, out = _provision(tmp_path, "--profile", "bf3-storage", "--firmware-device", device)
    assert code == 4 and "--firmware-device" in doc["error"], doc
    assert not out.exists()


def test_firstboot_unit_refuses_what_the_entry_checks_missed() -> None:
    from dpu_agent.provision._units import UnitValueError, exec_arg

    with pytest.raises(UnitValueError):
        pv.firstboot_unit(f"x\n{INJECTED}", ("03:00.0",), False)
    with pytest.raises(UnitValueError):
        pv.firstboot_unit("bf3-storage", (f"03:00.0\n{INJECTED}",), False)
    with pytest.raises(UnitValueError):
        exec_arg("a\nb")
    # specifiers, environment expansion, quotes and backslashes stay one literal word
    assert exec_arg('/opt/dpu kv/100%$HOME"\\') == '"/opt/dpu kv/100%%$$HOME\\"\\\\"'
    assert exec_arg("/dev/mst/mt41692_pciconf0.1") == "/dev/mst/mt41692_pciconf0.1"
    assert exec_arg("/opt/a b$X%n", command=True) == '"/opt/a b$X%%n"'  # no $ expansion there
    with pytest.raises(UnitValueError, match="systemd refuses"):
        exec_arg('/opt/a"b', command=True)


@needs_verify
def test_a_hostile_prefix_is_one_word_that_systemd_reads_back(tmp_path: Path) -> None:
    """The quoting is right when systemd finds the executable at exactly that path."""
    prefix = tmp_path / "dpu kv$HOME%n"  # a space, an environment variable, a specifier
    exe = prefix / "venv" / "bin" / "dpuctl"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    for name, text in (
        (pv.AGENT_UNIT, pv.agent_unit(str(prefix))),
        (pv.FIRSTBOOT_UNIT, pv.firstboot_unit("bf3-storage", ("0000:03:00.0",), True,
                                              str(prefix))),
    ):  # fmt: skip
        path = tmp_path / name
        path.write_text(text)
        r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                           text=True, check=False)  # fmt: skip
        assert r.returncode == 0 and "not executable" not in r.stderr, (name, r.stderr)
        directives = [line.split("=", 1)[0] for line in text.splitlines() if "=" in line]
        assert all(d[:1].isalpha() and d.isalnum() for d in directives), directives


def test_bf_cfg_holding_a_password_is_0600(tmp_path: Path) -> None:
    code, _, out = _provision(tmp_path, "--set", "ubuntu_PASSWORD=$1$salt$hash")
    assert code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # was 0644
    out.chmod(0o644)  # an existing world-readable file is tightened before the secret goes in
    code, _, out = _provision(tmp_path, "--set", "BMC_PASSWORD=x")
    assert code == 0 and stat.S_IMODE(out.stat().st_mode) == 0o600
    code, _, out = _provision(tmp_path, "--set", "UPDATE_DPU_OS=yes")
    assert code == 0 and stat.S_IMODE(out.stat().st_mode) == 0o644  # nothing secret in it
    code, doc, _ = _provision(tmp_path, "--set", f"UPDATE_DPU_OS=yes\n{INJECTED}")
    assert code == 4 and "control characters" in doc["error"]


@pytest.mark.parametrize(
    "name", ["p0\n", ".", "..", "p0/x", "p0:1", "p 0", "p0\t", "a" * 16, "é" * 8, ""]
)
def test_interface_names_follow_the_kernels_rules(name: str) -> None:
    with pytest.raises(net.NetConfigError, match="interface name"):
        net.parse_net({"interfaces": [{"name": name}]})


def test_interface_names_the_kernel_takes_still_pass() -> None:
    for name in ("p0", "pf0hpf", "en3f0pf0sf0", "p0.100", "a" * 15, "br_0-x"):
        assert net.parse_net({"interfaces": [{"name": name}]}).interfaces[0].name == name


@pytest.mark.parametrize("netns", ["../..", "..", ".", "a/b", "ns\n", "n s"])
def test_hostile_netns_is_a_clear_error_not_a_traceback(tmp_path: Path, netns: str) -> None:
    with pytest.raises(net.NetConfigError, match="network namespace name"):
        net.parse_net({"netns": netns, "interfaces": []})
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[net]\n[[net.interfaces]]\nname = "p0"\n')
    r = CliRunner().invoke(cli, ["net", "plan", "--config", str(cfg), "--netns", netns, "--json"])
    assert isinstance(r.exception, SystemExit) and r.exit_code == 4, (r.output, r.exception)
    assert "network namespace name" in json.loads(r.output)["error"]
