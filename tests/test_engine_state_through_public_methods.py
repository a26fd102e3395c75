"""Engine state is reached through Engine's public methods (`Engine.locked()` for the modules
that work on all of it at once: backup/restore and the cluster's anti-entropy), not by
reaching into its privates (`engine._lock`, `engine._index`, `engine._records`, ...), which
bypassed the open/writable checks and tied those modules to the engine's insides."""

from __future__ import annotations

import ast
from pathlib import Path

from dpu_agent.engine import EngineConfig
from dpu_agent.engine.engine import Engine, EngineState
from dpu_agent.engine.errors import EngineError

ROOT = Path(__file__).resolve().parents[1]
# The agent's runtime modules that hold an engine. The benchmarks are left out as tests are:
# they build variants of the engine to measure (bench/sync_stall.py's fsync under the lock).
SKIP = ("dpu_agent/engine/engine.py", "dpu_agent/bench/")
ENGINE_NAMES = {"engine", "eng", "_engine"}


def _engine_private_uses(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        if node.attr.startswith("__"):
            continue
        v = node.value
        name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""
        if name in ENGINE_NAMES:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}.{node.attr}")
    return out


def test_no_runtime_module_reaches_into_engine_privates() -> None:
    uses = [
        use
        for path in sorted((ROOT / "dpu_agent").rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(SKIP)
        for use in _engine_private_uses(path)
    ]
    assert not uses, uses


def test_locked_hands_out_the_state_and_refuses_a_closed_engine(tmp_path: Path) -> None:
    eng = Engine(EngineConfig(data_dir=tmp_path, dram_bytes=1 << 20, nvme_bytes=1 << 20))
    eng.add_tenant("t")
    with eng.locked() as st:
        assert isinstance(st, EngineState) and len(st.index) == 0
        assert st.tenant("t").name == "t"
        assert st.since_epoch() >= 0
    eng.close()
    try:
        with eng.locked():
            raise AssertionError("a closed engine handed out its state")
    except EngineError as e:
        assert "closed" in str(e)
    with eng.locked(check_open=False) as st:  # giving back what an earlier block took
        assert st.leases is not None
