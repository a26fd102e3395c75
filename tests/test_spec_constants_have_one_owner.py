"""The NVMe spec's numbers have one owner, kvproto.nvme: the 4096-byte block was written as
BLOCK_SIZE / BLOCK_BYTES / BLOCK_BYTES in three modules, and the host wrote the admin queue's
8 KiB in-capsule size as a bare 8192 where the target named it; a change to one would have
left the others behind."""

from __future__ import annotations

import ast
from pathlib import Path

import dpu_agent.blockdev
import dpu_agent.config
import dpu_agent.nvmf
import host_shim.client
from kvproto import nvme

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("dpu_agent", "host_shim", "kvproto", "spdk_plugins")
OWNER = ROOT / "kvproto" / "nvme" / "_commands.py"


def test_block_and_admin_icd_sizes_are_kvprotos() -> None:
    assert nvme.BLOCK_BYTES == 4096 and nvme.ADMIN_ICD_BYTES == 8192
    assert dpu_agent.blockdev.BLOCK_SIZE is nvme.BLOCK_BYTES
    assert dpu_agent.config.BLOCK_BYTES is nvme.BLOCK_BYTES
    assert host_shim.client.BLOCK_BYTES is nvme.BLOCK_BYTES
    assert dpu_agent.nvmf.ADMIN_ICD_BYTES is nvme.ADMIN_ICD_BYTES


def test_no_second_definition_of_a_spec_size() -> None:
    """No runtime module but the owner binds a BLOCK/ICD name to a number, and the NVMe host
    does not write the admin in-capsule size as a bare literal."""
    found = []
    for pkg in RUNTIME:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == OWNER:
                continue
            rel = str(path.relative_to(ROOT))
            host_nvme = rel.startswith("host_shim/nvme/")
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    for t in node.targets:
                        if (
                            isinstance(t, ast.Name)
                            and (t.id.startswith("BLOCK_") or "ICD" in t.id)
                            and node.value.value in (4096, 8192)
                        ):
                            found.append(f"{rel}:{node.lineno} {t.id}")
                if host_nvme and isinstance(node, ast.Constant) and node.value == 8192:
                    found.append(f"{rel}:{node.lineno} literal {node.value}")
    assert not found, found
