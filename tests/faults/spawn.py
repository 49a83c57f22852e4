"""Listener subprocesses for fault tests: started, signalled and killed by process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keyexpiry import Settings
from keyexpiry.bench.servers import wait_until
from tests.conftest import _require
from tests.ke import FAST

ROOT = Path(__file__).resolve().parents[2]
Wrap = Callable[[list[str]], list[str]]
"""Turns a command line into another that runs it (`NetNamespace.command`)."""


def listener_env(settings: Settings) -> dict[str, str]:
    """The environment of `python -m keyexpiry` on `settings`, with the test timings."""
    env = {**os.environ, "KEYEXPIRY_TASKS": "tests.sample_tasks"}
    env["KEYEXPIRY_REDIS_URL"] = settings.redis_url or ""
    env["KEYEXPIRY_DATABASE_URL"] = settings.database_url or ""
    for name, value in FAST.items():
        env[f"KEYEXPIRY_{name.upper()}"] = (
            ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        )
    return env


# wolfcw/libfaketime#426: with the monotonic clock left real, libfaketime 0.9.10 breaks
# clock_nanosleep(TIMER_ABSTIME), which time.sleep() uses since Python 3.11 (EINVAL); faking the
# monotonic clock instead hangs timed waits on locks. Waits on an Event are unaffected, so the
# skewed process sleeps on one (the only change to it besides the clock).
_SLEEP_ON_EVENT = """
import runpy, threading, time
def _sleep(seconds):
    threading.Event().wait(max(seconds, 0))
time.sleep = _sleep
runpy.run_module("keyexpiry", run_name="__main__", alter_sys=True)
"""


def keyexpiry_command(*args: str, skew: str | None = None) -> list[str]:
    """`python -m keyexpiry ARGS`, under libfaketime with the wall clock moved by `skew` if
    given.

    The library is preloaded by `env`, not by the `faketime` wrapper: the wrapper makes a named
    semaphore and shared memory per process id and removes them only when it exits, so every
    one killed (a fault test kills process groups) left them behind in /dev/shm, and a later
    wrapper given the same pid failed at once ("sem_open: File exists").
    """
    if skew is None:
        return [sys.executable, "-m", "keyexpiry", *args]
    _require("faketime")  # the package that brings the library
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))
    if not found:
        pytest.fail("faketime is installed but libfaketimeMT.so.1 is not under /usr/lib/*/faketime")
    preload = [f"LD_PRELOAD={found[0]}", f"FAKETIME={skew}"]
    return ["env", *preload, sys.executable, "-c", _SLEEP_ON_EVENT, *args]


def subprocess_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a keyexpiry subprocess on `settings`, plus `extra` variables."""
    # Read by libfaketime only: fake the wall clock, never the monotonic one.
    return {**listener_env(settings), "FAKETIME_DONT_FAKE_MONOTONIC": "1", **extra}


class Spawned:
    """Listener subprocesses (`python -m keyexpiry listen`), killed at teardown if still alive."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def listen(
        self,
        settings: Settings,
        *,
        skew: str | None = None,
        wrap: Wrap | None = None,
        **env: str,
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start a listener (its clock skewed by `skew`, its command line wrapped by `wrap`,
        e.g. run in a network namespace) and wait until it has subscribed."""
        return self.listen_many(settings, 1, skew=skew, wrap=wrap, **env)[0]

    def listen_many(
        self,
        settings: Settings,
        count: int,
        *,
        skew: str | None = None,
        wrap: Wrap | None = None,
        **env: str,
    ) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """Start `count` listeners together (their start-ups overlap), then wait until each has
        subscribed."""
        started = [self._start(settings, skew, env, wrap) for _ in range(count)]
        for proc, log in started:
            _wait_subscribed(proc, log)
        return started

    def _start(
        self, settings: Settings, skew: str | None, env: dict[str, str], wrap: Wrap | None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        log = self._tmp / f"listener-{len(self.procs)}.log"
        command = keyexpiry_command("listen", skew=skew)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                wrap(command) if wrap else command,
                cwd=ROOT,
                env=subprocess_env(settings, **env),
                stdout=out,
                stderr=subprocess.STDOUT,
                # A listener may start processes of its own: signal the whole group, or one
                # outlives the test and spins on its dead servers.
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc, log

    def stop_all(self) -> None:
        """SIGTERM each listener still alive; SIGKILL what is left after 15 s."""
        for proc in self.procs:
            if proc.poll() is None:
                signal_group(proc, signal.SIGTERM)
                # The leader may exit first: wait for the whole group to be gone.
                deadline = time.monotonic() + 15
                while _group_alive(proc) and time.monotonic() < deadline:
                    time.sleep(0.05)
            signal_group(proc, signal.SIGKILL)
            proc.wait()


def _wait_subscribed(proc: subprocess.Popen[bytes], log: Path) -> None:
    def subscribed() -> bool:
        assert proc.poll() is None, f"listener exited:\n{log.read_text()[-3000:]}"
        return "subscribed to" in log.read_text()

    wait_until(subscribed, 30, interval_s=0.05, message=f"listener never subscribed ({log})")


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    proc.poll()  # reap the leader
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Send `signum` to `proc`'s process group (started with start_new_session), if alive."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
