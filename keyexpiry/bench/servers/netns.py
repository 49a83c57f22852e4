"""A network namespace of the test's own, for network faults as Jepsen makes them.

A process started with `NetNamespace.command(...)` lives in a namespace joined to this one by a
veth pair, and reaches every loopback server as before: `127.0.0.0/8` is routed over the pair
and both ends accept loopback addresses (`route_localnet`), so no URL changes (Sentinel's and
Cluster's advertised `127.0.0.1:port` addresses included) and no NAT or conntrack is added to
the machine's own traffic. Its loopback interface stays down; a server of its own (the
listener's HTTP port) binds `address`, which this side reaches.

Faults act on the namespace's packets only (iptables, in a chain of its own):
- `cut(ports)` drops every packet to and from those servers (a partition: no RST, no FIN, as a
  broken switch makes it);
- `degrade()` delays each outgoing packet 200 ms ± 100 ms and drops 5 %, as `tc qdisc ... netem
  delay 200ms 100ms loss 5%` on the namespace's side would; the kernel here has no `sch_netem`,
  so the delay is an `NFQUEUE` verdict held back by `keyexpiry.bench.netdelay` and the loss the
  kernel's `statistic` match;
- `heal()` ends either.

Needs root, `ip` and `iptables` (the `servers` make target installs them).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from keyexpiry.bench.servers.process import NETNS_NET, ServerError, find_binary, wait_until

_CHAIN = "KXFAULT"
_LOCK = Path("/tmp/keyexpiry-netns.lock")
_MULTIPORT_MAX = 15
"""Ports one iptables `multiport` match takes."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ServerError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if find_binary(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    return None


def _remove_stale() -> None:
    # A run killed before its clean-up leaves its namespace (and veth) behind: remove those
    # whose process is gone, so their subnets are free again.
    for line in _run("ip", "netns", "list").splitlines():
        m = re.match(r"kx-(\d+)-\d+", line)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            with contextlib.suppress(ServerError):
                _run("ip", "netns", "delete", m.group(0))


class NetNamespace:
    """One namespace and its veth pair; `start()` makes them, `stop()` removes both."""

    _made = 0

    def __init__(self, work: Path) -> None:
        NetNamespace._made += 1
        n = NetNamespace._made
        self.work = work
        self.name = f"kx-{os.getpid()}-{n}"
        self._host_if = self._ns_if = ""  # named after the subnet `start` takes
        self.address = ""
        """The namespace's side of the pair (bind its servers here)."""
        self.host_address = ""
        self._delayer: subprocess.Popen[bytes] | None = None
        self.state = "healthy"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _in(self, *argv: str) -> str:
        return _run(*self.command(list(argv)))

    def start(self) -> NetNamespace:
        """Make the namespace, the pair and the routes."""
        why = available()
        if why:
            raise ServerError(why)
        self.work.mkdir(parents=True, exist_ok=True)
        with _LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_stale()
            net = NETNS_NET.replace(".", r"\.")
            used = set(re.findall(rf"inet {net}\.(\d+)\.", _run("ip", "-4", "addr")))
            third = next(str(k) for k in range(1, 255) if str(k) not in used)
            self.host_address = f"{NETNS_NET}.{third}.1"
            self.address = f"{NETNS_NET}.{third}.2"
            # Unique while the subnet is taken (and the lock makes the choice one at a time).
            self._host_if, self._ns_if = f"kxh{third}", f"kxn{third}"
            _run("ip", "netns", "add", self.name)
            atexit.register(self.stop)
            _run("ip", "link", "add", self._host_if, "type", "veth", "peer", "name", self._ns_if)
            _run("ip", "link", "set", self._ns_if, "netns", self.name)
            _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self._host_if)
            _run("ip", "link", "set", self._host_if, "up")
        for key in (
            f"net.ipv4.conf.{self._host_if}.route_localnet=1",
            f"net.ipv4.conf.{self._host_if}.rp_filter=0",
        ):
            _run("sysctl", "-qw", key)
        self._in("ip", "addr", "add", f"{self.address}/30", "dev", self._ns_if)
        self._in("ip", "link", "set", self._ns_if, "up")
        for key in ("all", self._ns_if):
            self._in(
                "sysctl",
                "-qw",
                f"net.ipv4.conf.{key}.route_localnet=1",
                f"net.ipv4.conf.{key}.rp_filter=0",
            )
        self._in("ip", "route", "add", "127.0.0.0/8", "via", self.host_address, "dev", self._ns_if)
        self._in("iptables", "-N", _CHAIN)
        for hook in ("OUTPUT", "INPUT"):
            self._in("iptables", "-A", hook, "-j", _CHAIN)
        return self

    def cut(self, ports: Iterable[int]) -> str:
        """Drop every packet between the namespace and these loopback ports."""
        ports = sorted(set(ports))
        for i in range(0, len(ports), _MULTIPORT_MAX):
            some = ",".join(map(str, ports[i : i + _MULTIPORT_MAX]))
            rule = ["-p", "tcp", "-m", "multiport"]
            self._in(
                "iptables", "-A", _CHAIN, "-d", "127.0.0.0/8", *rule, "--dports", some, "-j", "DROP"
            )
            self._in(
                "iptables", "-A", _CHAIN, "-s", "127.0.0.0/8", *rule, "--sports", some, "-j", "DROP"
            )
        self.state = f"cut from ports {','.join(map(str, ports))}"
        return self.state

    def degrade(self, delay_ms: float = 200, jitter_ms: float = 100, loss: float = 0.05) -> str:
        """Delay the namespace's outgoing packets `delay_ms` ± `jitter_ms`, drop `loss` of them."""
        log = (self.work / f"{self.name}-netdelay.log").open("ab")
        self._delayer = subprocess.Popen(
            self.command(
                [
                    sys.executable,
                    "-m",
                    "keyexpiry.bench.netdelay",
                    "--delay-ms",
                    f"{delay_ms:g}",
                    "--jitter-ms",
                    f"{jitter_ms:g}",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        logfile = self.work / f"{self.name}-netdelay.log"
        delayer = self._delayer
        wait_until(
            lambda: delayer.poll() is not None or "netdelay: queue" in logfile.read_text(),
            10,
            message="netdelay did not bind its queue",
        )
        if delayer.poll() is not None:
            raise ServerError(f"netdelay exited: {logfile.read_text()[-500:]}")
        to_servers = ["-d", "127.0.0.0/8", "-p", "tcp"]
        self._in(
            "iptables",
            "-A",
            _CHAIN,
            *to_servers,
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            f"{loss:g}",
            "-j",
            "DROP",
        )
        # --queue-bypass: should the delayer die, packets pass rather than vanish.
        self._in(
            "iptables",
            "-A",
            _CHAIN,
            *to_servers,
            "-j",
            "NFQUEUE",
            "--queue-num",
            "0",
            "--queue-bypass",
        )
        self.state = f"{delay_ms:g} ms ± {jitter_ms:g} ms delay, {loss:.0%} loss"
        return self.state

    def heal(self) -> None:
        """End any fault: every rule gone, held packets let through."""
        try:
            self._in("iptables", "-F", _CHAIN)
        finally:
            if self._delayer is not None:
                self._delayer.terminate()  # it lets what it holds go on SIGTERM
                try:
                    self._delayer.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._delayer.kill()
                    self._delayer.wait()
                self._delayer = None
        self.state = "healthy"

    def stop(self) -> None:
        """Remove the namespace (its end of the pair with it, and so the pair)."""
        if self._delayer is not None:
            self._delayer.kill()
            self._delayer.wait()
            self._delayer = None
        with contextlib.suppress(ServerError):
            _run("ip", "netns", "delete", self.name)
        if self._host_if:
            with contextlib.suppress(ServerError):
                _run("ip", "link", "delete", self._host_if)
        atexit.unregister(self.stop)
