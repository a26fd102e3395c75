"""TLS for the control plane: the agent's server context and the exposure warning.

Tokens and the NVMe keys the agent issues (hello) travel on the control plane, so beyond
loopback it must be TLS: `[control] tls_cert` / `tls_key` (PEM) turn it on for the TCP
listener (the Unix socket stays local, mode 0600); `tls_client_ca` makes client certificates
mandatory (mutual TLS: hosts and other agents of the cluster present a certificate that CA
signed). Clients use `tls://host:port` URLs (host_shim.client). Python's `ssl` does this part:
certificates, no external PSK.
"""

from __future__ import annotations

import ipaddress
import ssl

from dpu_agent.config import AgentConfig

__all__ = ["exposure_warning", "peer_client_context", "server_context"]


def server_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    """The control listener's TLS context, or None when [control] has no certificate."""
    c = cfg.control
    if not c.tls_cert:
        if c.tls_key or c.tls_client_ca:
            raise ValueError("[control] tls_key/tls_client_ca need tls_cert")
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    cert, key = cfg.path(c.tls_cert), cfg.path(c.tls_key) if c.tls_key else None
    try:  # ssl's errors name no file ("[Errno 2] No such file or directory", "[SSL] PEM lib")
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"[control] tls_cert {cert}"
            + (f" / tls_key {key}" if key else "")
            + f": cannot load the certificate and key ({e})"
        ) from None
    if c.tls_client_ca:
        try:
            ctx.load_verify_locations(cfg.path(c.tls_client_ca))
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"[control] tls_client_ca {cfg.path(c.tls_client_ca)}: cannot load it ({e})"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_client_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    """What this agent connects to tls:// members with: their certificates verified against
    [cluster] peer_tls_ca (or [control] tls_client_ca), host names checked, and this agent's
    own control certificate presented (members with tls_client_ca require one). None when no
    CA is configured: a tls:// member is then refused with that reason (cluster/_peer.py)."""
    ca = cfg.cluster.peer_tls_ca or cfg.control.tls_client_ca
    if not ca:
        return None
    ctx = ssl.create_default_context(cafile=cfg.path(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    c = cfg.control
    if c.tls_cert:
        ctx.load_cert_chain(cfg.path(c.tls_cert), cfg.path(c.tls_key) if c.tls_key else None)
    return ctx


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def exposure_warning(cfg: AgentConfig) -> str | None:
    """What `dpuctl agent run` warns about: a control plane beyond loopback without TLS."""
    c = cfg.control
    if c.tls_cert or _loopback(c.host):
        return None
    return (
        f"the control plane listens on {c.host}:{c.port} beyond loopback WITHOUT TLS: tenant "
        "tokens and the NVMe keys the agent issues cross the network in the clear; set "
        "[control] tls_cert and tls_key (and tls_client_ca for client certificates)"
    )
