"""Threads' names as the operating system shows them, and the benchmark's CPU by thread name."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from keyexpiry import threads
from keyexpiry.bench.harness import MeasuredProcess, median_of
from keyexpiry.bench.servers.process import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")


def _native_names() -> set[str]:
    task = Path(f"/proc/{os.getpid()}/task")
    return {(d / "comm").read_text().strip() for d in task.iterdir()}


def test_a_spawned_thread_carries_its_name_to_the_os_cut_to_15_bytes() -> None:
    stop = threading.Event()
    started = threading.Event()

    def loop() -> None:
        started.set()
        stop.wait(10)

    thread = threads.spawn(
        "recorder-of-outcomes", loop, stopped=stop, errors=threads.ThreadErrors()
    )
    try:
        assert started.wait(5)
        assert "ke-recorder-of-" in _native_names()
    finally:
        stop.set()
        thread.join(5)


_BUSY = """
import threading, time
from keyexpiry import threads
stop = threading.Event()
def burn():
    end = time.monotonic() + 30
    while not stop.is_set() and time.monotonic() < end:
        sum(range(1000))
threads.spawn("burner", burn, stopped=stop, errors=threads.ThreadErrors())
threads.spawn("idler", lambda: stop.wait(30), stopped=stop, errors=threads.ThreadErrors())
print("ready", flush=True)
time.sleep(30)
"""


class _Busy(MeasuredProcess):
    def argv(self) -> list[str]:
        return ["-c", _BUSY]


def test_a_measured_process_tells_its_cpu_by_thread_name() -> None:
    with _Busy() as proc:
        wait_until(lambda: {"ke-burner", "ke-idler"} <= set(proc.thread_cpu_since_start()), 20)
        proc.mark_ready()
        wait_until(lambda: proc.thread_cpu_since_start()["ke-burner"] > 0.3, 20)
        spent = proc.thread_cpu_since_start()
        assert spent["ke-idler"] < 0.1
        assert "main" in spent


def test_medians_of_runs_take_cpu_by_thread_name_by_name() -> None:
    runs = [
        {"cpu_s": 5.0, "by_thread": {"ke-worker": 3.0, "ke-claimer": 1.0}, "backend": "pg"},
        {"cpu_s": 4.0, "by_thread": {"ke-worker": 2.0, "ke-driver": 0.2}, "backend": "pg"},
        {"cpu_s": 6.0, "by_thread": {"ke-worker": 4.0, "ke-claimer": 2.0}, "backend": "pg"},
    ]
    got = median_of(runs)
    assert got["cpu_s"] == 5.0
    # A thread missing from a run spent nothing there.
    assert got["by_thread"] == {"ke-worker": 3.0, "ke-claimer": 1.0, "ke-driver": 0.0}
    assert got["backend"] == "pg"
