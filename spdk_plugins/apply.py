"""apply: run a plan's steps, stop at the first SPDK error, re-plan to confirm convergence.
status: the drift report (what was created or removed behind the agent's back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spdk_plugins._log import get_logger
from spdk_plugins.desired import KeyProvider, SpdkDesired
from spdk_plugins.plan import Plan, Step, plan
from spdk_plugins.rpc import SpdkClient, SpdkError, SpdkRpcError

__all__ = [
    "ApplyError",
    "ApplyResult",
    "DriftReport",
    "PlanConflict",
    "apply",
    "status",
]

_log = get_logger("spdk_plugins.apply")


class PlanConflict(SpdkError):
    """The live state differs in ways the driver will not change; nothing was applied."""

    def __init__(self, conflicts: tuple[str, ...]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


class ApplyError(SpdkError):
    """A step failed: `step_index`, the redacted step, SPDK's `code` and `message`."""

    def __init__(self, step_index: int, step: Step, done: int, cause: SpdkError) -> None:
        self.step_index = step_index
        self.step = step.to_json()
        self.done = done
        self.code = cause.code if isinstance(cause, SpdkRpcError) else None
        self.message = cause.message if isinstance(cause, SpdkRpcError) else str(cause)
        super().__init__(
            f"step {step_index + 1} {step.method} failed: SPDK error {self.code} "
            f"{self.message!r}; {done} step(s) before it were applied; params "
            f"{self.step['params']}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyResult:
    applied: tuple[dict[str, Any], ...]  # each step (redacted) with its result
    after: Plan  # the re-plan: empty steps when the target converged

    def to_json(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "after": self.after.to_json()}


def _fill_secrets(step: Step, key_provider: KeyProvider | None) -> dict[str, Any]:
    if step.secret_ref is None:
        return dict(step.params)
    if key_provider is None:
        raise SpdkError(f"{step.method} {step.secret_ref}: no key store given (key_provider)")
    key, key2 = key_provider(step.secret_ref)
    return {**step.params, "key": key, "key2": key2}


def apply(
    desired: SpdkDesired,
    client: SpdkClient,
    key_provider: KeyProvider | None,
    *,
    prune: bool | None = None,
) -> ApplyResult:
    """Plan, refuse on conflicts, run each step through its typed wrapper, re-plan."""
    todo = plan(desired, client, key_provider, prune=prune)
    if todo.conflicts:
        raise PlanConflict(todo.conflicts)
    applied: list[dict[str, Any]] = []
    for i, step in enumerate(todo.steps):
        wrapper = getattr(client, step.method)
        try:
            result = wrapper(**_fill_secrets(step, key_provider))
        except SpdkError as e:
            _log.warning("spdk_apply_failed", step=i + 1, method=step.method, error=str(e))
            raise ApplyError(i, step, len(applied), e) from e
        _log.info("spdk_apply_step", step=i + 1, method=step.method, why=step.why)
        applied.append({**step.to_json(), "result": result})
    after = plan(desired, client, key_provider, prune=prune)
    if after.steps:
        _log.warning("spdk_apply_not_converged", remaining=len(after.steps))
    return ApplyResult(applied=tuple(applied), after=after)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftReport:
    missing: tuple[str, ...] = ()  # desired, absent on the target (removed behind our back?)
    extra: tuple[str, ...] = ()  # on the target, not desired (created behind our back?)
    changed: tuple[str, ...] = ()  # present but different in a way plan will not fix
    pending: tuple[dict[str, Any], ...] = ()  # the steps `apply` would run (redacted)

    @property
    def in_sync(self) -> bool:
        return not (self.missing or self.extra or self.changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "in_sync": self.in_sync,
            "missing": list(self.missing),
            "extra": list(self.extra),
            "changed": list(self.changed),
            "pending": list(self.pending),
        }


def status(
    desired: SpdkDesired, client: SpdkClient, key_provider: KeyProvider | None = None
) -> DriftReport:
    """Compare without changing anything; extras are reported whatever `prune` says."""
    p = plan(desired, client, key_provider, prune=True)
    missing = [s.why for s in p.steps if not _is_removal(s)]
    extra = [s.why for s in p.steps if _is_removal(s)]
    kept = plan(desired, client, key_provider, prune=False) if not desired.prune else p
    return DriftReport(
        missing=tuple(missing),
        extra=tuple(extra) + tuple(u for u in p.unmanaged),
        changed=p.conflicts,
        pending=tuple(s.to_json() for s in kept.steps),
    )


def _is_removal(step: Step) -> bool:
    if step.method == "nvmf_subsystem_allow_any_host":
        return step.params.get("allow_any_host") is False
    return any(w in step.method for w in ("delete", "remove", "destroy", "detach"))
