"""Firmware reconcile: profile (desired) -> query (live) -> plan -> one `-y set` -> re-query.

Per parameter the plan says: current, next boot, desired, read-only, and the action:
`ok` (current is desired), `pending` (next boot is desired; waits for its activation),
`set` (next boot differs: apply writes it). Conflicts stop apply before it writes anything:
a parameter the device does not offer (a SKU without crypto, an older firmware), a read-only
one that differs, or a profile made for another device type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpu_agent.firmware._profile import ACTIVATIONS, Param, Profile, schema_param
from dpu_agent.firmware._query import DeviceConfig, FirmwareToolError, Tool, query_device, run_set
from dpu_agent.log import get_logger

__all__ = [
    "ApplyResult",
    "Change",
    "FirmwareApplyError",
    "FirmwareConflict",
    "FirmwarePlan",
    "apply",
    "plan",
]

_log = get_logger("dpu_agent.firmware")


class FirmwareConflict(Exception):
    """The plan has conflicts; nothing was written."""

    def __init__(self, conflicts: tuple[str, ...]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


class FirmwareApplyError(Exception):
    """The `set` call failed: nothing of it is assumed applied (mlxconfig writes all or none)."""

    def __init__(self, cause: FirmwareToolError, values: dict[str, int]) -> None:
        self.cause, self.values = cause, values
        super().__init__(f"set of {len(values)} parameter(s) refused: {cause}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    name: str
    desired: str
    current: str | None
    next_boot: str | None
    read_only: bool
    action: str  # ok | pending | set | conflict
    activation: str
    why: str
    code: int  # the desired number

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "desired": self.desired,
            "current": self.current,
            "next_boot": self.next_boot,
            "read_only": self.read_only,
            "action": self.action,
            "activation": self.activation,
            "why": self.why,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FirmwarePlan:
    device: str
    device_type: str
    profile: str
    changes: tuple[Change, ...]
    conflicts: tuple[str, ...]

    @property
    def to_set(self) -> dict[str, int]:
        return {c.name: c.code for c in self.changes if c.action == "set"}

    @property
    def in_sync(self) -> bool:
        return not self.conflicts and all(c.action == "ok" for c in self.changes)

    @property
    def activation(self) -> str | None:
        """The most disruptive step that makes every set or pending value live (or None)."""
        needed = {c.activation for c in self.changes if c.action in ("set", "pending")}
        return max(needed, key=ACTIVATIONS.index) if needed else None

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_type": self.device_type,
            "profile": self.profile,
            "in_sync": self.in_sync,
            "set": {c.name: c.desired for c in self.changes if c.action == "set"},
            "pending": [c.name for c in self.changes if c.action == "pending"],
            "activation": self.activation,
            "conflicts": list(self.conflicts),
            "changes": [c.to_json() for c in self.changes],
        }


def _label(p: Param, code: int | None) -> str | None:
    return None if code is None else p.label(code)


def _words(p: Param) -> str:
    return p.activation.replace("_", " ")


def plan(profile: Profile, live: DeviceConfig, schema: dict[str, Param]) -> FirmwarePlan:
    conflicts: list[str] = []
    if profile.device_types and live.device_type not in profile.device_types:
        conflicts.append(
            f"profile {profile.name} is for {', '.join(profile.device_types)}, the device is "
            f"{live.device_type or 'unknown'} ({live.name}); pick another profile"
        )
    changes = []
    for name, code in profile.parameters.items():
        p = schema_param(schema, name)
        assert p is not None, name  # the profile loader checked every name
        lp = live.params.get(name)
        if lp is None:
            why = "the device does not offer it (SKU or firmware); remove it from the profile"
            conflicts.append(f"{name}: {why}")
            changes.append(Change(name=name, desired=p.label(code), current=None, next_boot=None,
                                  read_only=False, action="conflict", activation=p.activation,
                                  why=why, code=code))  # fmt: skip
            continue
        current = lp.current if lp.current is not None else lp.next_boot
        if lp.next_boot == code:
            action = "ok" if current == code else "pending"
            why = "as desired" if action == "ok" else f"set for next boot; needs a {_words(p)}"
        elif lp.read_only:
            action, why = "conflict", f"{name} is read-only here and differs from the profile"
            conflicts.append(f"{why} ({_label(p, lp.next_boot)} != {p.label(code)})")
        else:
            action = "set"
            why = f"{_label(p, lp.next_boot)} -> {p.label(code)}; live after a {_words(p)}"
        changes.append(
            Change(name=name, desired=p.label(code), current=_label(p, current),
                   next_boot=_label(p, lp.next_boot), read_only=lp.read_only,
                   action=action, activation=p.activation, why=why, code=code)
        )  # fmt: skip
    return FirmwarePlan(
        device=live.device,
        device_type=live.device_type,
        profile=profile.name,
        changes=tuple(changes),
        conflicts=tuple(conflicts),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyResult:
    applied: dict[str, str]  # what the set call wrote (labels)
    after: FirmwarePlan  # the re-query: no `set` left when it converged

    @property
    def converged(self) -> bool:
        return not self.after.to_set and not self.after.conflicts

    def to_json(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "converged": self.converged,
            "activation": self.after.activation,
            "after": self.after.to_json(),
        }


def apply(profile: Profile, device: str, tool: Tool, schema: dict[str, Param]) -> ApplyResult:
    """Plan, refuse on conflicts, write every change in one set call, query again."""
    before = plan(profile, query_device(device, tool), schema)
    if before.conflicts:
        raise FirmwareConflict(before.conflicts)
    values = before.to_set
    if values:
        try:
            run_set(device, tool, values)
        except FirmwareToolError as e:
            _log.warning("firmware_set_failed", device=device, error=str(e))
            raise FirmwareApplyError(e, values) from e
        _log.info("firmware_set", device=device, params=sorted(values))
    after = plan(profile, query_device(device, tool), schema)
    applied = {c.name: c.desired for c in before.changes if c.action == "set"}
    return ApplyResult(applied=applied, after=after)
