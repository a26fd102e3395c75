"""`dpuctl spdk plan --saved FILE`: the plan against a saved SPDK configuration, no target.

Checked three ways: against the recordings of one real v26.05 target (its live answers and its
save_config give the same plan), against the live peer (apply, save_config, plan offline: in
sync; a change planned offline equals the one planned live), and through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from spdk_peer import free_port, needs_spdk, spdk_tgt
from spdk_sim.fixtures import SHARED_SPDK, config_doc, key_provider

from dpu_agent.cli import cli
from dpu_agent.crypto.keystore import env_var_name
from spdk_plugins import SpdkClient, apply, parse_desired, plan, plan_from_live, read_live
from spdk_plugins.plan import plan_saved
from spdk_plugins.saved import SavedConfigError, load_saved

RECORDED_KEY = ("00112233445566778899aabbccddeeff", "ffeeddccbbaa99887766554433221100")

# the recorded target's layout: malloc + aio -> crypto -> lvstore -> lvol, exported over TCP
RECORDED_DESIRED = {
    "spdk": {
        "keys": [{"name": "key0", "cipher": "AES_XTS"}],
        "bdevs": [
            {"type": "malloc", "name": "Malloc0", "block_size": 512, "num_blocks": 131072},
            {"type": "aio", "name": "AIO0", "filename": "/var/lib/spdk/aio0.img",
             "block_size": 512},
        ],
        "crypto": [{"name": "crypto0", "base_bdev_name": "AIO0", "key_name": "key0"}],
        "lvstores": [{"lvs_name": "lvs0", "bdev_name": "crypto0", "cluster_sz": 4194304}],
        "lvols": [{"lvs_name": "lvs0", "lvol_name": "lvol0", "size_in_mib": 128}],
        "transports": [{"trtype": "TCP"}],
        "subsystems": [{
            "nqn": "nqn.2016-06.io.spdk:cnode1",
            "allow_any_host": True,
            "serial_number": "SPDK00000000000001",
            "model_number": "SPDK held-out peer",
            "namespaces": [{"nsid": 1, "bdev_name": "lvs0/lvol0"},
                           {"nsid": 2, "bdev_name": "Malloc0"}],
            "listeners": [{"trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": "4420"}],
        }],
    }
}  # fmt: skip


class _Recorded:
    """Answers read_live's calls with what the real target answered (tests/data/spdk)."""

    def _load(self, name: str) -> Any:
        return json.loads((SHARED_SPDK / f"{name}.json").read_text())

    def rpc_get_methods(self, *, current: bool | None = None) -> list[str]:
        return list(self._load("rpc_methods"))

    def accel_get_module_info(self) -> Any:
        return self._load("accel_get_module_info")

    def bdev_get_bdevs(self) -> Any:
        return self._load("bdev_get_bdevs")

    def accel_crypto_keys_get(self) -> Any:
        return self._load("accel_crypto_keys_get")

    def bdev_lvol_get_lvstores(self) -> Any:
        return self._load("bdev_lvol_get_lvstores")

    def nvmf_get_transports(self) -> Any:
        return self._load("nvmf_get_transports")

    def nvmf_get_subsystems(self) -> Any:
        return self._load("nvmf_get_subsystems")

    def framework_get_config(self, *, name: str) -> Any:
        saved = self._load("save_config")
        return next(s["config"] for s in saved["subsystems"] if s["subsystem"] == name)


def _recorded_keys(name: str) -> tuple[str, str]:
    return RECORDED_KEY


def test_saved_config_of_a_real_target_plans_like_its_live_answers() -> None:
    desired = parse_desired(RECORDED_DESIRED)
    live = plan_from_live(desired, read_live(_Recorded()))  # type: ignore[arg-type]
    offline, notes = plan_saved(
        desired, load_saved(SHARED_SPDK / "save_config.json"), _recorded_keys
    )
    assert live.in_sync, live.to_json()
    assert offline.to_json() == live.to_json()
    assert any("lvol lvs0/lvol0" in n for n in notes) and any("lvstore lvs0" in n for n in notes)


def test_saved_config_differences_are_planned() -> None:
    doc = dict(RECORDED_DESIRED)
    spdk = json.loads(json.dumps(doc["spdk"]))
    spdk["bdevs"][1]["filename"] = "/var/lib/spdk/other.img"  # immutable: a conflict
    spdk["subsystems"][0]["hosts"] = [
        "nqn.2014-08.org.nvmexpress:uuid:" + "1" * 8 + "-2222-3333-4444-555555555555"
    ]
    spdk["subsystems"][0]["allow_any_host"] = False
    result, _ = plan_saved(
        parse_desired({"spdk": spdk}), load_saved(SHARED_SPDK / "save_config.json")
    )
    methods = [s.method for s in result.steps]
    assert "nvmf_subsystem_add_host" in methods and "nvmf_subsystem_allow_any_host" in methods
    assert any("filename" in c for c in result.conflicts)


def test_saved_key_differing_from_the_key_store_is_a_conflict() -> None:
    desired = parse_desired(RECORDED_DESIRED)
    other = ("0f" * 16, "f0" * 16)
    result, _ = plan_saved(desired, load_saved(SHARED_SPDK / "save_config.json"), lambda n: other)
    assert any("key key0" in c and "differs from the key store" in c for c in result.conflicts)


@pytest.mark.parametrize(
    ("text", "why"),
    [("[1, 2]", "not a saved SPDK configuration"), ("{", "not JSON"),
     ('{"subsystems": [{"subsystem": "bdev", "config": [{"params": {}}]}]}', "without a method")],
)  # fmt: skip
def test_a_file_that_is_not_a_saved_config_is_refused(tmp_path: Path, text: str, why: str) -> None:
    f = tmp_path / "x.json"
    f.write_text(text)
    with pytest.raises(SavedConfigError, match=why):
        plan_saved(parse_desired(RECORDED_DESIRED), load_saved(f))


@pytest.mark.parametrize(
    ("method", "field", "value", "why"),
    [("nvmf_subsystem_add_ns", "namespace", [1], "params.namespace is not an object"),
     ("nvmf_create_subsystem", "nqn", [1], "params.nqn is not a string"),
     ("bdev_malloc_create", "name", {"a": 1}, "params.name is not a string"),
     ("bdev_malloc_create", "num_blocks", "many", "params.num_blocks is not an integer"),
     ("nvmf_subsystem_add_listener", "listen_address", "x", "params.listen_address is not")],
)  # fmt: skip
def test_a_saved_call_with_a_field_of_the_wrong_type_is_refused_naming_it(
    tmp_path: Path, method: str, field: str, value: Any, why: str
) -> None:
    """A saved config is input: a list where SPDK writes a name crashed the planner
    (TypeError: unhashable type) instead of naming the call and the field."""
    doc = json.loads((SHARED_SPDK / "save_config.json").read_text())
    hits = [c for s in doc["subsystems"] for c in s["config"] or [] if c["method"] == method]
    assert hits
    hits[0]["params"][field] = value
    f = tmp_path / "saved.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(SavedConfigError, match=f"{method}: {why}"):
        plan_saved(parse_desired(RECORDED_DESIRED), load_saved(f))
    with pytest.raises(SavedConfigError, match=why):  # a document handed over in memory too
        plan_saved(parse_desired(RECORDED_DESIRED), doc)


def _toml(value: Any) -> str:
    return json.dumps(value).replace("true", "true").replace("false", "false")


def _write_config(tmp_path: Path, doc: dict[str, Any]) -> Path:
    """The desired state as the agent's TOML ([spdk] with arrays of tables)."""
    lines = ["[spdk]"]

    def emit(prefix: str, table: dict[str, Any]) -> None:
        for k, v in table.items():
            if not (isinstance(v, list) and v and isinstance(v[0], dict)):
                lines.append(f"{k} = {_toml(v)}")
        for k, v in table.items():
            if isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    lines.append(f"[[{prefix}.{k}]]")
                    emit(f"{prefix}.{k}", item)

    emit("spdk", doc["spdk"])
    path = tmp_path / "agent.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_plans_offline_and_names_its_assumptions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _write_config(tmp_path, RECORDED_DESIRED)
    # the key store holds AES-XTS-256 keys; the recorded target's key0 is a 128-bit test key,
    # so the store's key0 differs from the saved one: the plan says so and shows neither
    monkeypatch.setenv(env_var_name("key0"), "0f" * 32 + "f0" * 32)
    saved = str(SHARED_SPDK / "save_config.json")

    def run(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(cli, ["spdk", "plan", "--config", str(cfg), *args])
        return r.exit_code, r.output

    code, out = run("--saved", saved)
    assert code == 1, out  # a conflict: apply would refuse
    lines = out.splitlines()
    assert lines[0] == f"offline, against {saved}"
    assert "assumed lvol lvs0/lvol0: assumed present as desired" in lines
    assert [x for x in lines if x.startswith("CONFLICT")] == [
        "CONFLICT spdk.keys[0]: key key0 on the target differs from the key store; rotating a "
        "key in use re-encrypts nothing: recreate its crypto vbdev (data loss)"
    ]
    code, out = run("--saved", saved, "--json")
    assert code == 1 and json.loads(out)["steps"] == []
    for k in (*RECORDED_KEY, "0f" * 32):
        assert k not in out  # the saved config holds key material; the plan never shows it
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    code, out = run("--saved", str(bad))
    assert code == 4 and "not a saved SPDK configuration" in out and "Traceback" not in out


@needs_spdk
def test_live_target_saved_config_plans_in_sync_and_like_live(tmp_path: Path) -> None:
    aio = tmp_path / "disk0.img"
    with open(aio, "wb") as f:
        f.truncate(64 * 1024 * 1024)
    doc = config_doc(str(aio))
    # a free port: 4420 is the agent's own default (`make run` beside the tests has it)
    doc["spdk"]["subsystems"][0]["listeners"][0]["trsvcid"] = str(free_port())
    desired = parse_desired(doc)
    with spdk_tgt(tmp_path) as app, SpdkClient(str(app.sock), timeout_s=30) as c:
        apply(desired, c, key_provider)
        # what `rpc.py save_config` writes: it is built client-side from these two methods
        saved = {
            "subsystems": [
                {"subsystem": s["subsystem"], "config": c.framework_get_config(name=s["subsystem"])}
                for s in c.framework_get_subsystems()
            ]
        }
        offline, notes = plan_saved(desired, saved, key_provider)
        assert offline.in_sync, offline.to_json()
        assert notes  # the lvstore and lvol were assumed, and said so
        # a change: one more host on the subsystem, planned offline and live
        sub = doc["spdk"]["subsystems"][0]
        sub["hosts"] = [
            *sub["hosts"],
            "nqn.2014-08.org.nvmexpress:uuid:" + "9" * 8 + "-8888-7777-6666-555555555555",
        ]
        changed = parse_desired(doc)
        live = plan(changed, c, key_provider)
        off, _ = plan_saved(changed, saved, key_provider)
        assert live.steps and off.to_json() == live.to_json()
