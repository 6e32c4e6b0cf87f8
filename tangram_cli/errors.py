"""Errors of the operator's tools: inventories and `tangram up`. The library (``tangram/``) never
raises them, so they live here, with the CLI.

Each is a ``tangram.errors.TangramError`` with a ``hint`` and an ``exit_code``, so `tangram` prints
them as it prints every other error (one line, "To fix: ...", the exit code; tangram_cli/main.py):

    TangramError (tangram/errors.py)
     +-- ConfigError                  exit 2   (tangram/errors.py)
     |    +-- InventoryError          exit 2   bad inventory; the message names the entry and field
     +-- BootstrapError               exit 1   `tangram up` could not install or start an agent
          +-- HostUnreachable                  ssh exit 255, connection refused, DNS
          +-- AuthFailed                       "Permission denied"
          +-- HostKeyMismatch                  changed host key; known_hosts untouched
"""

from __future__ import annotations

from tangram.errors import ConfigError, TangramError

__all__ = ["AuthFailed", "BootstrapError", "HostKeyMismatch", "HostUnreachable", "InventoryError"]


class InventoryError(ConfigError):
    """The inventory is invalid; the message names the entry and field (`nodes[2].gpus`)."""


class BootstrapError(TangramError):
    """`tangram up` could not install or start an agent over SSH."""

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        hint: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.host = host


class HostUnreachable(BootstrapError):
    default_hint = "check the host name, port and network; `ssh` exited 255"


class AuthFailed(BootstrapError):
    default_hint = "install the deploy key in the host's authorized_keys, or fix `user` in the inventory"


class HostKeyMismatch(BootstrapError):
    default_hint = (
        "the host key changed; if that is expected, remove its line from Tangram's known_hosts file and rerun"
    )
