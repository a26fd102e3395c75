"""DpuKVConnector with faults injected between the scheduler's match and the worker's load.

Loaded by vLLM (in the vLLM venv) by module path from tests/test_engine_vllm.py. When the file
named by ``kv_connector_extra_config.fault_file`` exists, the worker deletes the chunk whose
index it holds from the agent just before loading (the file is consumed: one fault), the
failure an eviction, a lost chunk or a checksum miss causes; every block the connector then
reports failed is counted into ``fault_file + ".failed"``.

With ``kill_file`` set, the first load of the worker writes ``kill_file + ".loading"`` (the
time) and waits (at most KILL_WAIT_S) for the test to kill an agent and write
``kill_file + ".killed"``: the kill lands inside a request, after its match and lease and
before its chunks are read. With ``calls_file`` set, every connector call's duration (that
wait excluded) is appended to it as JSON lines, so the test can bound the longest one.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from host_shim.integrations._vllm_connector import DpuKVConnector

KILL_WAIT_S = 120.0  # the test kills within a second; a test that died must not hang vLLM


class FaultyDpuKVConnector(DpuKVConnector):
    def _extra(self, key: str) -> str:
        return str(self._kv_transfer_config.kv_connector_extra_config.get(key) or "")

    def _timed(self, method: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls_file = self._extra("calls_file")
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            if calls_file:
                with open(calls_file, "a") as f:
                    f.write(json.dumps({"method": method, "t0": t0, "s": time.time() - t0,
                                        "pid": os.getpid()}) + "\n")  # fmt: skip

    def _kill_point(self) -> None:
        kill_file = self._extra("kill_file")
        if not kill_file or os.path.exists(kill_file + ".loading"):
            return
        if not self._get_connector_metadata().loads:  # type: ignore[attr-defined]
            return
        with open(kill_file + ".loading", "w") as f:
            f.write(repr(time.time()))
        deadline = time.monotonic() + KILL_WAIT_S
        while not os.path.exists(kill_file + ".killed") and time.monotonic() < deadline:
            time.sleep(0.01)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        path = self._extra("fault_file")
        # only a step that loads: vLLM also calls this in steps that schedule nothing (a
        # request deferred while the start-up probe runs), and such a step consumed the fault
        loads = self._get_connector_metadata().loads  # type: ignore[attr-defined]
        if loads and os.path.exists(path):
            with open(path) as f:
                chunk = int(f.read())
            os.unlink(path)
            n = self._layout.chunk_tokens
            for load in loads:
                key = self._client.keys(list(load.token_ids[: (chunk + 1) * n]))[chunk]
                self._client.channel.call("delete", key=key)
        self._kill_point()
        self._timed("start_load_kv", super().start_load_kv, forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors()
        if failed:
            path = self._extra("fault_file") + ".failed"
            with open(path, "a") as f:
                f.write(f"{len(failed)}\n")
        return failed

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._timed(  # type: ignore[no-any-return]
            "get_num_new_matched_tokens", super().get_num_new_matched_tokens, request,
            num_computed_tokens,
        )  # fmt: skip

    def wait_for_save(self) -> None:
        self._timed("wait_for_save", super().wait_for_save)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._timed(  # type: ignore[no-any-return]
            "request_finished", super().request_finished, request, block_ids
        )
