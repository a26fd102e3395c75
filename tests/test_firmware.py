"""dpuctl firmware: profiles against the schema, recorded mlxconfig queries (JSON and table),
plans, exit codes, and the real mstconfig's refusal on a machine without a BlueField."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent import firmware as fw
from dpu_agent.cli import cli

DATA = Path(__file__).parent / "data" / "firmware"
REPO = Path(__file__).parent.parent
MSTFLINT_DB = Path("/usr/share/mstflint/mlxconfig_dbs/mlxconfig_host.db")
SCHEMA = fw.load_schema()


def _doc(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _live(name: str) -> fw.DeviceConfig:
    return fw.parse_json_query(_doc(name))


def _profile_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "p.toml"
    path.write_text('[profile]\ndevice_types = ["BlueField3"]\n[parameters]\n' + body)
    return str(path)


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


# --- schema and profiles ------------------------------------------------------------------


@pytest.mark.skipif(
    not MSTFLINT_DB.exists(), reason="mstflint not installed (apt-get install mstflint)"
)
def test_schema_is_what_mstflint_database_says() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/firmware-schema-from-mstflint.py"), str(MSTFLINT_DB)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout == (REPO / "dpu_agent" / "firmware" / "schema.toml").read_text()


def test_every_shipped_profile_loads_and_only_uses_schema_parameters() -> None:
    names = fw.profile_names()
    assert {"bf3-storage", "bf3-storage-nocrypto", "bf2-storage", "bf3-nic-mode"} <= set(names)
    for name in names:
        p = fw.load_profile(name)
        assert p.parameters and all(fw.schema_param(SCHEMA, k) for k in p.parameters)


def test_nocrypto_profile_is_storage_without_crypto() -> None:
    full, nocrypto = fw.load_profile("bf3-storage"), fw.load_profile("bf3-storage-nocrypto")
    assert set(full.parameters) - set(nocrypto.parameters) == {
        "DATA_CRYPTO_ENGINE",
        "CRYPTO_POLICY",
    }
    assert nocrypto.device_types == ("BlueField3",)
    assert full.parameters["INTERNAL_CPU_MODEL"] == 1  # EMBEDDED_CPU: DPU mode
    assert fw.load_profile("bf3-nic-mode").parameters["INTERNAL_CPU_OFFLOAD_ENGINE"] == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("NO_SUCH_PARAM = 1\n", "unknown mlxconfig parameter"),
        ('LINK_TYPE = "ETH"\n', "per port; give LINK_TYPE_P1"),
        ('ROCE_CONTROL_P1 = "ROCE_ENABLE"\n', "not per port"),
        ('LINK_TYPE_P1 = "ETHERNET"\n', "one of IB, ETH"),
        ("LINK_TYPE_P1 = 3\n", "one of IB, ETH"),
        ("CNP_DSCP_P1 = 64\n", "integer 0..63"),
        ("CNP_DSCP_P1 = -1\n", "integer 0..63"),
        ("CNP_DSCP_P1 = true\n", "integer 0..63"),
        ("SRIOV_EN = 1\n", "boolean"),
        ("SRIOV_EN = \n", "not valid TOML"),
    ],
)
def test_profile_violations_name_parameter_and_allowed_values(
    tmp_path: Path, body: str, message: str
) -> None:
    with pytest.raises(fw.ProfileError, match=message):
        fw.load_profile(_profile_file(tmp_path, body))


def test_profile_extends_cycle_and_bad_remove_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('[profile]\nextends = "b"\n[parameters]\nSRIOV_EN = true\n')
    (tmp_path / "b.toml").write_text('[profile]\nextends = "a"\n[parameters]\nSRIOV_EN = true\n')
    with pytest.raises(fw.ProfileError, match="deeper than"):
        fw.load_profile(str(tmp_path / "a.toml"))
    (tmp_path / "c.toml").write_text(
        '[profile]\nextends = "bf3-storage"\nremove = ["NUM_OF_VFS"]\n'
    )
    with pytest.raises(fw.ProfileError, match="not in the base profile"):
        fw.load_profile(str(tmp_path / "c.toml"))
    with pytest.raises(fw.ProfileError, match="no firmware profile 'nope'"):
        fw.load_profile("nope")


# --- recorded queries ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shown", "code"),
    [(3, 3), ("3", 3), ("ETH(2)", 2), ("True(1)", 1), ("False(0)", 0), ("N/A", None),
     ("Array[0..7]", None), (None, None), (True, 1)],
)  # fmt: skip
def test_parse_value_reads_every_form_mlxconfig_prints(shown: object, code: int | None) -> None:
    assert fw.parse_value(shown) == code


def test_text_table_and_json_query_parse_to_the_same_configuration() -> None:
    from_json = _live("bf3_crypto_query.json")
    from_text = fw.parse_text_query((DATA / "bf3_crypto_query.txt").read_text())
    assert from_text.device_type == from_json.device_type == "BlueField3"
    assert from_text.params.keys() == from_json.params.keys()
    for name, p in from_json.params.items():
        t = from_text.params[name]
        assert (t.read_only, t.current, t.next_boot, t.default) == (
            p.read_only, p.current, p.next_boot, p.default,
        ), name  # fmt: skip
    assert from_json.params["MEMIC_BAR_SIZE"].read_only


def test_malformed_query_documents_are_value_errors() -> None:
    for bad in ({}, [], {"Device #1": {}}, {"Device #1": {"tlv_configuration": {"X": 1}}}):
        with pytest.raises(ValueError):
            fw.parse_json_query(bad)
    with pytest.raises(ValueError, match="Configurations"):
        fw.parse_text_query("-E- Failed to open the device\n")


# --- plans --------------------------------------------------------------------------------


def test_bf3_storage_plan_sets_differences_and_waits_for_pending_roce() -> None:
    p = fw.plan(fw.load_profile("bf3-storage"), _live("bf3_crypto_query.json"), SCHEMA)
    actions = {c.name: c.action for c in p.changes}
    assert actions["ROCE_CONTROL"] == "pending"  # next boot already ROCE_ENABLE
    assert actions["INTERNAL_CPU_MODEL"] == "ok"
    assert p.to_set["DATA_CRYPTO_ENGINE"] == 2 and p.to_set["PER_PF_NUM_SF"] == 1
    assert p.to_set["ROCE_CC_PRIO_MASK_P1"] == 8 and "CNP_DSCP_P1" not in p.to_set
    assert p.activation == "host_power_cycle"  # SF settings are PCI topology
    assert not p.conflicts and not p.in_sync


def test_crypto_profile_on_a_sku_without_crypto_is_a_conflict() -> None:
    p = fw.plan(fw.load_profile("bf3-storage"), _live("bf3_nocrypto_query.json"), SCHEMA)
    assert len(p.conflicts) == 2 and all("does not offer" in c for c in p.conflicts)
    ok = fw.plan(fw.load_profile("bf3-storage-nocrypto"), _live("bf3_nocrypto_query.json"), SCHEMA)
    assert not ok.conflicts


def test_profile_for_another_device_type_is_a_conflict() -> None:
    p = fw.plan(fw.load_profile("bf3-storage-nocrypto"), _live("bf2_query.json"), SCHEMA)
    assert any("is for BlueField3, the device is BlueField2" in c for c in p.conflicts)
    bf2 = fw.plan(fw.load_profile("bf2-storage"), _live("bf2_query.json"), SCHEMA)
    assert not bf2.conflicts and bf2.to_set["PF_TOTAL_SF"] == 2


def test_read_only_parameter_that_differs_is_a_conflict(tmp_path: Path) -> None:
    doc = _doc("bf3_crypto_query.json")
    doc["Device #1"]["tlv_configuration"]["CRYPTO_POLICY"]["read_only"] = True
    p = fw.plan(fw.load_profile("bf3-storage"), fw.parse_json_query(doc), SCHEMA)
    assert any("CRYPTO_POLICY is read-only" in c for c in p.conflicts)
    assert "CRYPTO_POLICY" not in p.to_set


def _converged(profile: str, *, current_too: bool) -> dict:
    """The recorded BF3 query after a set of `profile` (and, with current_too, a power cycle)."""
    doc = copy.deepcopy(_doc("bf3_crypto_query.json"))
    tlv = doc["Device #1"]["tlv_configuration"]
    for name, code in fw.load_profile(profile).parameters.items():
        tlv[name]["next_value"] = code
        if current_too:
            tlv[name]["current_value"] = code
    return doc


def test_status_exit_codes_in_sync_pending_and_drift(tmp_path: Path) -> None:
    f = tmp_path / "q.json"
    f.write_text(json.dumps(_converged("bf3-storage", current_too=True)))
    assert _invoke("firmware", "status", "--profile", "bf3-storage", "--query-file", str(f))[0] == 0
    f.write_text(json.dumps(_converged("bf3-storage", current_too=False)))
    code, out = _invoke(
        "firmware", "status", "--profile", "bf3-storage", "--query-file", str(f), "--json"
    )
    assert code == 5 and json.loads(out)["activation"] == "host_power_cycle"
    assert json.loads(out)["set"] == {}
    code, out = _invoke("firmware", "status", "--profile", "bf3-storage", "--query-file",
                        str(DATA / "bf3_crypto_query.json"))  # fmt: skip
    assert code == 1 and "DATA_CRYPTO_ENGINE" in out


def test_plan_cli_json_from_a_table_query_file() -> None:
    code, out = _invoke("firmware", "plan", "--profile", "bf3-storage", "--json",
                        "--query-file", str(DATA / "bf3_crypto_query.txt"))  # fmt: skip
    doc = json.loads(out)
    assert code == 0 and doc["set"]["QOS_TRUST_STATE_P1"] == "TRUST_DSCP(6)"
    assert doc["pending"] == ["ROCE_CONTROL"]


def test_plan_cli_errors_have_meaningful_codes(tmp_path: Path) -> None:
    q = str(DATA / "bf3_nocrypto_query.json")
    assert _invoke("firmware", "plan", "--profile", "bf3-storage", "--query-file", q)[0] == 1
    code, out = _invoke("firmware", "plan", "--profile", "nope", "--query-file", q, "--json")
    assert code == 4 and json.loads(out)["exit_code"] == 4
    (tmp_path / "bad.json").write_text("{not json")
    bad = str(tmp_path / "bad.json")
    assert _invoke("firmware", "plan", "--profile", "bf3-storage", "--query-file", bad)[0] == 4
    code, out = _invoke("firmware", "plan", "--profile", "bf3-storage")
    assert code == 2 and "--device" in out


def test_set_argv_is_one_yes_set_call_with_numbers() -> None:
    p = fw.plan(fw.load_profile("bf3-storage"), _live("bf3_crypto_query.json"), SCHEMA)
    argv = fw.set_argv("/usr/bin/mlxconfig", "/dev/mst/mt41692_pciconf0", p.to_set)
    assert argv[:5] == ["/usr/bin/mlxconfig", "-d", "/dev/mst/mt41692_pciconf0", "-y", "set"]
    assert "DATA_CRYPTO_ENGINE=2" in argv and "QOS_TRUST_STATE_P1=6" in argv
    assert len(argv) == 5 + len(p.to_set)


def test_missing_tool_is_unavailable() -> None:
    with pytest.raises(fw.FirmwareUnavailable, match="not found"):
        fw.find_tool("no-such-mlxconfig")
    code, out = _invoke("firmware", "plan", "--profile", "bf3-storage", "--device", "03:00.0",
                        "--tool", "no-such-mlxconfig", "--json")  # fmt: skip
    assert code == 3 and "mstflint" in json.loads(out)["error"]


# --- the real mstconfig (mstflint) ---------------------------------------------------------

needs_mstconfig = pytest.mark.skipif(
    shutil.which("mstconfig") is None, reason="mstconfig not installed (apt-get install mstflint)"
)


@needs_mstconfig
def test_real_mstconfig_without_the_device_fails_cleanly() -> None:
    tool = fw.find_tool("mstconfig")
    assert not tool.json  # mstflint 4.21 has no -j: the table parser is used
    with pytest.raises(fw.FirmwareUnavailable, match="Failed to open the device"):
        fw.query_device("/dev/mst/mt41692_pciconf0", tool)
    for cmd in ("plan", "status", "apply"):
        code, out = _invoke("firmware", cmd, "--profile", "bf3-storage", "--device", "03:00.0",
                            "--tool", "mstconfig", "--json")  # fmt: skip
        doc = json.loads(out)
        assert code == 3 and doc["ok"] is False and "03:00.0" in doc["error"], (cmd, out)


@needs_mstconfig
def test_real_mstconfig_refuses_set_without_the_device() -> None:
    tool = fw.find_tool("mstconfig")
    with pytest.raises(fw.FirmwareUnavailable, match="Failed to open"):
        fw.run_set("0000:03:00.0", tool, {"ROCE_CONTROL": 2})
