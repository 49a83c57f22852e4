"""The listener's HTTP endpoints (`listen --http HOST:PORT`): Prometheus `/metrics`, `/healthz`
(the process answers) and `/readyz` (it can do its job now: subscribed, events arriving, the
ledger reachable). A thread of its own, so a scrape never waits on the listener's hot path."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from loguru import logger
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import ConfigError
from keyexpiry.metrics import LedgerCollector, ListenerCollector

if TYPE_CHECKING:
    from keyexpiry.listener import Listener

_LEDGER_PROBE_EVERY_S = 1.0
"""A readiness check reuses a ledger answer at most this old (probes may come many a second)."""

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def parse_bind(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `:PORT` (all interfaces) as (host, port)."""
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--http {value!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


class Readiness:
    """Whether the listener can run due tasks now, and if not, why (one line per reason)."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._ledger_checked_s = -1e9
        self._ledger_problem: str | None = None

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
        return out

    def ready(self) -> bool:
        """True when `reasons()` is empty."""
        return not self.reasons()

    def _ledger(self) -> str | None:
        with self._lock:
            if monotonic_s() - self._ledger_checked_s >= _LEDGER_PROBE_EVERY_S:
                try:
                    self._listener.store.ping()
                    self._ledger_problem = None
                except Exception as exc:
                    self._ledger_problem = str(exc).splitlines()[0][:300]
                self._ledger_checked_s = monotonic_s()
            return self._ledger_problem


class Endpoints:
    """Serves /metrics, /healthz and /readyz for one listener until `stop()`."""

    def __init__(self, listener: Listener, bind: str) -> None:
        self.host, self.port = parse_bind(bind)
        self.readiness = Readiness(listener)
        self.registry = CollectorRegistry()
        self.registry.register(ListenerCollector(listener, self.readiness.ready))
        self.registry.register(
            LedgerCollector(
                listener.store,
                listener.clock.now_ms,
                live_window_s=listener.settings.takeover_after_s,
            )
        )
        # The run metrics live on the runtime (the workers observe them there).
        run_metrics = listener.rt.metrics
        run_metrics.declare(spec.label for spec in listener.registry.specs())
        run_metrics.enabled = True
        self.registry.register(run_metrics)
        self._metrics_app = make_wsgi_app(self.registry)
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve in a daemon thread (raises ConfigError if the address is taken)."""
        try:
            server = make_server(
                self.host, self.port, self._app, ThreadingWSGIServer, handler_class=_Quiet
            )
        except OSError as exc:
            raise ConfigError(f"--http {self.host}:{self.port}: cannot listen: {exc}") from None
        self._server = server
        self.port = server.server_port  # port 0 picks a free one (tests)
        self._thread = threading.Thread(
            target=server.serve_forever, name="http", kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()
        logger.info("serving /metrics, /healthz and /readyz on http://{}:{}", self.host, self.port)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
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


def _text(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
        ],
    )
    return [data]


class _Quiet(WSGIRequestHandler):
    """No access log on stderr (Prometheus scrapes every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
