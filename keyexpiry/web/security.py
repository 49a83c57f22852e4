"""Who may see the dashboard and act through it: a bearer token (or HTTP Basic with the token as
password, so a browser prompts), loopback only when there is no token, a Host check against DNS
rebinding, and a CSRF token on every action (a browser resends Basic credentials on a
cross-site POST; the token it cannot read). Every response carries the security headers, and a
request body is capped before anything reads it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable

import anyio
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import ConfigError

REALM = "keyexpiry"
MIN_TOKEN_CHARS = 16
"""Shortest accepted token: 16 random characters are beyond guessing at any rate."""
MAX_BODY_BYTES = 64 * 1024
"""Largest request body read (an action's form is a key and a CSRF token: well under 2 KiB)."""
FAILURE_DELAY_S = 1.0
"""A request with wrong credentials is answered 401 this much later."""
FAILURES_PER_PEER = 8
"""Wrong attempts one client address may make in a burst; beyond, its wrong attempts are
answered 429 at once. Its budget comes back one attempt every `FAILURE_REFILL_S`."""
FAILURE_REFILL_S = 10.0
"""A client address regains one wrong attempt this often (6 a minute, once its burst is spent)."""
MAX_DELAYED_FAILURES = 64
"""Wrong attempts waiting out their delay at once, all addresses together; beyond, wrong ones
are answered 429 at once. The wait costs a sleeping coroutine, never a thread."""
MAX_TRACKED_PEERS = 4096
"""Client addresses whose wrong attempts are remembered; the one that failed longest ago is
forgotten first."""

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
"""Sent with every response (a header the response sets itself, e.g. the stylesheet's
Cache-Control, is kept): no framing (clickjacking), no inline script, no caching of task data."""


def is_loopback(host: str | None) -> bool:
    """Whether a peer address (or a bind address) is this machine; no address is a unix
    socket, which is local too."""
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def check_token(token: str) -> None:
    """Raise ConfigError when `token` is too short to stand between the network and the
    dashboard's actions."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"the dashboard token (KEYEXPIRY_WEB_TOKEN) must be at least {MIN_TOKEN_CHARS} "
            f"characters (got {len(token)}); make one with: "
            "python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )


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


def host_name(header: str | None) -> str | None:
    """The name in a `Host` header, lower-case, without its port or an IPv6 address's
    brackets; None when there is none or it is malformed."""
    text = (header or "").strip().lower()
    if text.startswith("["):
        name, closed, rest = text[1:].partition("]")
        if not closed:
            return None
    else:
        name, _, port = text.partition(":")
        rest = f":{port}" if port else ""
    if not name or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
        return None
    return name


class HostCheck:
    """Which `Host` names are served. A DNS-rebinding page reaches a loopback server under the
    attacker's own name, so without a token only loopback names (and the address the request
    came in on) are; with a token the token protects, and `allowed` narrows the names."""

    def __init__(self, allowed: Iterable[str], *, token_set: bool) -> None:
        self.allowed = tuple(h.lower().strip("[]") for h in allowed)
        self.token_set = token_set
        wildcards = [h for h in self.allowed if h.startswith("*")]
        if wildcards and not token_set:
            # A wildcard matches names the attacker controls (`*` any, `*.nip.io` every
            # address): a rebound page would be served, and only the token would stop it.
            raise ConfigError(
                f"KEYEXPIRY_WEB_ALLOWED_HOSTS lists the wildcard {wildcards[0]!r}, which "
                "without KEYEXPIRY_WEB_TOKEN would let a DNS-rebinding page in: set a token, "
                "or list the host names themselves"
            )

    def accepts(self, name: str | None, bound: str | None) -> bool:
        """Whether a request whose Host is `name` (see `host_name`) is served; `bound` is the
        local address it arrived on."""
        if name is None:
            return False
        if any(
            name == h or h == "*" or (h[:2] == "*." and name.endswith(h[1:])) for h in self.allowed
        ):
            return True
        if self.token_set:
            return not self.allowed
        return name == "localhost" or _is_loopback_ip(name) or name == (bound or "").lower()

    def refusal(self, header: str | None) -> str:
        """The one line that says why `header` was refused and what would be accepted."""
        shown = repr((header or "")[:80])
        if self.token_set:
            return f"keyexpiry web: Host {shown} is not in KEYEXPIRY_WEB_ALLOWED_HOSTS\n"
        return (
            f"keyexpiry web: Host {shown} refused: without KEYEXPIRY_WEB_TOKEN only loopback "
            "names (localhost, 127.0.0.1, [::1]) are served, against DNS rebinding; list other "
            "names in KEYEXPIRY_WEB_ALLOWED_HOSTS\n"
        )


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _FailureThrottle:
    """Wrong credentials answered late, with a budget per client address (`FAILURES_PER_PEER`,
    refilled every `FAILURE_REFILL_S`) and a bound on how many wait at once in all
    (`MAX_DELAYED_FAILURES`). An address past its budget is refused before its token is checked
    (a right guess must look like a wrong one); other addresses, the operator's, are never
    refused for it. The dashboard runs on one event loop: plain counters hold."""

    def __init__(self, now_s: Callable[[], float] = monotonic_s) -> None:
        self.waiting = 0
        self._now_s = now_s
        self._spent: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """Client address -> (attempts spent, when last charged), the oldest charge first."""

    def blocked(self, peer: str | None) -> float | None:
        """Seconds until `peer` may try again when its budget is spent, else None. Asked before
        the token is checked: an address past its budget learns nothing of its guesses."""
        spent = self._spent_now(_peer_key(peer), self._now_s())
        return (
            (spent + 1 - FAILURES_PER_PEER) * FAILURE_REFILL_S
            if spent + 1 > FAILURES_PER_PEER
            else None
        )

    def charge(self, peer: str | None) -> float | None:
        """Count a wrong attempt from `peer`: None when it is to be answered late (then await
        `delay()`), else the seconds until that address may try again, to answer 429 at once.
        An attempt answered at once (too many waiting) is charged all the same, so the budget
        bounds every address's guesses whatever the server's load."""
        now = self._now_s()
        key = _peer_key(peer)
        spent = self._spent_now(key, now)
        if spent + 1 > FAILURES_PER_PEER:
            return (spent + 1 - FAILURES_PER_PEER) * FAILURE_REFILL_S
        self._spent[key] = (spent + 1, now)
        self._spent.move_to_end(key)
        self._forget(now)
        if self.waiting >= MAX_DELAYED_FAILURES:
            return FAILURE_DELAY_S
        return None

    async def delay(self) -> None:
        self.waiting += 1
        try:
            await anyio.sleep(FAILURE_DELAY_S)
        finally:
            self.waiting -= 1

    def _spent_now(self, key: str, now: float) -> float:
        spent, at = self._spent.get(key, (0.0, now))
        return max(0.0, spent - (now - at) / FAILURE_REFILL_S)

    def _forget(self, now: float) -> None:
        """Drop addresses whose budget is whole again, and the oldest beyond the bound."""
        while self._spent:
            key = next(iter(self._spent))
            if len(self._spent) <= MAX_TRACKED_PEERS and self._spent_now(key, now) > 0:
                return
            del self._spent[key]


def _peer_key(peer: str | None) -> str:
    """Whose budget a request spends: its address, or its /64 for IPv6 (one host may hold a
    whole /64)."""
    if peer is None:
        return ""
    try:
        address = ipaddress.ip_address(peer.split("%")[0])
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else address)


class Guard:
    """ASGI middleware in front of every request: Host, peer, credentials, body size; and the
    security headers on every response, errors included."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        allowed_hosts: Iterable[str] = (),
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.token = token or None
        if self.token is not None:
            check_token(self.token)
        self.hosts = HostCheck(allowed_hosts, token_set=self.token is not None)
        self._throttle = _FailureThrottle()
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

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        refusal = await self._refusal(Request(scope))
        if refusal is None:
            body = await _read_body(scope, receive)
            if isinstance(body, list):
                await self.app(scope, _replay(body, receive), send_secured)
                return
            refusal = body
        await refusal(scope, receive, send_secured)

    async def _refusal(self, request: Request) -> Response | None:
        header = request.headers.get("host")
        bound = request.scope.get("server")
        if not self.hosts.accepts(host_name(header), bound[0] if bound else None):
            return PlainTextResponse(self.hosts.refusal(header), status_code=403)
        if self.token is None:
            peer = request.client.host if request.client else None
            if is_loopback(peer):
                return None
            return PlainTextResponse(
                "keyexpiry web: no KEYEXPIRY_WEB_TOKEN is set, so only loopback may connect\n",
                status_code=403,
            )
        credentials = request.headers.get("authorization")
        peer = request.client.host if request.client else None
        # An address past its budget is refused before its token is checked, or each guess
        # would get an instant yes or no; the budget is per address, so a guesser never locks
        # out an operator elsewhere.
        retry_s = self._throttle.blocked(peer) if credentials else None
        if retry_s is None and token_matches(credentials, self.token):
            return None
        if credentials:
            if retry_s is None:
                retry_s = self._throttle.charge(peer)
            if retry_s is not None:
                return PlainTextResponse(
                    "too many failed attempts from this address: try again later\n",
                    status_code=429,
                    headers={"Retry-After": str(math.ceil(retry_s))},
                )
            await self._throttle.delay()
        return PlainTextResponse(
            "authentication required\n",
            status_code=401,
            headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
        )


async def _read_body(scope: Scope, receive: Receive) -> list[Message] | Response:
    """The request's body messages, read up to `MAX_BODY_BYTES`; a refusal beyond that (or for
    a Content-Length saying so, before reading anything)."""
    too_large = PlainTextResponse(
        f"request body over {MAX_BODY_BYTES} bytes\n",
        status_code=413,
        headers={"Connection": "close"},
    )
    length = Headers(scope=scope).get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        return too_large
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages  # the client went away: the app hears it
        size += len(message.get("body", b""))
        if size > MAX_BODY_BYTES:
            return too_large
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first hands out `messages` (the body already read)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class Csrf:
    """A per-process secret; forms carry a token derived from it, actions check it."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)
        self.token = hmac.new(self._secret, b"keyexpiry-web-actions", hashlib.sha256).hexdigest()

    def valid(self, request: Request, submitted: str | None) -> bool:
        """The form's token matches, and the browser's Origin (when it sends one) is this site.
        The Host it is compared with was checked by `Guard` (a rebinding page's Origin and Host
        are both the attacker's name, which `Guard` refuses)."""
        if not submitted or not hmac.compare_digest(submitted.encode(), self.token.encode()):
            return False
        origin = request.headers.get("origin")
        if origin and origin != "null":
            host = request.headers.get("host", "")
            return origin.split("://", 1)[-1].lower() == host.lower()
        return True
