"""Who may see the dashboard and act through it: a bearer token (or HTTP Basic with the token as
password, so a browser prompts), loopback only when there is no token, and a CSRF token on every
action (a browser resends Basic credentials on a cross-site POST; the token it cannot read)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

REALM = "keyexpiry"


def is_loopback(host: str | None) -> bool:
    """Whether a peer address (or a bind address) is this machine; no address is a unix
    socket, which is local too."""
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def token_matches(header: str | None, token: str) -> bool:
    """`Authorization: Bearer TOKEN`, or Basic with any user name and TOKEN as password."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return hmac.compare_digest(value.encode(), token.encode())
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        _, _, password = decoded.partition(":")
        return hmac.compare_digest(password.encode(), token.encode())
    return False


class Guard:
    """ASGI middleware: every request authenticated (or from loopback when there is no token)."""

    def __init__(
        self, app: ASGIApp, *, token: str | None, on_close: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self.token = token or None
        self._on_close = on_close

    def close(self) -> None:
        """Release what the app holds (its ledger and Redis connections). Served on its own
        the app does this at shutdown; mounted in another app, whose lifespan Starlette does not
        pass on to it, call this from that app's shutdown."""
        if self._on_close is not None:
            self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> Response | None:
        if self.token is None:
            peer = request.client.host if request.client else None
            if is_loopback(peer):
                return None
            return PlainTextResponse(
                "keyexpiry web: no KEYEXPIRY_WEB_TOKEN is set, so only loopback may connect\n",
                status_code=403,
            )
        if token_matches(request.headers.get("authorization"), self.token):
            return None
        return PlainTextResponse(
            "authentication required\n",
            status_code=401,
            headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
        )


class Csrf:
    """A per-process secret; forms carry a token derived from it, actions check it."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)
        self.token = hmac.new(self._secret, b"keyexpiry-web-actions", hashlib.sha256).hexdigest()

    def valid(self, request: Request, submitted: str | None) -> bool:
        """The form's token matches, and the browser's Origin (when it sends one) is this site."""
        if not submitted or not hmac.compare_digest(submitted.encode(), self.token.encode()):
            return False
        origin = request.headers.get("origin")
        if origin and origin != "null":
            host = request.headers.get("host", "")
            return origin.split("://", 1)[-1] == host
        return True


SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
"""Sent with every page: no framing (clickjacking), no inline script, no caching of task data."""
