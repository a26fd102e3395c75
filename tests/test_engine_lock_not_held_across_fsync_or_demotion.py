"""Issue 10, finding 6: the engine lock was held across fsync and inline demotion, on the event
loop that also runs the NVMe/TCP target (one ~300 MiB fsync blocked a lookup for 104 ms).

Not a timed test: a device whose flush (fsync) and write (demotion copy) run a lookup on
another thread and wait for it. Under the old locking that lookup can never finish while the
flush or the copy runs (the caller holds the lock): it would deadlock, and the wait times out.
And reserve() never copies a chunk (no inline demotion on the control plane's thread).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from dpu_agent.crypto import KeyStore
from dpu_agent.engine import NVME, EmbeddedDevices, Engine, EngineConfig, TierDevices, TierSpec

BS = 4096
WAIT_S = 10.0  # a lookup takes microseconds; this only bounds the test if the lock is held


class Probe:
    """Wraps the NVMe device: flush and write run `during()` while they are in progress."""

    def __init__(self, inner: Any, during: Any) -> None:
        self._inner, self._during = inner, during
        self.writes = 0
        self.blocked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def flush(self) -> None:
        self._during(self, "flush")
        self._inner.flush()

    def write(self, lba: int, data: Any) -> None:
        self.writes += 1
        self._during(self, "write")
        self._inner.write(lba, data)


HOLDER: dict[str, Engine] = {}


def make(tmp_path: Path) -> tuple[Engine, list[Probe]]:
    keystore = KeyStore(tmp_path / "keys.json")
    embedded = EmbeddedDevices(tmp_path, keystore)
    probes: list[Probe] = []
    holder = HOLDER

    def lookup_elsewhere(probe: Probe, what: str) -> None:
        eng = holder.get("eng")
        if eng is None or eng._closed:
            return
        done = threading.Event()
        threading.Thread(target=lambda: (eng.lookup("acme", [b"k" * 16]), done.set()),
                         daemon=True).start()  # fmt: skip
        if not done.wait(WAIT_S):
            probe.blocked.append(what)

    def factory(tenant: str, spec: TierSpec) -> TierDevices:
        devs = embedded(tenant, spec)
        if spec.index != NVME:
            return devs
        probe = Probe(devs.device, lookup_elsewhere)
        probes.append(probe)
        return TierDevices(device=probe, raw=devs.raw, key_generation=devs.key_generation)  # type: ignore[arg-type]

    cfg = EngineConfig(data_dir=tmp_path, dram_bytes=16 * BS, nvme_bytes=512 * BS,
                       fsync_interval_s=0.0, tenants={"acme": 0})  # fmt: skip
    eng = Engine(cfg, device_factory=factory, keystore=keystore)
    holder["eng"] = eng
    return eng, probes


def test_lookups_go_on_during_fsync_and_demotion(tmp_path: Path) -> None:
    eng, probes = make(tmp_path)
    try:
        for i in range(12):  # 2-block chunks: DRAM (16 blocks) fills, tick demotes
            eng.put_chunk("acme", i.to_bytes(16, "big"), bytes([i + 1]) * (2 * BS))
        before = probes[0].writes
        result = eng.tick()  # syncs (fsync_interval_s 0) and demotes
        assert result["synced"] == 1 and result["demoted"] >= 1
        assert probes[0].writes > before
        assert probes[0].blocked == []  # no lookup waited for the fsync or a demotion copy
    finally:
        HOLDER.clear()  # close() flushes DRAM to NVMe under the lock, by design: no probing
        eng.close()


def test_reserve_never_copies_a_chunk(tmp_path: Path) -> None:
    eng, probes = make(tmp_path)
    try:
        for i in range(8):  # DRAM full of 2-block chunks
            eng.put_chunk("acme", i.to_bytes(16, "big"), bytes([i + 1]) * (2 * BS))
        writes = probes[0].writes
        for i in range(8, 16):  # DRAM is full: these must not demote inline
            eng.reserve("acme", i.to_bytes(16, "big"), 2 * BS)
        assert probes[0].writes == writes
    finally:
        HOLDER.clear()  # close() flushes DRAM to NVMe under the lock, by design: no probing
        eng.close()
