"""`dpuctl bench nvme` auth/tls rows: what DH-HMAC-CHAP and the TLS secure channel cost.

1 MiB commands at QD8 on one I/O queue, plain namespace, target in its own process (as the
other `bench nvme` rows). Four targets run side by side: plain, DH-HMAC-CHAP required
(`auth`), TLS 1.3 PSK listener (`tls`), both. Each row is measured in slices alternated with
the plain target's (same op, same size, same queue depth), and `vs_plain` is the median of the
slices' ratios, so machine load that drifts hits both alike. `connect_ms` is the median time
of a full connect (admin + one I/O queue; with auth each queue runs DH-HMAC-CHAP SHA-256 with
ffdhe2048, with TLS each queue does a TLS 1.3 PSK handshake).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpu_agent.nvmf import HostKeys
from dpu_agent.nvmf._host_keys import host_keys_to_dict
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeTcpController
from kvproto.nvme import DhchapHash, DhchapSecret, TlsPsk

__all__ = ["SECURITY_CONFIGS", "security_rows"]

NQN = "nqn.2026-11.io.dpu-kvtier:bench-security"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000be0c"
NS_BLOCKS = 16384  # 64 MiB namespace, as the other rows
IO_BYTES = 1 << 20
QD = 8
SPAN_BYTES = IO_BYTES * QD * 2  # bytes per call: 16 commands of 1 MiB
ROUNDS = 5  # alternated slices per row (odd: the median is one of them)
CONNECTS = 3  # connects timed per target
SECONDS_PER_ROW_MAX = 30.0
SECURITY_CONFIGS = (("auth", True, False), ("tls", False, True), ("auth+tls", True, True))


def _measure(ctrl: NvmeTcpController, op: str, buf: bytearray, seconds: float) -> tuple[int, float]:
    blocks = len(buf) // 4096
    lba, moved, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if lba + blocks > NS_BLOCKS:
            lba = 0
        (ctrl.read if op == "read" else ctrl.write)(1, lba, buf)
        lba += blocks
        moved += len(buf)
    return moved, time.perf_counter() - start


def _target(d: Path, auth: bool, tls: bool, keys: HostKeys) -> TargetProcess:
    path = d / f"keys-{int(auth)}{int(tls)}.json"
    mine = HostKeys(dhchap_key=keys.dhchap_key if auth else None, psk=keys.psk if tls else None)
    path.write_text(json.dumps({HOSTNQN: host_keys_to_dict(mine)}))
    path.chmod(0o600)
    extra = ["--secure-channel"] if tls else []
    return TargetProcess(
        NQN,
        allow_hosts=[HOSTNQN],
        blocks=NS_BLOCKS,
        host_keys_file=path,
        require_auth=auth,
        extra_args=extra,
    )


def _connector(port: int, auth: bool, tls: bool, keys: HostKeys) -> Callable[[], NvmeTcpController]:
    kw: dict[str, Any] = {}
    if auth:
        kw.update(
            dhchap_key=keys.dhchap_key, dhchap_hashes=["sha256"], dhchap_dhgroups=["ffdhe2048"]
        )
    if tls:
        kw["psk"] = keys.psk
    return lambda: NvmeTcpController.connect(
        "127.0.0.1", port, NQN, HOSTNQN, io_queues=1, queue_depth=QD, **kw
    )


def _connect_ms(connect: Callable[[], NvmeTcpController]) -> float:
    times = []
    for _ in range(CONNECTS):
        t0 = time.perf_counter()
        connect().close()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def security_rows(seconds: float = 1.0) -> list[dict[str, Any]]:
    """Rows {op, io_kib, qd, auth, tls, gbps, plain_gbps, vs_plain, connect_ms}."""
    seconds = min(seconds, SECONDS_PER_ROW_MAX)
    keys = HostKeys(
        dhchap_key=DhchapSecret.generate(DhchapHash.SHA256), psk=TlsPsk.generate(HOSTNQN, NQN)
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-nvme-sec-") as tmp:
        d = Path(tmp)
        with _target(d, False, False, keys) as plain_t:
            plain_connect = _connector(plain_t.port, False, False, keys)
            plain_ms = _connect_ms(plain_connect)
            plain = plain_connect()
            buf = bytearray(SPAN_BYTES)
            try:
                for _name, auth, tls in SECURITY_CONFIGS:
                    with _target(d, auth, tls, keys) as t:
                        connect = _connector(t.port, auth, tls, keys)
                        ms = _connect_ms(connect)
                        with connect() as ctrl:
                            for op in ("write", "read"):
                                row = _row(plain, ctrl, op, buf, seconds, auth, tls)
                                row.update(connect_ms=ms, plain_connect_ms=plain_ms)
                                rows.append(row)
            finally:
                plain.close()
    return rows


def _row(
    plain: NvmeTcpController,
    ctrl: NvmeTcpController,
    op: str,
    buf: bytearray,
    seconds: float,
    auth: bool,
    tls: bool,
) -> dict[str, Any]:
    base, sec = [], []
    for _ in range(ROUNDS):
        base.append(_measure(plain, op, buf, seconds / ROUNDS))
        sec.append(_measure(ctrl, op, buf, seconds / ROUNDS))
    ratio = statistics.median(
        (b / t) / (pb / pt) for (b, t), (pb, pt) in zip(sec, base, strict=True)
    )
    return {
        "op": op,
        "io_kib": IO_BYTES >> 10,
        "qd": QD,
        "auth": auth,
        "tls": tls,
        "gbps": round(sum(b for b, _ in sec) / sum(t for _, t in sec) / 1e9, 3),
        "plain_gbps": round(sum(b for b, _ in base) / sum(t for _, t in base) / 1e9, 3),
        "vs_plain": round(ratio, 3),
    }


def print_rows(rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    echo("auth/tls: 1 MiB QD8, plain namespace, vs the plain target in the same run")
    for r in rows:
        echo(
            f"{r['op']:5} auth={'y' if r['auth'] else 'n'} tls={'y' if r['tls'] else 'n'} "
            f"{r['gbps']:6.2f} GB/s (plain {r['plain_gbps']:.2f})  x{r['vs_plain']:.2f}  "
            f"connect {r['connect_ms']:.1f} ms (plain {r['plain_connect_ms']:.1f})"
        )
