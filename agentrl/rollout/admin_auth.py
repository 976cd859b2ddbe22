"""Who may call admin routes: weight updates, LoRA loads, sleep/wake, and the gateway's session control.

Every bind needs the bearer token, loopback included: on a shared host every user's process is local. The
token is the caller's, else `$AGENTRL_ADMIN_TOKEN`, else one made at random once per process
(`process_admin_token`). Servers, gateways and pools built in the same process default to that one token, so
the trainer's own clients carry it without being told; `agentrl serve` writes it to a file of mode 0600.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request

ADMIN_TOKEN_ENV = "AGENTRL_ADMIN_TOKEN"

__all__ = ["ADMIN_TOKEN_ENV", "AdminAuthError", "admin_headers", "build_admin_guard", "process_admin_token",
           "resolve_admin_token", "write_token_file"]  # fmt: skip

_PROCESS_TOKEN = secrets.token_urlsafe(32)


class AdminAuthError(Exception):
    """An admin call without a bearer token (401) or with the wrong one (403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def process_admin_token() -> str:
    """`$AGENTRL_ADMIN_TOKEN` when set, else this process's random token (the same for every call)."""
    return os.environ.get(ADMIN_TOKEN_ENV) or _PROCESS_TOKEN


def resolve_admin_token(token: str | None = None) -> str:
    """The token an app's admin routes require: `token`, else `process_admin_token()`."""
    return token or process_admin_token()


def admin_headers(token: str) -> dict[str, str]:
    """`Authorization: Bearer <token>` for admin calls."""
    return {"Authorization": f"Bearer {token}"}


def write_token_file(path: str | Path, token: str) -> Path:
    """Write `token` to `path` readable by its owner only (0600, set before the token goes in)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode under O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def build_admin_guard(token: str) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that raises AdminAuthError unless the request carries `Bearer <token>`."""

    async def guard(request: Request) -> None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AdminAuthError(
                "admin route: no bearer token (send 'Authorization: Bearer <token>'; the token is the one "
                f"the server was started with: `agentrl serve` writes it to a file and prints its path, or set "
                f"${ADMIN_TOKEN_ENV})",
                401,
            )
        if not secrets.compare_digest(value.strip().encode(), token.encode()):
            raise AdminAuthError("admin route: wrong bearer token", 403)

    return guard
