"""In-band authentication (DH-HMAC-CHAP) on the target: the queue's state.

A subsystem holds `HostKeys` per host NQN (`Subsystem.host_keys`, nvmf/_host_keys.py). A host
with a DH-HMAC-CHAP key there, or any host of a subsystem with `require_auth`, must
authenticate each queue after its Connect (the Connect response sets AUTHREQ.ATR); until it
has, every command other than Authentication Send/Receive and Disconnect completes with
Authentication Required (SCT 1, SC 0x91), as SPDK does. A wrong or missing key gets
AUTH_Failure1 ("authentication failed") and the connection closes. Refusals are logged with a
hash of the host NQN, never the NQN or anything of the key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from dpu_agent.log import RateLimitedLog, get_logger
from dpu_agent.nvmf._host_keys import HostKeys, nqn_hash
from kvproto.nvme import (
    AUTH_DATA_BYTES_MAX,
    AdminOpcode,
    ControllerAuth,
    ControllerAuthState,
    FabricsType,
    SglType,
    Sqe,
    Status,
    auth_command_ok,
)

if TYPE_CHECKING:
    from dpu_agent.nvmf._connection import NvmfConnection, _Cmd
    from dpu_agent.nvmf._controller import Controller
    from dpu_agent.nvmf._subsystem import Subsystem

__all__ = ["ATR_BIT", "auth_exempt", "handle_auth", "needs_auth", "queue_auth"]

log = get_logger("dpu_agent.nvmf")
refusals = RateLimitedLog(log)  # throttled peers: a flood costs a few lines a second

ATR_BIT = 1 << 17  # Connect response dword 0, AUTHREQ bit 1: authentication required
# After AUTH_Failure1 the host must read it before the connection goes: closing at once races
# with what the host still sends (SPDK's host then sees a reset, not the refusal). The queue
# answers Authentication Required meanwhile; a host that lingers is closed after this.
AUTH_FAILED_CLOSE_S = 2.0
_EXEMPT = frozenset({FabricsType.AUTH_SEND, FabricsType.AUTH_RECV, FabricsType.DISCONNECT})


def queue_auth(ctrl: Controller, *, voluntary: bool = False) -> ControllerAuth | None:
    """The authentication state for a new queue of `ctrl`, or None if it needs none.
    `voluntary`: the host asked to authenticate though the subsystem does not require it."""
    sub = ctrl.subsystem
    if sub is None:
        return None
    keys: HostKeys | None = sub.host_keys.get(ctrl.hostnqn)
    key = keys.dhchap_key if keys else None
    if key is None and not sub.require_auth and not voluntary:
        return None
    return ControllerAuth(
        hostnqn=ctrl.hostnqn,
        subnqn=ctrl.subnqn,
        key=key,
        ctrl_key=keys.dhchap_ctrlr_key if keys else None,
    )


def needs_auth(sub: Subsystem, hostnqn: str) -> bool:
    """Whether `hostnqn`'s queues on `sub` must authenticate (as `queue_auth` decides)."""
    keys = sub.host_keys.get(hostnqn)
    return sub.require_auth or (keys is not None and keys.dhchap_key is not None)


def auth_exempt(sqe: Sqe) -> bool:
    """Commands an unauthenticated queue may still send."""
    return sqe.opcode == AdminOpcode.FABRICS and sqe.fctype in _EXEMPT


def handle_auth(conn: NvmfConnection, cmd: _Cmd, data: bytes | bytearray | memoryview) -> None:
    """Fabrics Authentication Send / Receive on `conn`.

    A step that computes a finite-field DH value (the Challenge's key, the Reply's shared
    secret) runs in the target's auth executor, off the event loop, if the peer's address has
    DH budget left (`NvmeTcpTarget.auth_work`); otherwise the transaction fails with
    AUTH_Failure1 at once. The queue takes no other Authentication command meanwhile."""
    sqe = cmd.sqe
    ctrl = conn.ctrl
    if ctrl is None:
        return conn._complete(cmd, Status.COMMAND_SEQUENCE_ERROR)
    if not auth_command_ok(sqe):
        return conn._complete(cmd, Status.INVALID_FIELD)
    if conn.auth_busy:  # one Authentication command at a time per queue
        return conn._complete(cmd, Status.COMMAND_SEQUENCE_ERROR)
    if conn.auth is None:
        conn.auth = queue_auth(ctrl, voluntary=True)
    auth = conn.auth
    if auth is None:
        return conn._complete(cmd, Status.COMMAND_SEQUENCE_ERROR)  # the discovery controller
    if sqe.fctype == FabricsType.AUTH_SEND:
        if len(data) != sqe.cdw11 or sqe.sgl.type != SglType.DATA_BLOCK_OFFSET:
            return conn._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
        if not auth.needs_dh:
            auth.send(data)
            return _sent(conn, cmd, ctrl, auth)
        msg = bytes(data)  # the in-capsule buffer goes back when the command completes
        return _off_loop(
            conn, auth, lambda: auth.send(msg), lambda _: _sent(conn, cmd, ctrl, auth), False
        )
    if sqe.sgl.type != SglType.TRANSPORT_DATA_BLOCK or sqe.sgl.length < sqe.cdw11:
        return conn._complete(cmd, Status.DATA_SGL_LENGTH_INVALID)
    if not auth.needs_dh:
        return _received(conn, cmd, ctrl, auth, auth.receive())
    return _off_loop(
        conn, auth, auth.receive, lambda out: _received(conn, cmd, ctrl, auth, out or b""), True
    )


def _off_loop(
    conn: NvmfConnection,
    auth: ControllerAuth,
    work: Callable[[], bytes | None],
    then: Callable[[bytes | None], None],
    receive: bool,
) -> None:
    """Run `work` (a DH step of `auth`) in the auth executor, then `then(its result)` on the
    loop; refused (AUTH_Failure1) when the peer's address is over its DH budget or the
    executor's queue is full. `receive`: `work` is the Receive (it returns the message)."""
    address = conn.peer.rpartition(":")[0]
    if not conn.target.auth_work_allowed(address):
        auth.refuse()  # nothing computed: the Receive gets AUTH_Failure1
        refusals.warning("nvmf_auth_throttled", peer=conn.peer, qid=conn.qid)
        return then(auth.receive() if receive else None)
    conn.auth_busy = True

    def done(result: bytes | None, exc: BaseException | None) -> None:
        conn.auth_busy = False
        if conn.closed:
            return
        if exc is not None:  # a programmer error in the FSM: the queue goes, the agent stays
            log.error("nvmf_auth_error", peer=conn.peer, error=repr(exc))
            return conn.close()
        then(result)

    conn.target.auth_work(work, done)


def _sent(conn: NvmfConnection, cmd: _Cmd, ctrl: Controller, auth: ControllerAuth) -> None:
    conn._complete(cmd)
    if auth.state is ControllerAuthState.ERROR:  # the host sent AUTH_Failure2
        _refused(conn, ctrl, auth, "host refused the controller")
    elif auth.state is ControllerAuthState.FAILURE1:
        # Logged when the host reads AUTH_Failure1; the queue is refused every command from
        # now on (`authenticated` is false) and goes after AUTH_FAILED_CLOSE_S, read or not.
        asyncio.get_running_loop().call_later(AUTH_FAILED_CLOSE_S, conn.close)
    elif auth.state is ControllerAuthState.COMPLETED:  # Success2 (bidirectional)
        _authenticated(conn, ctrl, auth)


def _received(
    conn: NvmfConnection, cmd: _Cmd, ctrl: Controller, auth: ControllerAuth, msg: bytes
) -> None:
    assert len(msg) <= AUTH_DATA_BYTES_MAX, len(msg)
    if len(msg) > cmd.sqe.cdw11:
        # The message is made (the transaction moved on) but the host cannot read it: the
        # transaction is lost, so the queue goes as after a failure (a re-authentication
        # left this way kept a queue that refused everything open for good)
        conn._complete(cmd, Status.INVALID_FIELD)
        return _refused(conn, ctrl, auth, f"allocation length {cmd.sqe.cdw11} < {len(msg)}")
    conn._send_data(cmd, msg)
    if auth.state is ControllerAuthState.ERROR:
        _refused(conn, ctrl, auth, auth.fail_reason.name.lower())
    elif auth.state is ControllerAuthState.COMPLETED:  # Success1 (unidirectional)
        _authenticated(conn, ctrl, auth)


def _authenticated(conn: NvmfConnection, ctrl: Controller, auth: ControllerAuth) -> None:
    if conn.qid == 0:
        conn.target.controller_authenticated(ctrl)
    else:
        conn.target.io_queue_proven(conn)
    log.info(
        "nvmf_auth_ok",
        host=nqn_hash(ctrl.hostnqn),
        subnqn=ctrl.subnqn,
        qid=conn.qid,
        hash=auth.hash.name,
        dhgroup=auth.dhgroup.name,
        transactions=auth.transactions,
    )


def _refused(conn: NvmfConnection, ctrl: Controller, auth: ControllerAuth, why: str) -> None:
    refusals.warning(
        "nvmf_auth_refused",
        host=nqn_hash(ctrl.hostnqn),
        subnqn=ctrl.subnqn,
        qid=conn.qid,
        peer=conn.peer,
        reason=why,
    )
    asyncio.get_running_loop().call_later(AUTH_FAILED_CLOSE_S, conn.close)
