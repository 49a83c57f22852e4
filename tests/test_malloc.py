"""What the listener asks of glibc's malloc: few arenas, and freed pages handed back (a real
glibc, in a process of its own: arenas are per process and cannot be undone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keyexpiry import malloc

ROOT = Path(__file__).resolve().parents[1]

# Sixteen threads allocate at once, as a listener's do in a burst (buffers and strings above
# Python's small-object size, which glibc serves), and keep one allocation in fifty: what a burst
# leaves behind scattered in the arenas.
_BURST = """
import sys, threading
from keyexpiry import malloc

tuned = sys.argv[1] == "tuned"
if tuned:
    assert malloc.limit_arenas()

def rss_kb():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS"))

kept = []
barrier = threading.Barrier(16)

def burst():
    barrier.wait()
    for _ in range(5):
        blobs = [bytes(2000 + (j % 7) * 300) for j in range(3000)]
        kept.extend(blobs[::50])
        del blobs

threads = [threading.Thread(target=burst) for _ in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if tuned:
    malloc.trim()
print(rss_kb())
"""


def _rss_after_burst_kb(mode: str, **env: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _BURST, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=60,
    )
    return int(out.stdout.split()[-1])


needs_glibc = pytest.mark.skipif(malloc._libc() is None, reason="glibc's malloc only")


@needs_glibc
def test_few_arenas_and_a_trim_hand_a_bursts_freed_memory_back() -> None:
    untouched = _rss_after_burst_kb("untouched")
    tuned = _rss_after_burst_kb("tuned")
    # Measured here: 173 MB untouched, 50 MB tuned (2 arenas, then a trim).
    assert tuned < untouched * 0.6, (untouched, tuned)


@needs_glibc
def test_an_operators_malloc_arena_max_stands() -> None:
    script = "from keyexpiry import malloc; print(malloc.limit_arenas())"
    for env, expected in (({}, "True"), ({"MALLOC_ARENA_MAX": "4"}, "False")):
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            timeout=60,
        )
        assert out.stdout.strip() == expected, env


def test_the_trimmer_trims_once_per_period(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(malloc, "trim", trim)
    trimmer = malloc.Trimmer(every_s=60)
    for now_s in (0.0, 30.0, 59.9):
        trimmer.tick(now_s)
    assert not calls
    trimmer.tick(60.0)
    trimmer.tick(61.0)
    assert len(calls) == 1 and trimmer.trims == 1
    trimmer.tick(120.0)
    assert len(calls) == 2
