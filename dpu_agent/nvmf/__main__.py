"""Run a standalone target: `python -m dpu_agent.nvmf --nqn NQN --blocks N [...]`.

Serves one subsystem with namespace 1 on a memory device (or `--file`), encrypted when the
environment holds a key; with `--tiers-dir DIR`, the agent's own namespace stack instead (the
embedded tier factory: nsid 1 the DRAM tier, nsid 2 the NVMe tier in DIR, both under AES-XTS
with that key or a random one) (DPU_NVMF_XTS_KEY_HEX: 64 bytes as 128 hex digits; never on the
command line, where other users could read it), and prints one JSON line `{"port": N}` on stdout
once it listens. It stops on SIGTERM/SIGINT or when stdin closes (so a parent that dies takes
it along). Tests and `dpuctl bench nvme` run the target in a separate process this way
(dpu_agent.testing.TargetProcess).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from dpu_agent.blockdev import BlockDevice, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, XtsCipher
from dpu_agent.log import configure_logging, lossy_std_streams
from dpu_agent.nvmf._host_keys import load_host_keys
from dpu_agent.nvmf._subsystem import Subsystem, TargetOptions
from dpu_agent.nvmf._target import NvmeTcpTarget

XTS_KEY_ENV = "DPU_NVMF_XTS_KEY_HEX"  # 64-byte AES-XTS key (hex) for namespace 1


def _device(args: argparse.Namespace) -> BlockDevice:
    dev: BlockDevice
    if args.file:
        dev = FileBlockDevice(args.file, block_count=args.blocks)
    else:
        dev = MemoryBlockDevice(args.blocks)
    key_hex = os.environ.get(XTS_KEY_ENV, "")
    if key_hex:
        dev = CryptoBlockDevice(dev, XtsCipher(bytes.fromhex(key_hex)))
    return dev


TIERS_TENANT = "bench"  # the tenant whose tiers --tiers-dir builds


def _tier_devices(args: argparse.Namespace) -> dict[int, BlockDevice]:
    """The agent's namespaces for one tenant, from the factory the agent itself uses."""
    from dpu_agent.crypto import KeyStore
    from dpu_agent.crypto.keystore import env_var_name
    from dpu_agent.engine.tiers import DRAM, NVME, EmbeddedDevices, TierSpec

    key_hex = os.environ.get(XTS_KEY_ENV) or os.urandom(64).hex()
    factory = EmbeddedDevices(args.tiers_dir, KeyStore(env={env_var_name(TIERS_TENANT): key_hex}))
    specs = (
        TierSpec(index=DRAM, block_count=args.blocks, persistent=False),
        TierSpec(index=NVME, block_count=args.blocks, persistent=True),
    )
    return {s.nsid: factory(TIERS_TENANT, s).device for s in specs}


async def _serve(args: argparse.Namespace) -> None:
    host_keys = load_host_keys(args.host_keys) if args.host_keys else {}
    subs = [
        Subsystem(
            nqn=nqn,
            allowed_hosts=set(args.allow_host),
            allow_any_host=args.allow_any_host,
            namespaces=(
                _tier_devices(args) if args.tiers_dir and i == 0
                else {1: _device(args) if i == 0 else MemoryBlockDevice(args.blocks)}
            ),
            host_keys=dict(host_keys),
            require_auth=args.require_auth,
            secure_channel=args.secure_channel,
        )
        for i, nqn in enumerate([args.nqn, *args.also_nqn])
    ]  # fmt: skip
    opts = TargetOptions(
        max_io_size=args.max_io_size,
        keep_alive_granularity_ms=args.keep_alive_granularity_ms,
        io_workers=args.io_workers,
    )
    target = NvmeTcpTarget(
        subs, args.host, args.port, options=opts, secure_channel=args.secure_channel
    )
    await target.start()
    print(json.dumps({"port": target.port}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.read(1) else None)
    await stop.wait()
    await target.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dpu_agent.nvmf", description=__doc__)
    p.add_argument("--nqn", required=True)
    p.add_argument("--allow-host", action="append", default=[])
    p.add_argument(
        "--also-nqn",
        action="append",
        default=[],
        help="another subsystem (another tenant): a memory namespace 1 of --blocks, same hosts",
    )
    p.add_argument("--allow-any-host", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--blocks", type=int, default=16384)
    p.add_argument("--file")
    p.add_argument("--tiers-dir", help="serve the agent's DRAM (nsid 1) and NVMe (nsid 2) tiers")
    p.add_argument("--max-io-size", type=int, default=1 << 20)
    p.add_argument("--keep-alive-granularity-ms", type=int, default=10000)
    p.add_argument("--io-workers", type=int, default=4)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--host-keys", help="JSON file (mode 0600): {hostnqn: {dhchap_key, ...}}")
    p.add_argument("--require-auth", action="store_true", help="every host must authenticate")
    p.add_argument("--secure-channel", action="store_true", help="TLS 1.3 PSK listener only")
    args = p.parse_args(argv)
    lossy_std_streams()  # a full disk under the log, or its reader gone, stops no host
    configure_logging(level=args.log_level)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
