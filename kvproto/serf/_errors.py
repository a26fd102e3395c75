"""The Serf RPC codec's errors: protocol errors (ours or the agent's) and error replies."""

from __future__ import annotations

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError", "SerfError"]


class ProtocolError(Exception):
    """Base of both codec errors; after one the connection is in ERROR and must be closed."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The agent sent something the protocol forbids (or something we cannot bound)."""


class SerfError(Exception):
    """The agent answered a command with an error string (an operating error, not a bug):
    `command` and `error` are what was asked and what Serf said."""

    def __init__(self, command: str, error: str) -> None:
        super().__init__(f"serf {command}: {error.strip()}")
        self.command = command
        self.error = error
