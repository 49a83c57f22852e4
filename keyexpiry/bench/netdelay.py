"""Delay packets as `tc netem delay` would, where the kernel has no `sch_netem`.

`python -m keyexpiry.bench.netdelay --queue 0 --delay-ms 200 --jitter-ms 100`, run inside a
network namespace (`ip netns exec`), takes the packets an iptables `NFQUEUE --queue-num 0` rule
hands it and lets each through (`NF_ACCEPT`) after 200 ms ± 100 ms, drawn uniformly per packet
as netem draws jitter, so packets may overtake one another as they do under netem. Loss is the
kernel's own (`-m statistic --mode random --probability 0.05 -j DROP`), not this program's.

It speaks nfnetlink_queue over a raw netlink socket (the kernel's ABI in
`linux/netfilter/nfnetlink_queue.h`): no C library or compiled package, so the soak's network
faults need nothing beyond `iptables`. It asks for packet metadata only (`NFQNL_COPY_META`): a
verdict needs the packet's id, never its bytes.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
QUEUE_MAXLEN = 20_000
"""Packets the kernel holds for us at once (its default, 1,024, is 200 ms of a busy listener)."""


def _attr(kind: int, payload: bytes) -> bytes:
    header = struct.pack("=HH", 4 + len(payload), kind)
    return header + payload + b"\0" * (-len(payload) % 4)


def _message(kind: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    # nfgenmsg: family, version, then the queue number in network order.
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return (
        struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body
    )


def config_messages(queue: int) -> list[bytes]:
    """Bind `queue`, ask for metadata only, and room for `QUEUE_MAXLEN` packets."""
    bind = _attr(NFQA_CFG_CMD, struct.pack("=BB", NFQNL_CFG_CMD_BIND, 0) + struct.pack(">H", 0))
    params = _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
    maxlen = _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN))
    flags = NLM_F_REQUEST | NLM_F_ACK
    return [
        _message(NFQNL_MSG_CONFIG, flags, queue, bind, seq=1),
        _message(NFQNL_MSG_CONFIG, flags, queue, params + maxlen, seq=2),
    ]


def verdict_message(queue: int, packet_id: int) -> bytes:
    """Let packet `packet_id` of `queue` through."""
    hdr = _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))
    return _message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, queue, hdr)


def packet_ids(data: bytes) -> tuple[list[int], list[int]]:
    """The packet ids in one netlink read, and the error codes of any acks (0: success)."""
    ids: list[int] = []
    errors: list[int] = []
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if length < 16:
            break
        if kind == NLMSG_ERROR:
            errors.append(-struct.unpack_from("=i", data, at + 16)[0])
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = at + 20  # past nlmsghdr and nfgenmsg
            while a + 4 <= at + length:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if akind & 0x3FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, a + 4)[0])
                a += (alen + 3) & ~3
        at += (length + 3) & ~3
    return ids, errors


def serve(queue: int, delay_ms: float, jitter_ms: float, seed: int | None = None) -> None:
    """Hold every packet of `queue` for `delay_ms` ± `jitter_ms`, until SIGTERM."""
    rng = random.Random(seed)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    for message in config_messages(queue):
        sock.send(message)
        _, errors = packet_ids(sock.recv(65536))
        if any(errors):
            raise SystemExit(f"netdelay: the kernel refused queue {queue}: errno {errors}")
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    held: list[tuple[float, int]] = []
    print(f"netdelay: queue {queue}, {delay_ms:g} ± {jitter_ms:g} ms", flush=True)
    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            sock.send(verdict_message(queue, heapq.heappop(held)[1]))
        wait_s = max(0.0, held[0][0] - now) if held else 0.2
        if not select.select([sock], [], [], wait_s)[0]:
            continue
        try:
            data = sock.recv(1 << 20)
        except OSError:  # ENOBUFS: the kernel dropped what we could not read; it goes on
            continue
        ids, _ = packet_ids(data)
        now = time.monotonic()
        for packet_id in ids:
            delay_s = max(0.0, delay_ms + rng.uniform(-jitter_ms, jitter_ms)) / 1000
            heapq.heappush(held, (now + delay_s, packet_id))
    for _, packet_id in held:  # let what is held go, not drop it, when the fault ends
        sock.send(verdict_message(queue, packet_id))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--jitter-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    serve(args.queue, args.delay_ms, args.jitter_ms, args.seed)


if __name__ == "__main__":
    main(sys.argv[1:])
