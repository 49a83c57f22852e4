"""A CPU quota for a benchmark process: a cgroup of its own with `cores` of CPU time.

Throughput that grows with listeners needs each listener to have a CPU share of its own; on a
2-core machine shared with Redis and MariaDB, unthrottled listeners only measure the machine.
Linux cgroups (v1 `cpu` controller or v2 `cpu.max`), as root; `unavailable()` says why not.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


def unavailable() -> str | None:
    """Why quotas cannot be set here (None when they can)."""
    if os.geteuid() != 0:
        return "CPU quotas need root (cgroups)"
    if (_V1 / "cpu.cfs_quota_us").exists() or (_V1 / "cgroup.procs").exists():
        return None
    if "cpu" in (_V2 / "cgroup.subtree_control").read_text(errors="replace").split():
        return None
    return "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu, or cpu in v2 subtree_control)"


class CpuQuota:
    """A cgroup limited to `cores` CPUs; `add(pid)` moves a process (all its threads) in."""

    def __init__(self, cores: float) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.cores = cores
        self.v1 = _V1.exists()
        self.path = (_V1 if self.v1 else _V2) / f"keyexpiry-bench-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        quota_us = int(cores * _PERIOD_US)
        if self.v1:
            (self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (self.path / "cpu.max").write_text(f"{quota_us} {_PERIOD_US}")

    def add(self, pid: int) -> None:
        """Move process `pid` into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds the group's processes were held back by the quota so far."""
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line
        )
        if self.v1:
            return int(stat.get("throttled_time", 0)) / 1e9
        return int(stat.get("throttled_usec", 0)) / 1e6

    def remove(self) -> None:
        """Delete the group (its processes have exited, or go back to the root group)."""
        root = self.path.parent / "cgroup.procs"
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                root.write_text(pid)
            self.path.rmdir()
        except OSError:
            pass  # a process still exiting: the empty group is harmless, named for the run
