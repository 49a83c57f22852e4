"""Trace context: with OpenTelemetry, one trace runs from the span that created a task to the
handler's own spans (the run's span a child of the creating span, with key, attempt and
lateness), claims and outcomes are spans too; without OpenTelemetry nothing is imported."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.creates import TaskRequest
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Spans finished while the test runs, kept in memory (the SDK's provider is set once per
    process: OpenTelemetry allows no other)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def _named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def test_one_trace_from_the_request_that_creates_a_task_to_the_handlers_span(
    spans: InMemorySpanExporter, client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    tracer = trace.get_tracer("shop")
    with tracer.start_as_current_span("POST /orders") as request:
        key = client.create(sample_tasks.Probe.traced, "t1", ttl_ms=50)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.traceparent is not None and row.traceparent.startswith("00-")
    trace_id = request.get_span_context().trace_id

    def finished(name: str) -> list[ReadableSpan]:
        return [s for s in _named(spans, name) if s.context.trace_id == trace_id]

    (run,) = finished("run Probe.traced")
    (inside,) = finished("inside the handler")
    assert run.parent is not None and run.parent.span_id == request.get_span_context().span_id
    assert inside.parent is not None and inside.parent.span_id == run.context.span_id
    attributes = dict(run.attributes or {})
    assert attributes["keyexpiry.key"] == key and attributes["keyexpiry.attempt"] == 1
    assert isinstance(attributes["keyexpiry.late_ms"], int)
    assert run.kind is trace.SpanKind.CONSUMER
    # The listener's own steps are spans too (in traces of their own: a claim serves many).
    # The record span ends after its commit, which `wait_status` may see first (a CI flake).
    wait_until(lambda: bool(_named(spans, "keyexpiry.record")), 10, message="no record span")
    assert _named(spans, "keyexpiry.claim") and _named(spans, "keyexpiry.record")


def test_a_failing_run_records_its_exception_and_each_attempt_is_a_span(
    spans: InMemorySpanExporter, client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    with trace.get_tracer("shop").start_as_current_span("batch job"):
        (key,) = client.create_many([TaskRequest(sample_tasks.Probe.fail_once, ["t2"], ttl_ms=50)])
    wait_status(client, key, TaskStatus.DONE)
    runs = sorted(_named(spans, "run Probe.fail_once"), key=lambda s: s.start_time or 0)
    assert [dict(r.attributes or {})["keyexpiry.attempt"] for r in runs] == [1, 2]
    assert runs[0].status.status_code is trace.StatusCode.ERROR
    assert any(e.name == "exception" for e in runs[0].events)
    assert runs[1].status.status_code is not trace.StatusCode.ERROR
    # Both attempts continue the trace of the span that created the task.
    assert len({r.context.trace_id for r in runs}) == 1


def test_a_create_outside_any_span_stores_no_traceparent(client: Client) -> None:
    key = client.create(sample_tasks.Probe.record, "untraced", ttl_s=60)
    row = client.store.get(key)
    assert row is not None and row.traceparent is None


def test_without_opentelemetry_nothing_is_imported_and_nothing_happens() -> None:
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed: its import fails
from keyexpiry import tracing
assert tracing.current_traceparent() is None
with tracing.run_span("A.m", "A@m", 1, 5, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")():
    pass
with tracing.span("keyexpiry.claim"):
    pass
assert tracing._api is False
assert not [m for m in sys.modules if m.startswith("opentelemetry.")], "imported"
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_with_the_api_but_no_tracer_provider_no_span_is_made() -> None:
    # OpenTelemetry's API installed without an SDK configured: the proxy tracer's no-op span
    # cost every claim; none is made until the application sets a provider, then spans are.
    code = """
import contextlib
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from keyexpiry import tracing
made = []
class Counting:
    def start_as_current_span(self, *args, **kwargs):
        made.append(args[0])
        return contextlib.nullcontext()
tracing._otel()
tracing._tracer = Counting()
assert tracing.run_span("A.m", "A@m", 1, 5, None) is contextlib.nullcontext
with tracing.span("keyexpiry.claim"):
    pass
assert made == [], made
trace.set_tracer_provider(TracerProvider())
with tracing.span("keyexpiry.claim"):
    pass
with tracing.run_span("A.m", "A@m", 1, 5, None)():
    pass
assert made == ["keyexpiry.claim", "run A.m"], made
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
