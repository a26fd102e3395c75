"""DpuKVConnector with a fault injected between the scheduler's match and the worker's load.

Loaded by vLLM (in the vLLM venv) by module path from tests/test_engine_vllm.py. When the file
named by ``kv_connector_extra_config.fault_file`` exists, the worker deletes the chunk whose
index it holds from the agent just before loading (the file is consumed: one fault), the
failure an eviction, a lost chunk or a checksum miss causes; every block the connector then
reports failed is counted into ``fault_file + ".failed"``.
"""

from __future__ import annotations

import os
from typing import Any

from host_shim.integrations._vllm_connector import DpuKVConnector


class FaultyDpuKVConnector(DpuKVConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        path = self._kv_transfer_config.kv_connector_extra_config["fault_file"]
        if os.path.exists(path):
            with open(path) as f:
                chunk = int(f.read())
            os.unlink(path)
            n = self._layout.chunk_tokens
            for load in self._get_connector_metadata().loads:  # type: ignore[attr-defined]
                key = self._client.keys(list(load.token_ids[: (chunk + 1) * n]))[chunk]
                self._client.channel.call("delete", key=key)
        super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors()
        if failed:
            path = self._kv_transfer_config.kv_connector_extra_config["fault_file"] + ".failed"
            with open(path, "a") as f:
                f.write(f"{len(failed)}\n")
        return failed
