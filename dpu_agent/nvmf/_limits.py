"""Bounds that keep a hostile or broken host from taking the target's memory or slots.

Every number here says why it is that number. The connection and target modules use them at
their edges (accept, Connect, R2T, replies, data buffers); nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "ADMIN_REPLY_BYTES_MAX",
    "BUFFER_CLASS_BYTES_MIN",
    "CONNECT_DEADLINE_S",
    "CONTROLLER_BUFFER_BYTES_MAX",
    "DISCOVERY_CONTROLLERS_MAX",
    "KATO_IDLE_MS",
    "QUEUE_CACHE_BYTES_MAX",
    "R2T_TIMEOUT_S",
    "SEND_QUEUE_BYTES_MAX",
    "UNCONNECTED_MAX",
    "UNCONNECTED_PER_ADDRESS_MAX",
    "BufferBudget",
    "SizedPool",
]

# A connection must finish ICReq and Fabrics Connect within this: a real host does both in one
# round trip each (milliseconds); 10 s covers a loaded host, and idle sockets cannot pile up.
CONNECT_DEADLINE_S = 10.0
# Connections that have not completed Connect yet (nobody knows who they are): a fleet
# reconnecting at once is a few hundred; beyond that they are refused at accept.
UNCONNECTED_MAX = 256
UNCONNECTED_PER_ADDRESS_MAX = 32  # one host opens its admin queue + I/O queues at once
# Discovery controllers accept any host NQN (the spec's well-known subsystem): bound them
# separately; hosts use one briefly to read the discovery log.
DISCOVERY_CONTROLLERS_MAX = 64
# Admin replies carry their content: an Identify structure or log page is at most 4 KiB here
# (the discovery log of 4096 tenants would be ~4 MiB, still sent as content, never padding).
ADMIN_REPLY_BYTES_MAX = 4096
# Reply bytes one connection may leave unsent before the target stops reading its commands:
# one max-size C2HData plus this; a host that pipelines commands without reading replies
# then waits, and the target's memory does not grow with its pipeline.
SEND_QUEUE_BYTES_MAX = 1 << 20
# A host that got an R2T sends the data at once; one that has not sent all of it after this
# long is gone or hostile: its connection is closed and the buffer freed.
R2T_TIMEOUT_S = 10.0
# Data buffers of all queues of one controller together (in use and cached): 64 MiB lets 16
# queues move 4 MiB each at once; 127 queues of one host cannot pin 127 x 16 MiB.
CONTROLLER_BUFFER_BYTES_MAX = 64 << 20
# Free buffers one queue keeps for reuse; the rest go back to the budget (and the allocator).
QUEUE_CACHE_BYTES_MAX = 8 << 20
# Smallest buffer: commands are sized up to a power of two from here (16 KiB chunks get 16
# KiB, not max_io_size), so a few classes cover every command and buffers are reused.
BUFFER_CLASS_BYTES_MIN = 16 << 10
# Keep-alive: a host's KATO is rounded up to the KAS granularity (10 s by default, which is
# the minimum too); a host that asks for none (kato 0) is still dropped after this long
# without any command, so nothing it holds is pinned forever. Two minutes: far above any
# real host's command gap, short enough that abandoned controllers do not pile up.
KATO_IDLE_MS = 120_000


class BufferBudget:
    """Bytes of data buffers one controller's queues hold; queues waiting for room register
    a wake-up callback, called when another queue gives bytes back."""

    __slots__ = ("bytes_max", "pools", "used", "waiters")

    def __init__(self, bytes_max: int = CONTROLLER_BUFFER_BYTES_MAX) -> None:
        self.bytes_max = bytes_max
        self.used = 0
        self.waiters: set[Callable[[], None]] = set()
        self.pools: set[SizedPool] = set()  # the queues charging this budget

    def reclaim(self) -> None:
        """Every queue drops its idle cached buffers: a queue short of room must not wait on
        bytes that other, idle queues only keep for reuse. Silent (no waiter is called back
        from inside another queue's check); the caller checks again."""
        for pool in list(self.pools):
            self.used -= pool._drop_cache_bytes()
        assert self.used >= 0, self.used

    def charge(self, nbytes: int) -> bool:
        if self.used + nbytes > self.bytes_max:
            return False
        self.used += nbytes
        return True

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, self.used
        for wake in list(self.waiters):
            wake()


def size_class(nbytes: int) -> int:
    """The buffer size a command of `nbytes` gets: a power of two >= BUFFER_CLASS_BYTES_MIN."""
    return max(BUFFER_CLASS_BYTES_MIN, 1 << (nbytes - 1).bit_length())


class SizedPool:
    """Data buffers sized to the command (power-of-two classes up to `size_max`): at most
    `count_max` in use per queue, free ones cached up to QUEUE_CACHE_BYTES_MAX, every byte
    charged to the controller's BufferBudget (a private one until Connect names the
    controller)."""

    __slots__ = ("_free", "budget", "cached_bytes", "closed", "count_max", "in_use", "size_max")

    def __init__(self, size_max: int, count_max: int) -> None:
        self.size_max, self.count_max = size_max, count_max
        self.in_use = 0
        self.cached_bytes = 0
        self.closed = False
        self._free: dict[int, list[bytearray]] = {}
        self.budget = BufferBudget(size_max * count_max)
        self.budget.pools.add(self)

    def attach(self, budget: BufferBudget) -> None:
        """Charge the controller's budget from now on (called at Connect, before any I/O)."""
        assert self.in_use == 0 and self.cached_bytes == 0, self.in_use
        self.budget.pools.discard(self)
        self.budget = budget
        budget.pools.add(self)

    def can_take(self, nbytes: int) -> bool:
        size = size_class(nbytes)
        if self.in_use >= self.count_max:
            return False
        if self._free.get(size):
            return True
        if self.budget.used + size - self.cached_bytes <= self.budget.bytes_max:
            return True
        self.budget.reclaim()  # idle caches of the controller's other queues
        return self.budget.used + size <= self.budget.bytes_max

    def take(self, nbytes: int) -> bytearray | None:
        assert 0 < nbytes <= self.size_max, nbytes
        size = size_class(nbytes)
        if self.in_use >= self.count_max:
            return None
        free = self._free.get(size)
        if free:
            self.cached_bytes -= size
            self.in_use += 1
            return free.pop()
        if not self.budget.charge(size):
            self.budget.reclaim()  # room held by idle buffers (this queue's other sizes too)
            if not self.budget.charge(size):
                return None
        self.in_use += 1
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        if self.closed:
            return
        size = len(buf)
        assert self.in_use > 0, self.in_use
        self.in_use -= 1
        if self.cached_bytes + size <= QUEUE_CACHE_BYTES_MAX:
            self._free.setdefault(size, []).append(buf)
            self.cached_bytes += size
        else:
            self.budget.refund(size)

    def close(self, held: list[bytearray]) -> None:
        """The queue is gone: its cached buffers and `held` (those its commands still had)
        go back to the budget; a buffer given back later is ignored."""
        total = self.cached_bytes + sum(len(b) for b in held)
        self.cached_bytes, self.in_use, self.closed = 0, 0, True
        self.budget.pools.discard(self)
        self._free.clear()
        if total:
            self.budget.refund(total)

    def _drop_cache_bytes(self) -> int:
        """Forget the cached buffers; the bytes they were charged (the caller refunds)."""
        cached, self.cached_bytes = self.cached_bytes, 0
        self._free.clear()
        return cached
