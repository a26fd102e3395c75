"""Runs real LMCache (0.5.6, CPU torch) against the tier's plugin, in LMCache's own venv.

    .venv-lmcache/bin/python -m dpu_agent.bench.lmcache_run SPEC.json

prints one JSON line. The spec's ``mode``:

- ``store`` / ``retrieve``: an `LMCacheEngine` (chunks of 256 tokens, local CPU cache on, the
  agent as its remote backend through ``remote_storage_plugins: ["dpukv"]``) stores the KV of
  ``tokens`` tokens (seeded random bytes) or retrieves it into zeroed KV, and says whether
  every retrieved byte equals what was stored. LMCache's GPU connectors all need CUDA, so the
  KV is a CPU tensor moved by `_CpuKV` (LMCache's `GPUConnectorInterface`, plain copies).
- ``bench``: `RemoteBackend` batched put then get of ``mib`` MiB of LMCache objects (SmolLM2's
  256-token chunks: 11.25 MiB each), first to LMCache's own ``lm://`` server (started here),
  then to the agent through the plugin, ``repeats`` times, interleaved; GB/s of each.

Only LMCache, torch and host_shim are imported here (the LMCache venv has no agent).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

__all__ = ["main"]

LAYERS, HEADS, HEAD_DIM, CHUNK = 30, 3, 64, 256  # SmolLM2-135M's KV, LMCache chunks
PUT_WAIT_S_MAX = 120.0  # a put of 256 MiB takes well under a second; a stuck one fails the run
SERVER_START_S_MAX = 60.0


def _config(spec: dict[str, Any], *, remote: str) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    extra = {
        "remote_storage_plugin.dpukv.module_path": "host_shim.integrations.lmcache",
        "remote_storage_plugin.dpukv.class_name": "DpuKVConnectorAdapter",
        "dpukv.control": spec["control"],
        "dpukv.tenant": spec["tenant"],
        "dpukv.token": spec["token"],
        "dpukv.salt": spec["salt"],
        "dpukv.timeout_s": spec.get("timeout_s", 30.0),  # a shared 2-core test machine
    }
    if spec.get("io_queues"):
        extra["dpukv.io_queues"] = spec["io_queues"]
    kw: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": spec.get("local_cpu", True),
        "max_local_cpu_size": spec.get("max_local_cpu_gb", 1.0),
        "remote_serde": "naive",
        "save_unfull_chunk": True,  # a partial last chunk too, an object of its size
        "extra_config": extra,
    }
    if remote == "dpukv":
        kw["remote_storage_plugins"] = ["dpukv"]
    else:
        kw["remote_url"] = remote
    return LMCacheEngineConfig.from_defaults(**kw)


def _metadata() -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name="SmolLM2-135M", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float32, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )  # fmt: skip


def _kv(tokens: int, seed: int) -> torch.Tensor:
    """KV in LMCache's KV_2LTD order, [2, layers, tokens, heads*dim]: random bits, NaNs too."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31 - 1, (2, LAYERS, tokens, HEADS * HEAD_DIM), generator=g)
    return raw.to(torch.int32).view(torch.float32)


def _cpu_connector() -> Any:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class _CpuKV(GPUConnectorInterface):
        """LMCache's engine <-> a CPU KV tensor ``kvcaches`` [2, L, T, H*D]: plain copies."""

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            kw["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end])

        def batched_to_gpu(
            self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any
        ) -> None:
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, s, e, **kw)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, s, e, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])

    return _CpuKV()


def _engine_run(spec: dict[str, Any]) -> dict[str, Any]:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get_or_create(
        "dpukv-test", _config(spec, remote="dpukv"), _metadata(), _cpu_connector(),
        lambda t, r: None, lambda o, r: o,
    )  # fmt: skip
    engine.post_init()  # what LMCache's vLLM adapter calls once the KV caches exist
    if True:  # no LMCacheEngineBuilder.destroy(): on CPU torch it segfaults freeing its buffer
        tokens = list(range(1000, 1000 + spec["tokens"]))
        want = _kv(len(tokens), spec["seed"])
        out: dict[str, Any] = {}
        if spec["mode"] == "store":
            engine.store(tokens, kvcaches=want)
            _wait_puts(engine, tokens)
            out["stored_tokens"] = len(tokens)
        # After a store: from LMCache's local CPU cache (where a connector that dropped the
        # objects' references once too often broke it); in a fresh process: from the agent.
        got = torch.zeros_like(want)
        mask = engine.retrieve(tokens, kvcaches=got)
        n = int(mask.sum())
        same = bool(got[:, :, :n].view(torch.int32).equal(want[:, :, :n].view(torch.int32)))
        return {**out, "retrieved_tokens": n, "byte_exact": same}


def _remote_backends(engine: Any) -> list[Any]:
    backends = engine.storage_manager.storage_backends
    return [b for name, b in backends.items() if name.startswith("RemoteBackend")]


def _wait_puts(engine: Any, tokens: list[int]) -> None:
    """LMCache puts to remote backends in the background: wait until the remote backend
    holds every chunk of `tokens` (the dpukv connector's batched lookup)."""
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    remotes = _remote_backends(engine)
    assert remotes, "no remote backend: the dpukv plugin was not loaded"
    deadline = time.monotonic() + PUT_WAIT_S_MAX
    while any(b.batched_contains(keys) < len(keys) for b in remotes):
        if time.monotonic() > deadline:
            raise TimeoutError(f"remote puts still running after {PUT_WAIT_S_MAX} s")
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lm_server() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + SERVER_START_S_MAX
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"lm://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("LMCache's lm:// server did not start")


def _bench_one(spec: dict[str, Any], remote: str, objects: int, salt_tag: str) -> dict[str, float]:
    """RemoteBackend put then get of `objects` full chunks; GB/s each, bytes verified."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    config, metadata = _config(spec, remote=remote), _metadata()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    local = LocalCPUBackend(config, metadata)
    backend = RemoteBackend(
        config, metadata, loop, local, "cpu", plugin_name=None if remote != "dpukv" else "dpukv"
    )
    try:
        shape = metadata.get_shapes()[0]
        keys = [
            CacheEngineKey("bench" + salt_tag, 1, 0, hash((salt_tag, i)), torch.float32)
            for i in range(objects)
        ]
        objs = [local.allocate(shape, torch.float32, MemoryFormat.KV_2LTD) for _ in keys]
        g = torch.Generator().manual_seed(7)
        for o in objs:
            o.tensor.copy_(torch.rand(shape, generator=g))
        nbytes = sum(o.get_size() for o in objs)
        conn = backend.connection
        assert conn is not None, f"{remote}: no connection"
        for o in objs:
            o.ref_count_up()  # the connector's put drops one reference per object
        t0 = time.perf_counter()
        asyncio.run_coroutine_threadsafe(_put_all(conn, keys, objs), loop).result(PUT_WAIT_S_MAX)
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = backend.batched_get_blocking(keys)
        get_s = time.perf_counter() - t0
        missing = sum(1 for g in got if g is None)
        ok = not missing and all(g.tensor.equal(o.tensor) for g, o in zip(got, objs, strict=True))
        for o in [*objs, *(g for g in got if g is not None)]:
            o.ref_count_down()
        if not ok:
            raise RuntimeError(
                f"{remote}: of {len(objs)} objects written, {missing} missing on read, the "
                "rest differ"
                if missing < len(objs)
                else f"{remote}: nothing read back"
            )
        return {"put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9, "bytes": nbytes}
    finally:
        backend.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


async def _put_all(conn: Any, keys: list[Any], objs: list[Any]) -> None:
    """What RemoteBackend.batched_submit_put_task starts, awaited: one batched put where the
    connector has one, else every object's put at once."""
    if conn.support_batched_put():
        await conn.batched_put(keys, objs)
    else:
        await asyncio.gather(*(conn.put(k, o) for k, o in zip(keys, objs, strict=True)))


def _bench(spec: dict[str, Any]) -> dict[str, Any]:
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: F401  (imported for its side effects)

    per_obj = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 4
    objects = max(1, spec["mib"] * 2**20 // per_obj)
    server, lm_url = _lm_server()
    rows: dict[str, list[dict[str, float]]] = {"lm": [], "dpukv": []}
    try:
        for r in range(spec["repeats"]):
            rows["lm"].append(_bench_one(spec, lm_url, objects, f"lm{r}"))
            rows["dpukv"].append(_bench_one(spec, "dpukv", objects, f"dk{r}"))
    finally:
        server.kill()
        server.wait()
    best = {
        name: {k: max(x[k] for x in xs) for k in ("put_gbps", "get_gbps")}
        for name, xs in rows.items()
    }
    return {"objects": objects, "object_bytes": per_obj, "runs": rows, "best": best}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    out = _bench(spec) if spec["mode"] == "bench" else _engine_run(spec)
    print(json.dumps({"event": spec["mode"], **out}), flush=True)
    # LMCache 0.5.6 on CPU torch segfaults in its own teardown (LocalCPUBackend.close frees its
    # buffer as pinned memory): everything is flushed and printed, so leave without it.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
