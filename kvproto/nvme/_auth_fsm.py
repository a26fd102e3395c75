"""The two DH-HMAC-CHAP state machines (host and controller), sans-I/O.

Host: `negotiate()` -> bytes for Authentication Send; then each Authentication Receive's data
goes to `receive()`, which returns the next message to send (or None) until `done`.
Controller: each Authentication Send's data goes to `send()`, each Authentication Receive is
answered with `receive()`. Bad input never raises on the controller: it moves to FAILURE1 and
the next Receive returns the AUTH_Failure1 (as SPDK does), after which the queue is dropped.

Every (state, message) pair the controller accepts is in `CONTROLLER_TRANSITIONS`; anything
else is an "incorrect protocol message". Re-authentication: a new AUTH_Negotiate on a queue
that has completed authentication starts a new transaction (NVMe Base 2.x 8.13.5.8).
"""

from __future__ import annotations

import enum
import hmac
import os
from collections.abc import Callable, Sequence

from kvproto.nvme._auth import (
    ALL_DHGROUPS,
    ALL_HASHES,
    AuthError,
    AuthFailure,
    AuthFailureReason,
    AuthMessageError,
    AuthNegotiate,
    DhchapChallenge,
    DhchapReply,
    DhchapSuccess1,
    DhchapSuccess2,
    DhGroup,
    DhKey,
    dhchap_response,
    new_seqnum,
    parse_auth_message,
)
from kvproto.nvme._secrets import DhchapHash, DhchapSecret

__all__ = [
    "CONTROLLER_TRANSITIONS",
    "ControllerAuth",
    "ControllerAuthState",
    "HostAuth",
    "HostAuthState",
]

_HOST_LABEL, _CTRL_LABEL = "HostHost", "Controller"


class HostAuthState(enum.Enum):
    NEGOTIATE = "negotiate"
    AWAIT_CHALLENGE = "await-challenge"
    AWAIT_SUCCESS1 = "await-success1"
    DONE = "done"
    FAILED = "failed"


class HostAuth:
    """The host's side of one transaction on one queue."""

    def __init__(
        self,
        *,
        hostnqn: str,
        subnqn: str,
        key: DhchapSecret,
        ctrl_key: DhchapSecret | None = None,
        hashes: Sequence[DhchapHash] = ALL_HASHES,
        dhgroups: Sequence[DhGroup] = ALL_DHGROUPS,
        t_id: int = 0,
        seqnum: int = 0,
        rand: Callable[[int], bytes] = os.urandom,
    ) -> None:
        assert hashes and all(h is not DhchapHash.NONE for h in hashes), hashes
        self.hostnqn, self.subnqn = hostnqn, subnqn
        self.key, self.ctrl_key = key, ctrl_key
        self.hashes, self.dhgroups = tuple(hashes), tuple(dhgroups)
        self.t_id = t_id & 0xFFFF
        self.seqnum = seqnum  # S2, for the controller's response (bidirectional)
        self._rand = rand
        self.state = HostAuthState.NEGOTIATE
        self.hash: DhchapHash | None = None
        self.dhgroup: DhGroup | None = None
        self._expected_r2 = b""

    def negotiate(self) -> bytes:
        assert self.state is HostAuthState.NEGOTIATE, self.state
        self.state = HostAuthState.AWAIT_CHALLENGE
        return AuthNegotiate(
            t_id=self.t_id,
            hash_ids=tuple(int(h) for h in self.hashes),
            dhgroup_ids=tuple(int(g) for g in self.dhgroups),
        ).pack()

    def _fail(
        self, msg: str, reason: AuthFailureReason, *, send_failure2: bool = True
    ) -> AuthError:
        self.state = HostAuthState.FAILED
        f2 = AuthFailure(t_id=self.t_id, reason=reason, from_controller=False).pack()
        return AuthError(msg, reason, failure2=f2 if send_failure2 else None)

    def receive(self, data: bytes | bytearray | memoryview) -> bytes | None:
        """Handle one Authentication Receive's data; returns the next message to send."""
        try:
            msg = parse_auth_message(data)
        except AuthMessageError as e:
            raise self._fail(f"bad message from the controller: {e}", e.reason) from None
        if isinstance(msg, AuthFailure) and msg.from_controller:
            self.state = HostAuthState.FAILED
            reason = _reason(msg.reason)
            raise AuthError(f"controller refused authentication: {reason.name}", reason)
        if self.state is HostAuthState.AWAIT_CHALLENGE and isinstance(msg, DhchapChallenge):
            return self._reply(msg)
        if self.state is HostAuthState.AWAIT_SUCCESS1 and isinstance(msg, DhchapSuccess1):
            return self._success1(msg)
        raise self._fail(
            f"unexpected {type(msg).__name__} in state {self.state.value}",
            AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE,
        )

    def _reply(self, ch: DhchapChallenge) -> bytes:
        bad = AuthFailureReason.INCORRECT_PAYLOAD
        if ch.t_id != self.t_id or ch.seqnum == 0:
            raise self._fail(f"challenge T_ID {ch.t_id} / seqnum {ch.seqnum}", bad)
        try:
            h, group = DhchapHash(ch.hash_id), DhGroup(ch.dhgroup_id)
        except ValueError:
            raise self._fail(f"challenge hash {ch.hash_id} / group {ch.dhgroup_id}", bad) from None
        if h not in self.hashes or group not in self.dhgroups or len(ch.cval) != h.length:
            raise self._fail(f"challenge with {h.name}/{group.name}, not offered", bad)
        if (group is DhGroup.NULL) != (not ch.dhv):
            raise self._fail(f"challenge DH value of {len(ch.dhv)} bytes for {group.name}", bad)
        self.hash, self.dhgroup = h, group
        dh_secret, dhv = None, b""
        if group is not DhGroup.NULL:
            key = DhKey(group)
            dhv = key.public_bytes()
            try:
                dh_secret = key.shared_secret(ch.dhv)
            except AuthError as e:
                raise self._fail(str(e), bad) from None
        r1 = dhchap_response(
            key=self.key.transformed(self.hostnqn),
            h=h,
            challenge=ch.cval,
            seqnum=ch.seqnum,
            t_id=self.t_id,
            label=_HOST_LABEL,
            nqn1=self.hostnqn,
            nqn2=self.subnqn,
            dh_secret=dh_secret,
        )
        c2, s2 = bytes(h.length), 0
        if self.ctrl_key is not None:
            c2, s2 = self._rand(h.length), new_seqnum(self.seqnum, self._rand)
            self.seqnum = s2
            self._expected_r2 = dhchap_response(
                key=self.ctrl_key.transformed(self.subnqn),
                h=h,
                challenge=c2,
                seqnum=s2,
                t_id=self.t_id,
                label=_CTRL_LABEL,
                nqn1=self.subnqn,
                nqn2=self.hostnqn,
                dh_secret=dh_secret,
            )
        self.state = HostAuthState.AWAIT_SUCCESS1
        return DhchapReply(
            t_id=self.t_id, rval=r1, cval=c2, cvalid=self.ctrl_key is not None, seqnum=s2, dhv=dhv
        ).pack()

    def _success1(self, s1: DhchapSuccess1) -> bytes | None:
        bad = AuthFailureReason.INCORRECT_PAYLOAD
        if s1.t_id != self.t_id:
            raise self._fail(f"Success1 T_ID {s1.t_id}, expected {self.t_id}", bad)
        if self.ctrl_key is None:
            self.state = HostAuthState.DONE
            return None
        if not s1.rval:
            raise self._fail("Success1 without the controller's response", bad)
        if not hmac.compare_digest(s1.rval, self._expected_r2):
            raise self._fail(
                "the controller's response does not match its key", AuthFailureReason.FAILED
            )
        self.state = HostAuthState.DONE
        return DhchapSuccess2(t_id=self.t_id).pack()

    @property
    def done(self) -> bool:
        return self.state is HostAuthState.DONE


def _reason(value: int) -> AuthFailureReason:
    try:
        return AuthFailureReason(value)
    except ValueError:
        return AuthFailureReason.FAILED


class ControllerAuthState(enum.Enum):
    NEGOTIATE = "negotiate"  # waiting for AUTH_Negotiate (Send)
    CHALLENGE = "challenge"  # the next Receive returns the Challenge
    REPLY = "reply"  # waiting for DH-HMAC-CHAP_Reply (Send)
    SUCCESS1 = "success1"  # the next Receive returns Success1
    SUCCESS2 = "success2"  # waiting for Success2 or Failure2 (Send)
    FAILURE1 = "failure1"  # the next Receive returns AUTH_Failure1, then the queue goes
    COMPLETED = "completed"  # authenticated (a new Negotiate re-authenticates)
    ERROR = "error"  # failed: the queue must be disconnected


_FAILED = frozenset({ControllerAuthState.FAILURE1, ControllerAuthState.ERROR})

# (state, message received by Authentication Send) -> handler name; Receive is by state.
CONTROLLER_TRANSITIONS: dict[tuple[ControllerAuthState, type], str] = {
    (ControllerAuthState.NEGOTIATE, AuthNegotiate): "_negotiate",
    (ControllerAuthState.COMPLETED, AuthNegotiate): "_negotiate",
    (ControllerAuthState.REPLY, DhchapReply): "_reply",
    (ControllerAuthState.SUCCESS2, DhchapSuccess2): "_success2",
    (ControllerAuthState.SUCCESS2, AuthFailure): "_failure2",
}


class ControllerAuth:
    """The controller's side on one queue. `key` None: the host has no secret here, so it
    cannot authenticate (its Reply fails with "authentication failed")."""

    def __init__(
        self,
        *,
        hostnqn: str,
        subnqn: str,
        key: DhchapSecret | None,
        ctrl_key: DhchapSecret | None = None,
        hashes: Sequence[DhchapHash] = ALL_HASHES,
        dhgroups: Sequence[DhGroup] = ALL_DHGROUPS,
        next_seqnum: Callable[[], int] | None = None,
        rand: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.hostnqn, self.subnqn = hostnqn, subnqn
        self.key, self.ctrl_key = key, ctrl_key
        self.hashes, self.dhgroups = tuple(hashes), tuple(dhgroups)
        self._seq = 0
        self._next_seqnum = next_seqnum or self._own_seqnum
        self._rand = rand
        self.state = ControllerAuthState.NEGOTIATE
        self.fail_reason = AuthFailureReason.FAILED
        self.t_id = 0
        self.hash = DhchapHash.SHA256
        self.dhgroup = DhGroup.NULL
        self.transactions = 0  # completed authentications (re-authentication counts)
        self._cval = b""
        self._seqnum = 0
        self._dhkey: DhKey | None = None
        self._r2 = b""

    def _own_seqnum(self) -> int:
        self._seq = new_seqnum(self._seq, self._rand)
        return self._seq

    @property
    def authenticated(self) -> bool:
        """The host proved its key at least once on this queue and no transaction since has
        failed: re-authentication in flight keeps the queue usable (the spec allows it), a
        failed one ends that at once, whether or not the host reads its AUTH_Failure1 (a host
        that never sends the Receive must not keep a queue its key no longer opens)."""
        return self.transactions > 0 and self.state not in _FAILED

    @property
    def failed(self) -> bool:
        """The current transaction failed (AUTH_Failure1 pending or sent): the queue goes."""
        return self.state in _FAILED

    @property
    def needs_dh(self) -> bool:
        """The next step is a finite-field DH computation (a Receive that builds the Challenge,
        or a Send of the Reply): milliseconds of modular exponentiation that the caller may
        run off its event loop."""
        if self.state is ControllerAuthState.REPLY:
            return self._dhkey is not None
        return self.state is ControllerAuthState.CHALLENGE and self.dhgroup is not DhGroup.NULL

    def refuse(self, reason: AuthFailureReason = AuthFailureReason.FAILED) -> None:
        """Fail the transaction without computing anything (the caller's budget for this
        peer's DH work is spent): the next Receive returns AUTH_Failure1."""
        self._dhkey = None
        self._fail1(reason)

    def _fail1(self, reason: AuthFailureReason) -> None:
        self.state, self.fail_reason = ControllerAuthState.FAILURE1, reason

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """An Authentication Send's data (its command completes with success regardless)."""
        try:
            msg = parse_auth_message(data)
        except AuthMessageError as e:
            return self._fail1(e.reason)
        handler = CONTROLLER_TRANSITIONS.get((self.state, type(msg)))
        if handler is None:
            return self._fail1(AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE)
        if not isinstance(msg, AuthNegotiate) and msg.t_id != self.t_id:
            return self._fail1(AuthFailureReason.INCORRECT_PAYLOAD)
        getattr(self, handler)(msg)

    def _negotiate(self, msg: AuthNegotiate) -> None:
        self.t_id = msg.t_id
        if msg.sc_c:
            return self._fail1(AuthFailureReason.SCC_MISMATCH)
        # strongest first, as SPDK picks
        h = next((h for h in sorted(self.hashes, reverse=True) if h in msg.hash_ids), None)
        if h is None:
            return self._fail1(AuthFailureReason.HASH_UNUSABLE)
        g = next((g for g in sorted(self.dhgroups, reverse=True) if g in msg.dhgroup_ids), None)
        if g is None:
            return self._fail1(AuthFailureReason.DHGROUP_UNUSABLE)
        self.hash, self.dhgroup = DhchapHash(h), DhGroup(g)
        self.state = ControllerAuthState.CHALLENGE

    def _reply(self, msg: DhchapReply) -> None:
        hl = self.hash.length
        if len(msg.rval) != hl or (msg.cvalid and msg.seqnum == 0):
            return self._fail1(AuthFailureReason.INCORRECT_PAYLOAD)
        if self.key is None:
            return self._fail1(AuthFailureReason.FAILED)
        dh_secret = None
        if self._dhkey is not None:
            try:
                dh_secret = self._dhkey.shared_secret(msg.dhv)
            except AuthError:
                return self._fail1(AuthFailureReason.FAILED)
        elif msg.dhv:
            return self._fail1(AuthFailureReason.INCORRECT_PAYLOAD)
        expected = dhchap_response(
            key=self.key.transformed(self.hostnqn),
            h=self.hash,
            challenge=self._cval,
            seqnum=self._seqnum,
            t_id=self.t_id,
            label=_HOST_LABEL,
            nqn1=self.hostnqn,
            nqn2=self.subnqn,
            dh_secret=dh_secret,
        )
        if not hmac.compare_digest(expected, msg.rval):
            return self._fail1(AuthFailureReason.FAILED)
        self._r2 = b""
        if msg.cvalid:
            if self.ctrl_key is None:  # the host wants us to prove a key we do not have
                return self._fail1(AuthFailureReason.FAILED)
            self._r2 = dhchap_response(
                key=self.ctrl_key.transformed(self.subnqn),
                h=self.hash,
                challenge=msg.cval,
                seqnum=msg.seqnum,
                t_id=self.t_id,
                label=_CTRL_LABEL,
                nqn1=self.subnqn,
                nqn2=self.hostnqn,
                dh_secret=dh_secret,
            )
        self._dhkey = None
        self.state = ControllerAuthState.SUCCESS1

    def _success2(self, msg: DhchapSuccess2) -> None:
        self._complete()

    def _failure2(self, msg: AuthFailure) -> None:
        if msg.from_controller:
            return self._fail1(AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE)
        self.state = ControllerAuthState.ERROR

    def _complete(self) -> None:
        self.transactions += 1
        self.state = ControllerAuthState.COMPLETED

    def receive(self) -> bytes:
        """The data of an Authentication Receive (Challenge, Success1 or Failure1)."""
        if self.state is ControllerAuthState.CHALLENGE:
            return self._challenge()
        if self.state is ControllerAuthState.SUCCESS1:
            s1 = DhchapSuccess1(t_id=self.t_id, hl=self.hash.length, rval=self._r2)
            if self._r2:
                self.state = ControllerAuthState.SUCCESS2
            else:
                self._complete()
            return s1.pack()
        reason = (
            self.fail_reason
            if self.state is ControllerAuthState.FAILURE1
            else AuthFailureReason.INCORRECT_PROTOCOL_MESSAGE
        )
        self.state = ControllerAuthState.ERROR
        return AuthFailure(t_id=self.t_id, reason=reason, from_controller=True).pack()

    def _challenge(self) -> bytes:
        dhv = b""
        self._dhkey = None
        if self.dhgroup is not DhGroup.NULL:
            self._dhkey = DhKey(self.dhgroup)
            dhv = self._dhkey.public_bytes()
        self._cval = self._rand(self.hash.length)
        self._seqnum = self._next_seqnum()
        self.state = ControllerAuthState.REPLY
        return DhchapChallenge(
            t_id=self.t_id,
            hash_id=self.hash,
            dhgroup_id=self.dhgroup,
            seqnum=self._seqnum,
            cval=self._cval,
            dhv=dhv,
        ).pack()
