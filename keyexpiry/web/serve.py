"""`keyexpiry web`'s port: uvicorn, held to the bounds of the listener's `--http` port
(`ops.connections`). At most a few dozen connections (the oldest one still sending its request
head is closed to make room for a new one), each request head due within seconds, a request
answered within a deadline, and an accept() that fails for want of descriptors said once a
minute. uvicorn alone kept every half-finished connection until the process ran out of
descriptors, then logged each failed accept() with its traceback."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import threading
from collections.abc import Iterable
from typing import Any

import uvicorn
from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from keyexpiry.errors import ConfigError
from keyexpiry.ops.connections import HttpLimits, OncePer, Slots
from keyexpiry.web.security import SECURITY_HEADERS

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_BACKLOG = 64
_STOP_WAIT_S = 5


class DashboardServer:
    """`app` served on `host:port` (bound at once: ConfigError if it cannot be) until `stop()`,
    or SIGTERM/SIGINT when `run()` runs on the main thread.

    `X-Forwarded-For` is read only from a peer in `trusted_proxies` (addresses or networks);
    from any other peer, loopback included, it is ignored: the client's own claim about its
    address."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        trusted_proxies: Iterable[str] = (),
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = limits or HttpLimits()
        self.started = threading.Event()
        """Set once the port accepts connections."""
        watch = _Watch(Slots(self.limits, evicted_close_at_once=True))
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self._sock = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        except OSError as exc:  # socket.gaierror included: a name that does not resolve
            raise ConfigError(f"--bind {host}:{port}: cannot listen: {exc}") from None
        self.port: int = self._sock.getsockname()[1]
        """The port bound (port 0 picks a free one)."""
        proxies = tuple(trusted_proxies)
        inner = _ForwardedFor(app, proxies) if proxies else app
        config = uvicorn.Config(
            _Answering(inner, watch),
            http=_bounded_protocol(watch),
            loop="asyncio",  # the accept() failures handled below are asyncio's
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # uvicorn's default trusts X-Forwarded-For from 127.0.0.1
            h11_max_incomplete_event_size=self.limits.max_head_bytes,
            timeout_keep_alive=max(1, int(self.limits.head_timeout_s)),
            # The kernel's queue, and how many connections asyncio accepts at once before any
            # is admitted (each takes a descriptor): uvicorn's 2048 ran a 256-descriptor
            # process out of them in one burst.
            backlog=_BACKLOG,
            # At stop, a page still waiting (on a hung ledger) is cancelled after this; uvicorn
            # would wait for it for ever.
            timeout_graceful_shutdown=_STOP_WAIT_S,
        )
        self._server = _Uvicorn(config, watch, self.started)
        uvicorn_log = logging.getLogger("uvicorn.error")  # configured by uvicorn.Config
        if not any(isinstance(f, _ClientNoise) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(_ClientNoise())

    @property
    def connection_cap(self) -> int:
        """Connections answered at once (beyond, the oldest unfinished head makes room)."""
        return self._server.watch.slots.cap

    @property
    def busy(self) -> int:
        """Connections whose request is being answered now."""
        return self._server.watch.slots.busy()

    def run(self) -> None:
        """Serve until stopped (blocks)."""
        self._server.run(sockets=[self._sock])

    def stop(self) -> None:
        """Ask `run()` to return once connections close (from any thread)."""
        self._server.should_exit = True


class _Watch:
    """What the protocol and the middleware share: the slots, and which connection a request
    arrived on (by its peer address, the one thing an ASGI scope says of its connection)."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.by_peer: dict[tuple[str, int], _Transport] = {}


class _Transport:
    """A connection as `Slots` cuts it: aborted, which frees its descriptor at once, even while
    its answer is still being worked out."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def shutdown(self, how: int, /) -> None:
        self.transport.abort()  # type: ignore[attr-defined]


def _bounded_protocol(watch: _Watch) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, each connection admitted by `watch.slots` and released there."""

    class BoundedH11Protocol(H11Protocol):
        handle: _Transport | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            handle = _Transport(transport)
            if not watch.slots.admit(handle):
                transport.abort()  # every slot is answering: refused, nothing more to do
                return
            self.handle = handle
            super().connection_made(transport)
            if self.client is not None:
                watch.by_peer[self.client] = handle

        def connection_lost(self, exc: Exception | None) -> None:
            if self.handle is None:
                return  # refused in connection_made, before uvicorn knew of it
            watch.slots.release(self.handle)
            if self.client is not None and watch.by_peer.get(self.client) is self.handle:
                del watch.by_peer[self.client]
            super().connection_lost(exc)

    return BoundedH11Protocol


class _Answering:
    """Tells the slots when a request's head is in (its connection is no longer evictable) and
    when its answer is sent (kept alive, it waits for its next head under the head timeout);
    answers 503 at once when every slot is busy."""

    def __init__(self, app: ASGIApp, watch: _Watch) -> None:
        self.app = app
        self.watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") if scope["type"] == "http" else None
        handle = self.watch.by_peer.get(tuple(client)) if client else None
        if handle is None:
            await self.app(scope, receive, send)
            return
        slots = self.watch.slots
        if not slots.head_read(handle, scope["path"]):
            await _busy(send)
            return

        async def answering(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                slots.answered(handle)

        await self.app(scope, receive, answering)


async def _busy(send: Send) -> None:
    body = b"keyexpiry web: every connection is in use: try again shortly\n"
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
        *((name.lower().encode(), value.encode()) for name, value in SECURITY_HEADERS.items()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _ForwardedFor:
    """The client's address from `X-Forwarded-For`, for a request whose peer is a trusted proxy:
    the rightmost address in it that is not itself a trusted proxy (those left of it are
    whatever the client sent). Not an address there: the proxy stays the client."""

    def __init__(self, app: ASGIApp, proxies: Iterable[str]) -> None:
        self.app = app
        self.networks = [ipaddress.ip_network(p, strict=False) for p in proxies]

    def trusted(self, host: str) -> bool:
        address = _address(host)
        return address is not None and any(address in net for net in self.networks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] == "http" and client and self.trusted(client[0]):
            hops = [
                hop.strip()
                for name, value in scope["headers"]
                if name == b"x-forwarded-for"
                for hop in value.decode("latin-1").split(",")
                if hop.strip()
            ]
            forwarded = next((hop for hop in reversed(hops) if not self.trusted(hop)), None)
            address = _address(forwarded) if forwarded else None
            if address is not None:
                scope = {**scope, "client": (str(address), 0)}
        await self.app(scope, receive, send)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class _ClientNoise(logging.Filter):
    """uvicorn's warnings about one client's request, each said once a minute: any client can
    send a malformed request on every connection, and a line each is a log flood."""

    def __init__(self) -> None:
        super().__init__()
        self._said = {
            prefix: OncePer(60)
            for prefix in (
                "Invalid HTTP request received",
                "Unsupported upgrade request",
                "No supported WebSocket library",
            )
        }

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        said = next((once for prefix, once in self._said.items() if text.startswith(prefix)), None)
        return said is None or said.due()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, reaping late connections each tick and saying a failing accept() once
    a minute (asyncio retries it every second, logging a traceback each time)."""

    def __init__(self, config: uvicorn.Config, watch: _Watch, ready: threading.Event) -> None:
        super().__init__(config)
        self.watch = watch
        self.ready = ready
        self._accept_warning = OncePer(60)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets)
        if self.started:
            self.ready.set()

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s: the head timeout and the deadline hold to that.
        self.watch.slots.reap()
        return await super().on_tick(counter)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        accepting = "accept" in str(context.get("message", ""))
        if accepting and isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            if self._accept_warning.due():
                logger.warning(
                    "keyexpiry web: cannot accept connections: {}; pausing (said once a minute)",
                    exc,
                )
            return
        loop.default_exception_handler(context)
