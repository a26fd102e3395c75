"""Bounds that keep a hostile or broken host from taking the target's memory or slots.

Every number here says why it is that number. The connection and target modules use them at
their edges (accept, Connect, R2T, replies, data buffers); nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "ADMIN_REPLY_BYTES_MAX",
    "AUTH_DEADLINE_S",
    "BUFFER_CLASS_BYTES_MIN",
    "CONNECT_DEADLINE_S",
    "CONTROLLERS_PER_ADDRESS_MAX",
    "CONTROLLERS_PER_HOST_MAX",
    "CONTROLLERS_PER_TENANT_MAX",
    "CONTROLLER_BUFFER_BYTES_MAX",
    "DISCOVERY_CONTROLLERS_MAX",
    "HOST_BUFFER_BYTES_MAX",
    "KATO_IDLE_MS",
    "QUEUES_PER_HOST_MAX",
    "QUEUES_PER_TENANT_MAX",
    "QUEUE_CACHE_BYTES_MAX",
    "R2T_TIMEOUT_S",
    "SEND_QUEUE_BYTES_MAX",
    "TARGET_BUFFER_BYTES_MAX",
    "TENANT_BUFFER_BYTES_MAX",
    "UNAUTHENTICATED_CONTROLLERS_MAX",
    "UNAUTHENTICATED_CONTROLLERS_PER_ADDRESS_MAX",
    "UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX",
    "UNAUTHENTICATED_CONTROLLERS_PER_TENANT_MAX",
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
# A queue that must authenticate (DH-HMAC-CHAP) has this long after its Connect to finish: a
# real host needs two round trips and two DH computations (~25 ms for ffdhe8192 here); 10 s
# covers a loaded host, and someone who knows a host NQN but no key holds a queue no longer.
# Refused commands (Authentication Required) never count as keep-alive.
AUTH_DEADLINE_S = 10.0
# Controllers whose admin queue has not authenticated yet, by scope. At a cap the newcomer is
# not refused: the oldest unauthenticated controller of the address that holds the most in that
# scope goes (a stranger flooding from one address evicts its own, never the host's one
# authentication in flight). Per host NQN: a host authenticates one admin queue per subsystem
# (a reconnect overlapping the old one: two); 4 leaves room for retries.
UNAUTHENTICATED_CONTROLLERS_PER_HOST_MAX = 4
# Per source address: one GPU server runs a few dozen clients (one host NQN each), and they
# authenticate their admin queues within milliseconds of each other at most at a restart.
UNAUTHENTICATED_CONTROLLERS_PER_ADDRESS_MAX = 16
# Per tenant (subsystem) and in all: a fleet reconnecting after an agent restart authenticates
# a few hundred at once; 256 in all as UNCONNECTED_MAX.
UNAUTHENTICATED_CONTROLLERS_PER_TENANT_MAX = 64
UNAUTHENTICATED_CONTROLLERS_MAX = 256
# Controllers (authenticated or not) per host NQN on one subsystem: the shim opens one per
# client (each client has its own NQN), a reconnect overlaps the old one; 16 is generous.
CONTROLLERS_PER_HOST_MAX = 16
# Per tenant and per source address, below the target's CONNECTIONS_MAX (4096): one tenant, or
# one machine, cannot take every controller slot from the others. 1024 is a fleet of GPU
# servers with a few clients each; an address is one server: 256 clients.
CONTROLLERS_PER_TENANT_MAX = 1024
CONTROLLERS_PER_ADDRESS_MAX = 256
# Queues (admin + I/O connections) per host NQN and per tenant: a client uses one admin and a
# few I/O queues (the shim's default is 4, max_io_qpairs_per_ctrlr is 127); a tenant may hold
# half of CONNECTIONS_MAX, so the other tenants always have the other half.
QUEUES_PER_HOST_MAX = 256
QUEUES_PER_TENANT_MAX = 2048
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
# The same data buffers (in use and cached, which is what unanswered R2Ts pin) summed over all
# controllers of one host NQN on a subsystem, of one tenant, and of the whole target. A host
# is two controllers' worth (a reconnect overlapping the old one); a tenant four busy hosts;
# the target eight tenants' worth, 1 GiB, which a DPU's memory spares next to its DRAM tier.
# A queue short of room waits (its commands queue, no R2T goes out) until a buffer comes back:
# every pinned buffer is freed within R2T_TIMEOUT_S, so waiting is bounded too.
HOST_BUFFER_BYTES_MAX = 2 * CONTROLLER_BUFFER_BYTES_MAX
TENANT_BUFFER_BYTES_MAX = 4 * CONTROLLER_BUFFER_BYTES_MAX
TARGET_BUFFER_BYTES_MAX = 16 * CONTROLLER_BUFFER_BYTES_MAX
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
    """Bytes of data buffers charged to one principal: a controller's queues, and through
    `parent` the host, the tenant and the target they belong to (a charge must fit every level).
    Queues waiting for room register a wake-up callback at the level that refused them; a
    refund under that level calls it."""

    __slots__ = ("bytes_max", "parent", "pools", "used", "waiters")

    def __init__(
        self, bytes_max: int = CONTROLLER_BUFFER_BYTES_MAX, parent: BufferBudget | None = None
    ) -> None:
        self.bytes_max = bytes_max
        self.parent = parent
        self.used = 0
        self.waiters: set[Callable[[], None]] = set()
        self.pools: set[SizedPool] = set()  # the queues charging this budget (or one below)

    def chain(self) -> list[BufferBudget]:
        """This budget and its ancestors, innermost first."""
        out: list[BufferBudget] = [self]
        while (up := out[-1].parent) is not None:
            out.append(up)
        return out

    def short(self, nbytes: int) -> BufferBudget | None:
        """The outermost level `nbytes` more would overflow, or None if it fits everywhere."""
        found = None
        for b in self.chain():
            if b.used + nbytes > b.bytes_max:
                found = b
        return found

    def reclaim(self, nbytes: int = 0) -> None:
        """Every queue under the level that lacks room drops its idle cached buffers: a queue
        short of room must not wait on bytes that other, idle queues only keep for reuse.
        Silent (no waiter is called back from inside another queue's check); the caller checks
        again."""
        level = self.short(nbytes) or self
        for pool in list(level.pools):
            pool.budget._uncharge(pool._drop_cache_bytes())

    def charge(self, nbytes: int) -> bool:
        if self.short(nbytes) is not None:
            return False
        for b in self.chain():
            b.used += nbytes
        return True

    def _uncharge(self, nbytes: int) -> None:
        for b in self.chain():
            b.used -= nbytes
            assert b.used >= 0, b.used

    def refund(self, nbytes: int) -> None:
        self._uncharge(nbytes)
        wake: set[Callable[[], None]] = set()
        for b in self.chain():
            wake |= b.waiters
        for cb in wake:
            cb()

    def wait(self, cb: Callable[[], None], nbytes: int) -> None:
        """Call `cb` when a refund may have made room for `nbytes` (at the level that lacks
        it now; at this level if none does: a buffer of this controller's comes back)."""
        self.unwait(cb)
        (self.short(nbytes) or self).waiters.add(cb)

    def unwait(self, cb: Callable[[], None]) -> None:
        for b in self.chain():
            b.waiters.discard(cb)


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
        """Charge the controller's budget (and its host's, tenant's and the target's) from now
        on (called at Connect, before any I/O)."""
        assert self.in_use == 0 and self.cached_bytes == 0, self.in_use
        for b in self.budget.chain():
            b.pools.discard(self)
        self.budget = budget
        for b in budget.chain():
            b.pools.add(self)

    def can_take(self, nbytes: int) -> bool:
        size = size_class(nbytes)
        if self.in_use >= self.count_max:
            return False
        if self._free.get(size):
            return True
        if self.budget.short(size - self.cached_bytes) is None:
            return True
        self.budget.reclaim(size)  # idle caches of the other queues under the full level
        return self.budget.short(size) is None

    def wait(self, cb: Callable[[], None], nbytes: int) -> None:
        """Call `cb` when a buffer for `nbytes` may be free (see BufferBudget.wait)."""
        self.budget.wait(cb, size_class(nbytes))

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
            self.budget.reclaim(size)  # room held by idle buffers (this queue's other sizes too)
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
        for b in self.budget.chain():
            b.pools.discard(self)
        self._free.clear()
        if total:
            self.budget.refund(total)

    def _drop_cache_bytes(self) -> int:
        """Forget the cached buffers; the bytes they were charged (the caller refunds)."""
        cached, self.cached_bytes = self.cached_bytes, 0
        self._free.clear()
        return cached
