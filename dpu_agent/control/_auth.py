"""Who may talk to the agent: per-tenant tokens and the admin token, compared in constant time."""

from __future__ import annotations

import hmac
import secrets

from kvproto.control import ADMIN_TENANT, TENANTS_MAX, valid_tenant_name

__all__ = ["TENANTS_MAX", "TenantRegistry"]

_DUMMY = secrets.token_urlsafe(32)  # compared against when the tenant is unknown


class TenantRegistry:
    """Tenant name -> token. Tokens are secrets: never logged, never returned by `list()`."""

    def __init__(self, admin_token: str, tenants: dict[str, str] | None = None) -> None:
        assert admin_token, "the admin token must be set (AgentConfig.prepare())"
        self._admin = admin_token
        self._tokens: dict[str, str] = {}
        # Each add() of a name is a new incarnation: sessions remember the one they
        # authenticated against, so a session of a removed tenant stays refused after a re-add.
        self._epochs: dict[str, int] = {}
        self._epoch_next = 1
        for name, token in (tenants or {}).items():
            self.add(name, token)

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._tokens

    def names(self) -> list[str]:
        return sorted(self._tokens)

    def authenticate(self, tenant: str, token: str) -> bool:
        """True when `token` is `tenant`'s (or the admin token for ADMIN_TENANT)."""
        if tenant == ADMIN_TENANT:
            expected = self._admin
        else:
            expected = self._tokens.get(tenant, _DUMMY)
        ok = hmac.compare_digest(expected.encode(), token.encode())
        return ok and (tenant == ADMIN_TENANT or tenant in self._tokens)

    def add(self, tenant: str, token: str) -> None:
        assert valid_tenant_name(tenant), tenant
        assert token, tenant
        if tenant not in self._tokens and len(self._tokens) >= TENANTS_MAX:
            raise ValueError(f"already {TENANTS_MAX} tenants (TENANTS_MAX); remove one first")
        self._tokens[tenant] = token
        self._epochs[tenant] = self._epoch_next
        self._epoch_next += 1

    def epoch(self, tenant: str) -> int:
        """The incarnation of `tenant` now (0: not a tenant)."""
        return self._epochs.get(tenant, 0)

    def remove(self, tenant: str) -> None:
        """Revoke the tenant's token; its sessions are refused from their next request."""
        self._tokens.pop(tenant, None)
        self._epochs.pop(tenant, None)
