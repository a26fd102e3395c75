"""`dpuctl bench crypto`: the engine's sector-wise AES-XTS against one-call OpenSSL speed.

`sector_gbps` is XtsCipher over a chunk in 4096-byte sectors, each tweaked with its LBA, as
CryptoBlockDevice does it; `openssl_gbps` is `cryptography`'s AES-XTS over the same buffer in
the largest data units OpenSSL accepts (16 MiB, its IEEE 1619 limit), i.e. no per-sector tweak
cost. It is a baseline, not a ceiling: the engine's own loop (`implementation`, VAES where the
CPU has it) can run faster than OpenSSL's. `vs_openssl` = sector / OpenSSL (target >= 0.8).
`evp_sector_gbps` is the same sector loop through the system OpenSSL's EVP (the portable path),
for comparison. Medians of `repeats`, every variant run once per round (interleaved),
GB/s = 10^9 bytes/s.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import click
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpu_agent.crypto import XtsCipher

__all__ = ["crypto_cmd", "run_crypto_bench"]

SECTOR_BYTES = 4096
OPENSSL_DATA_UNIT_BYTES_MAX = 16 << 20  # OpenSSL refuses larger XTS data units
CHUNK_MIB_MAX = 1024  # two buffers of this size are allocated
REPEATS_MAX = 100


def _interleaved_gbps(nbytes: int, repeats: int, fns: list[Callable[[], None]]) -> list[float]:
    """Median GB/s of each fn; one round runs every fn once, so load that comes and goes
    (this machine is shared) hits all of them alike instead of skewing one."""
    for fn in fns:
        fn()  # warm-up: page faults, OpenSSL context creation
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [nbytes / statistics.median(t) / 1e9 for t in times]


def _ceiling(key: bytes, src: memoryview, dst: memoryview, encrypt: bool) -> Callable[[], None]:
    cipher = Cipher(algorithms.AES(key), modes.XTS(bytes(16)))

    def run() -> None:
        ctx = cipher.encryptor() if encrypt else cipher.decryptor()
        for off in range(0, len(src), OPENSSL_DATA_UNIT_BYTES_MAX):
            end = min(off + OPENSSL_DATA_UNIT_BYTES_MAX, len(src))
            # update_into wants 15 spare bytes of room for a block cipher; give it the tail.
            ctx.update_into(src[off:end], dst[off : end + 15])

    return run


def run_crypto_bench(chunk_mib: int = 32, repeats: int = 5) -> dict[str, Any]:
    """Measure sector-wise vs one-call AES-256-XTS over one chunk; returns the report dict."""
    if not 1 <= chunk_mib <= CHUNK_MIB_MAX:
        raise click.BadParameter(f"--chunk-mib {chunk_mib} outside [1, {CHUNK_MIB_MAX}]")
    if not 1 <= repeats <= REPEATS_MAX:
        raise click.BadParameter(f"--repeats {repeats} outside [1, {REPEATS_MAX}]")
    nbytes = chunk_mib << 20
    key = os.urandom(64)
    xts = XtsCipher(key, block_size=SECTOR_BYTES)
    evp = XtsCipher(key, block_size=SECTOR_BYTES, implementation="evp")
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).data
    dst_arr = np.empty(nbytes + 15, dtype=np.uint8)
    dst = dst_arr.data
    sector_enc, ceiling_enc, sector_dec, ceiling_dec, evp_enc = _interleaved_gbps(
        nbytes,
        repeats,
        [
            lambda: xts.encrypt_into(src, dst[:nbytes], 0),
            _ceiling(key, src, dst, True),
            lambda: xts.decrypt_into(src, dst[:nbytes], 0),
            _ceiling(key, src, dst, False),
            lambda: evp.encrypt_into(src, dst[:nbytes], 0),
        ],
    )
    return {
        "cipher": "AES-256-XTS",
        "implementation": xts.implementation,
        "chunk_bytes": nbytes,
        "sector_bytes": SECTOR_BYTES,
        "repeats": repeats,
        "sector_gbps": round(sector_enc, 3),
        "openssl_gbps": round(ceiling_enc, 3),
        "vs_openssl": round(sector_enc / ceiling_enc, 3),
        "decrypt_sector_gbps": round(sector_dec, 3),
        "decrypt_openssl_gbps": round(ceiling_dec, 3),
        "decrypt_vs_openssl": round(sector_dec / ceiling_dec, 3),
        "evp_sector_gbps": round(evp_enc, 3),
    }


def _table(report: dict[str, Any]) -> str:
    rows = [
        ("encrypt", report["sector_gbps"], report["openssl_gbps"], report["vs_openssl"]),
        (
            "decrypt",
            report["decrypt_sector_gbps"],
            report["decrypt_openssl_gbps"],
            report["decrypt_vs_openssl"],
        ),
    ]
    lines = [
        f"{report['cipher']} ({report['implementation']} loop), {report['chunk_bytes'] >> 20} MiB "
        f"chunk, {report['sector_bytes']}-byte sectors, median of {report['repeats']}",
        f"{'':8} {'sector GB/s':>12} {'OpenSSL GB/s':>13} {'ratio':>6}",
    ]
    lines += [f"{name:8} {s:12.2f} {c:13.2f} {r:6.2f}" for name, s, c, r in rows]
    lines.append(f"OpenSSL EVP sector loop, encrypt: {report['evp_sector_gbps']:.2f} GB/s")
    return "\n".join(lines)


@click.command("crypto")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--chunk-mib", default=32, show_default=True, help="Chunk size in MiB.")
@click.option("--repeats", default=5, show_default=True, help="Timed runs; the median counts.")
def crypto_cmd(as_json: bool, chunk_mib: int, repeats: int) -> None:
    """AES-XTS per 4 KiB sector (as the engine does it) vs one OpenSSL call."""
    report = run_crypto_bench(chunk_mib, repeats)
    click.echo(json.dumps(report) if as_json else _table(report))
