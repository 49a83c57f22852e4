"""Trace context: with OpenTelemetry installed (`keyexpiry[otel]`), a create stores the caller's
W3C `traceparent` in the task's row, and the listener runs the handler in a span that is a child
of it: one trace from the request that scheduled a task to the handler's own spans, however long
the delay. Claims and outcomes are spans too.

Without OpenTelemetry nothing is imported: every function here returns at once (None, or a
context manager that does nothing), found out once per process. With its API installed but no
tracer provider set (no SDK configured), spans are not made either: each would be a no-op span
that still cost a claim about 4.5 % of its CPU (py-spy `--gil`, a fleet listener, 2026-12-06).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_TRACER_NAME = "keyexpiry"
_api: Any = None
"""`opentelemetry.trace` once looked up; False when it is not installed."""
_tracer: Any = None
"""keyexpiry's tracer, made once: OpenTelemetry's API hands out a proxy that follows a tracer
provider set later, so one made before the application sets its SDK up still records."""


def _otel() -> Any:
    global _api, _tracer
    if _api is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = False
        else:
            _tracer = trace.get_tracer(_TRACER_NAME)
            _api = trace
    return _api


def _tracing() -> Any:
    """`opentelemetry.trace` when spans would be recorded: a tracer provider is set (by the
    application, or named by `OTEL_PYTHON_TRACER_PROVIDER`); else None. Asked at every span, so
    a provider set after the listener started is followed, as the proxy tracer would."""
    trace = _otel()
    if not trace:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return trace


def current_traceparent() -> str | None:
    """The W3C `traceparent` of the span current in the caller, None without one (or without
    OpenTelemetry)."""
    trace = _otel()
    if not trace:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _parent(traceparent: str | None) -> Any:
    """The OpenTelemetry context whose span is the remote parent `traceparent` names (None for
    none, or for a value that is no traceparent: a row written by hand)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    trace = _otel()
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def run_span(
    label: str, key: str, attempt: int, late_ms: int | None, traceparent: str | None
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What a handler's run is wrapped in: a span `run Class.method`, child of the create's
    trace, current while the handler runs (its own spans nest under it), with the key, attempt
    and lateness as attributes; an exception it raises is recorded on it. Without OpenTelemetry
    (or a tracer provider) a context manager that does nothing."""
    trace = _tracing()
    if not trace:
        return contextlib.nullcontext
    attributes: dict[str, Any] = {"keyexpiry.key": key, "keyexpiry.attempt": attempt}
    if late_ms is not None:
        attributes["keyexpiry.late_ms"] = late_ms

    def span() -> contextlib.AbstractContextManager[Any]:
        return _tracer.start_as_current_span(  # type: ignore[no-any-return]
            f"run {label}",
            context=_parent(traceparent),
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
        )

    return span


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A span `name` around a step of the listener (a claim, recording outcomes); nothing
    without OpenTelemetry or a tracer provider."""
    trace = _tracing()
    if not trace:
        yield
        return
    with _tracer.start_as_current_span(name, attributes=attributes):
        yield
