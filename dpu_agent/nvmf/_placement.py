"""Where each NVMe/TCP I/O runs, decided from the device's declared I/O traits (BlockDevice).

Three places: inline on the connection's event loop (no thread hop), the target's memory lane
(one thread, arrival order: memory work that should not hold up the loop) or the target's
bounded I/O pool (anything that may wait on a disk). Only Read and Write ever run inline.
"""

from __future__ import annotations

from dpu_agent.blockdev import BlockDevice
from kvproto.nvme import IoOpcode

__all__ = ["inline", "lends_memory", "memory_lane", "page_cache_write"]

_INLINE_OPS = frozenset({IoOpcode.READ, IoOpcode.WRITE})


def inline(dev: BlockDevice, opcode: int) -> bool:
    """Whether to run a Read/Write of `dev` on the loop rather than in the I/O pool.

    Memory that lends itself (plain DRAM): a memcpy of at most max_io_size. Writes of the
    encrypted DRAM tier (`in_memory`): one AES-XTS pass (50 us per MiB with VAES, about 300
    with the EVP loop) from the received buffer into the tier; measured at 1 MiB QD8, inline
    moves 4.4 GB/s where the thread hop moved 3.3-3.6. Its reads stay off the loop: the
    decryption then runs on the other core while the loop sends the previous reply (3.5-4.2
    GB/s vs 3.4-3.8 inline).

    Writes of a page-cache device (`buffered_writes`, the NVMe tier's file) too: the cipher
    pass and a `pwritev` into the page cache, ~0.2 ms per MiB on the loop, where the two
    thread hops left the loop idle half the time while a command's round trip waited on them
    (1 MiB QD8, interleaved A/B under the bench lock: 0.54-0.56 vs 0.47 of the socket
    ceiling). The caller sends them to the pool after a slow one (INLINE_WRITE_SLOW_S).
    """
    if opcode not in _INLINE_OPS:
        return False
    if dev.in_memory and dev.lends_memory:
        return True
    return opcode == IoOpcode.WRITE and (dev.in_memory or dev.buffered_writes)


def page_cache_write(dev: BlockDevice, opcode: int) -> bool:
    """Whether a Write of `dev` is a copy into the page cache (no memory of its own): inline,
    but watched for the kernel throttling it (INLINE_WRITE_SLOW_S)."""
    return opcode == IoOpcode.WRITE and dev.buffered_writes and not dev.in_memory


def memory_lane(dev: BlockDevice, opcode: int) -> bool:
    """Whether a command that leaves the loop goes to the target's memory lane (one thread,
    arrival order) rather than the I/O pool: reads of the encrypted DRAM tier, whose only
    work is the decryption (MEMORY_LANE_WORKERS), and reads of the NVMe tier's mapped file,
    the same while its pages are cached (the target watches for those that are not,
    LANE_SLOW_S). Write Zeroes and the rest stay in the pool, so a long one never holds up the
    reads queued behind it."""
    return opcode == IoOpcode.READ and (dev.in_memory or dev.mapped_reads)


def lends_memory(dev: BlockDevice) -> bool:
    """Whether the target sends from and receives into the device's own bytes (MemoryViewDevice)
    instead of its data buffers."""
    return dev.lends_memory
