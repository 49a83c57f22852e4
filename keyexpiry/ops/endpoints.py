"""The listener's HTTP endpoints (`listen --http HOST:PORT`): Prometheus `/metrics`, `/healthz`
(the process answers) and `/readyz` (it can do its job now: subscribed, events arriving, the
ledger reachable). A thread of its own, so a scrape never waits on the listener's hot path; a
request waits on the ledger a bounded time, and `/healthz`, which does no I/O, has slots kept
for it."""

from __future__ import annotations

import errno
import io
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from loguru import logger
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from keyexpiry.errors import ConfigError
from keyexpiry.ops.connections import ACCEPT_PAUSE_S, HttpLimits, OncePer, Slots
from keyexpiry.ops.metrics import LatestAnswer, LedgerCollector, ListenerCollector
from keyexpiry.ops.observed import ObservedListener
from keyexpiry.settings import parse_bind as _parse_bind

_LEDGER_PROBE_EVERY_S = 1.0
"""A readiness check reuses a ledger answer at most this old (probes may come many a second)."""

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

# HttpLimits lived here before `keyexpiry web` shared it: still importable from here.
__all__ = ["Endpoints", "HttpLimits", "Readiness", "parse_bind"]


def parse_bind(value: str) -> tuple[str, int]:
    """`--http`'s `HOST:PORT`, `[::1]:PORT` or `:PORT` (all interfaces) as (host, port)."""
    return _parse_bind(value, "--http")


class Readiness:
    """Whether the listener can run due tasks now, and if not, why (one line per reason)."""

    def __init__(self, listener: ObservedListener, ledger_wait_s: float = 1.0) -> None:
        self._listener = listener
        self._probe = LatestAnswer(
            self._ping,
            name="http-ledger-probe",
            max_age_s=_LEDGER_PROBE_EVERY_S,
            wait_s=ledger_wait_s,
        )

    def reasons(self) -> list[str]:
        """Empty when ready."""
        lst = self._listener
        out: list[str] = []
        if not lst.subscribed.is_set():
            out.append("not subscribed to expired events (Redis unreachable or reconnecting)")
        elif not lst.events_arriving:
            out.append("expired events are not arriving (the canary did not come back)")
        if lst.problem:
            out.append(f"redis: {lst.problem}")
        ledger = self._ledger()
        if ledger:
            out.append(f"ledger: {ledger}")
        elif lst.fleet.failing:
            out.append("heartbeat: not written (peers will take this listener's runs over)")
        out.extend(lst.failing())  # loops that keep failing (`Listener.failing`)
        return out

    def ready(self) -> bool:
        """True when `reasons()` is empty."""
        return not self.reasons()

    def _ledger(self) -> str | None:
        answer = self._probe.get()
        if answer.running_s is not None and answer.running_s >= self._probe.wait_s:
            return f"no answer for {answer.running_s:.1f} s"
        return answer.error

    def _ping(self) -> bool:
        self._listener.store.ping()
        return True


class Endpoints:
    """Serves /metrics, /healthz and /readyz for one listener until `stop()`."""

    def __init__(
        self, listener: ObservedListener, bind: str, limits: HttpLimits | None = None
    ) -> None:
        self.host, self.port = parse_bind(bind)
        self.limits = limits or HttpLimits()
        self.readiness = Readiness(listener, self.limits.ledger_wait_s)
        self.registry = CollectorRegistry()
        self.registry.register(ListenerCollector(listener, self.readiness.ready))
        self.registry.register(
            LedgerCollector(
                listener.store,
                listener.clock.now_ms,
                live_window_s=listener.settings.takeover_after_s,
                wait_s=self.limits.ledger_wait_s,
            )
        )
        # The workers observe these as runs start and end; declared here so each task's series
        # is served at 0 before its first run.
        run_metrics = listener.run_metrics
        run_metrics.declare(spec.label for spec in listener.registry.specs())
        run_metrics.enabled = True
        self.registry.register(run_metrics)
        self._metrics_app = make_wsgi_app(self.registry)
        self._server: _BoundedServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve in a daemon thread (raises ConfigError if the address is taken)."""
        try:
            server = make_server(
                self.host,
                self.port,
                _head_as_get(self._app),
                _BoundedServer,
                handler_class=_BoundedHandler,
            )
        except OSError as exc:
            raise ConfigError(f"--http {self.host}:{self.port}: cannot listen: {exc}") from None
        server.configure(self.limits)
        self._server = server
        self.port = server.server_port  # port 0 picks a free one (tests)
        self._thread = threading.Thread(
            target=server.serve_forever, name="http", kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()
        logger.info(
            "serving /metrics, /healthz and /readyz on http://{}:{} (at most {} connections, "
            "{} more for /healthz)",
            self.host,
            self.port,
            server.slots.cap,
            server.slots.kept,
        )

    @property
    def busy(self) -> int:
        """Connections being answered now, `/healthz` aside (at most the connection cap)."""
        return 0 if self._server is None else self._server.slots.busy()

    def stop(self) -> None:
        """Stop serving (idempotent); connections still open are closed."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.slots.close_all()
            self._server = None

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "GET":  # HEAD arrives here as GET
            return _text(
                start_response,
                "405 Method Not Allowed",
                "only GET and HEAD\n",
                [("Allow", "GET, HEAD")],
            )
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            reasons = self.readiness.reasons()
            if not reasons:
                return _text(start_response, "200 OK", "ready\n")
            body = "not ready:\n" + "".join(f"- {r}\n" for r in reasons)
            return _text(start_response, "503 Service Unavailable", body)
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        return _text(start_response, "404 Not Found", "try /metrics, /healthz or /readyz\n")


def _text(
    start_response: StartResponse,
    status: str,
    body: str,
    extra: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    data = body.encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            *(extra or []),
        ],
    )
    return [data]


def _head_as_get(app: WsgiApp) -> WsgiApp:
    """HEAD answered as GET without the body (monitors and load balancers probe with HEAD;
    prometheus_client's app answers it 405)."""

    def wrapped(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        answered: list[tuple[str, list[tuple[str, str]]]] = []

        def capture(status: str, headers: list[tuple[str, str]], *_: Any) -> Any:
            answered.append((status, headers))

        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, capture))
        status, headers = answered[-1]
        # The length GET would send (wsgiref would say 0 for an empty body).
        kept = [(k, v) for k, v in headers if k.lower() != "content-length"]
        start_response(status, [*kept, ("Content-Length", str(len(body)))])
        return []

    return wrapped


class _BoundedServer(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection server with the connections bounded
    (`Slots`), heads timed out and accept() paused when descriptors run out."""

    request_queue_size = 64  # the kernel's backlog: costs the process no descriptor
    slots: Slots

    def configure(self, limits: HttpLimits) -> None:
        self.slots = Slots(limits)
        self._accept_warning = OncePer(60)
        self._thread_warning = OncePer(60)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                if self._accept_warning.due():
                    logger.warning("--http: cannot accept connections: {}; pausing", exc)
                time.sleep(ACCEPT_PAUSE_S)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return isinstance(request, socket.socket) and self.slots.admit(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except Exception as exc:
            # No thread started (threads or memory ran out): the listener's problem, not the
            # client's, and nothing else will release the slot or close the connection.
            self.slots.release(request)
            self.shutdown_request(request)
            if self._thread_warning.due():
                logger.warning(
                    "--http: cannot start a thread to answer {}: {}: {}; connection closed "
                    "(said once a minute)",
                    client_address,
                    type(exc).__name__,
                    exc,
                )
        except BaseException:
            self.slots.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release(request)

    def service_actions(self) -> None:
        # Called by serve_forever at least every poll_interval (0.2 s).
        self.slots.reap()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Timeouts and resets from clients that went away: not the listener's problem, and a
        # traceback on stderr per hostile connection would be a log flood.
        logger.debug("--http: connection from {} ended early", client_address)


class _BoundedHandler(WSGIRequestHandler):
    """One request per connection, its head capped in size and time; no access log (Prometheus
    scrapes every few seconds)."""

    server: _BoundedServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.slots.limits.io_timeout_s)
        self.rfile = _CappedReader(self.rfile, self.server.slots.limits.max_head_bytes)

    def parse_request(self) -> bool:
        slots = self.server.slots
        if not super().parse_request():  # an error was sent
            slots.head_read(self.connection, None)
            return False
        if isinstance(self.rfile, _CappedReader) and self.rfile.exhausted:
            slots.head_read(self.connection, None)
            self.send_error(431, "Request Header Fields Too Large")
            return False
        if not slots.head_read(self.connection, self.path.partition("?")[0]):
            self.send_error(503, "Busy", "every connection is in use: try again shortly")
            return False
        return True

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _CappedReader(io.BufferedIOBase):
    """A connection's input that ends after `limit` bytes (a GET here has no body)."""

    def __init__(self, inner: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self._inner = inner
        self._left = limit

    @property
    def exhausted(self) -> bool:
        return self._left <= 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1, /) -> bytes:
        return self._take(lambda n: self._inner.read(n), size)

    def readline(self, size: int | None = -1, /) -> bytes:
        return self._take(lambda n: self._inner.readline(n), size)

    def close(self) -> None:
        self._inner.close()
        super().close()

    def _take(self, read: Callable[[int], bytes], size: int | None) -> bytes:
        room = self._left if size is None or size < 0 else min(size, self._left)
        data = read(room) if room > 0 else b""
        self._left -= len(data)
        return data
