#!/usr/bin/env python3
"""A/B helper for issue 9's NVMe/TCP rows: one op on one namespace of the agent's tier stack
(`python -m dpu_agent.nvmf --tiers-dir`, as `dpuctl bench nvme` starts it), 1 MiB commands at
QD8, in three slices each right after a socket-ceiling slice, with the whole machine's CPU per
MiB moved (/proc/stat: every process, so run it under the bench lock on a quiet machine).

    flock -x /work/bench.lock .venv/bin/python scripts/nvme-slices.py read --nsid 2 --seconds 6

nsid 1 is the DRAM tier, 2 the NVMe tier (its file in --dir). Run it from two checkouts in
alternation to compare code; `dpuctl bench nvme` stays the benchmark of record.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dpu_agent.bench.nvme import HOSTNQN, NQN, NS_BLOCKS, SPAN_BYTES, _CeilingPeer, _measure
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeTcpController

SLICES = 3


def cpu_jiffies() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=("read", "write"))
    ap.add_argument("--nsid", type=int, choices=(1, 2), default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="all slices together")
    ap.add_argument("--dir", default=None, help="directory for the tier files")
    args = ap.parse_args()
    peer = _CeilingPeer()
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            tiers = Path(tmp) / "tiers"
            tiers.mkdir()
            with TargetProcess(NQN, allow_hosts=[HOSTNQN], blocks=NS_BLOCKS, tiers_dir=tiers) as t:
                ctrl = NvmeTcpController.connect(
                    "127.0.0.1", t.port, NQN, HOSTNQN,
                    io_queues=1, queue_depth=8, max_transfer_bytes=1 << 20,
                )  # fmt: skip
                buf = bytearray(SPAN_BYTES)
                try:
                    if args.op == "read":  # reads move written blocks, not holes
                        _measure(ctrl, args.nsid, "write", buf, 0.5)
                    _measure(ctrl, args.nsid, args.op, buf, 0.3)  # warm-up
                    for _ in range(SLICES):
                        cb, ct = peer.moved(args.op, args.seconds / SLICES)
                        before = cpu_jiffies()
                        moved, secs = _measure(ctrl, args.nsid, args.op, buf, args.seconds / SLICES)
                        d = [b - a for a, b in zip(before, cpu_jiffies(), strict=True)]
                        mib = moved / (1 << 20)
                        busy = sum(d) - d[3] - d[4]  # all but idle and iowait
                        print(
                            f"gbps {moved / secs / 1e9:.2f} ratio {(moved / secs) / (cb / ct):.2f} "
                            f"cpu_us/MiB {busy * 10000 / mib:.0f} (sys {d[2] * 10000 / mib:.0f} "
                            f"user {d[0] * 10000 / mib:.0f})"
                        )
                finally:
                    ctrl.close()
    finally:
        peer.close()


if __name__ == "__main__":
    main()
