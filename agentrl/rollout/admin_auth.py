"""Who may call admin routes: weight updates, LoRA loads, sleep/wake, and the gateway's session control.

A server bound to loopback only is reachable from this machine alone, so its admin routes stay open
there (as before). One that binds any other address needs a bearer token: the caller's, else
`$AGENTRL_ADMIN_TOKEN`, else a random one made for this run (`resolve_admin_token`). An app built
without a token still answers admin calls from loopback clients only, and `start_server_in_thread`
refuses to bind such an app to a non-loopback address, so open admin routes never face a network.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable

from starlette.requests import Request

ADMIN_TOKEN_ENV = "AGENTRL_ADMIN_TOKEN"

__all__ = ["ADMIN_TOKEN_ENV", "AdminAuthError", "admin_headers", "build_admin_guard", "is_loopback",
           "resolve_admin_token"]  # fmt: skip


class AdminAuthError(Exception):
    """An admin call without the right token (401) or from off this machine with none configured (403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_admin_token(host: str, token: str | None = None) -> str | None:
    """The token the admin routes of an app bound to `host` require; None leaves them open to loopback.

    `token`, else `$AGENTRL_ADMIN_TOKEN`, else a fresh random token when `host` is not loopback.
    """
    token = token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(32)
    return token


def admin_headers(token: str | None) -> dict[str, str]:
    """`Authorization: Bearer <token>` for admin calls, or nothing where no token is configured."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def build_admin_guard(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that raises AdminAuthError unless the request may use admin routes."""

    async def guard(request: Request) -> None:
        if token is None:
            client = request.client.host if request.client else ""
            if not is_loopback(client):
                raise AdminAuthError(
                    f"admin routes answer loopback clients only (this call came from {client or 'unknown'}); "
                    f"start the server with an admin token (argument or ${ADMIN_TOKEN_ENV}) to allow remote calls",
                    403,
                )
            return
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), token.encode()):
            raise AdminAuthError(
                "admin route: missing or wrong bearer token (send 'Authorization: Bearer <token>'; "
                f"the token is the one the server was started with, or ${ADMIN_TOKEN_ENV})",
                401,
            )

    return guard
