"""A subscriber's stream that stops half-way through a message: the listener's subscription
must not wait for the rest (it has no read timeout: it waits for events), but judge the link
with its PING probe and rebuild it, as it does a link that carries nothing.

Found in the Patroni soak (docs/ENDURANCE.md round eighteen): a listener reaching Redis through
HAProxy heard no events for 15 s after a SIGSTOP, its subscription thread apparently held in a
read. The read that can hold is `Subscription._drain`'s: it reads on whenever any new bytes came,
and a message whose first bytes came then waits for the rest.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import redis

from keyexpiry import Settings
from keyexpiry.bench.servers import LOOPBACK, wait_until
from tests.ke import Running, make_settings

StartListener = Callable[[Settings], Running]
_MESSAGE = b"$7\r\nmessage\r\n"  # a published message's type, after its `*3` (or `>3`) header


class CuttingProxy:
    """A TCP proxy before a real redis-server. Once `arm`ed, the next subscriber connection's
    stream is cut: its first message and 5 bytes of the next are sent, 3 more bytes when
    `send_more` is set, and nothing after until the proxy closes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server((LOOPBACK, 0))
        self.port = self.server.getsockname()[1]
        self.armed = threading.Event()
        self.cut = threading.Event()
        """Set once a stream was cut: its first message sent, the next one's first bytes too."""
        self.send_more = threading.Event()
        self.more_sent = threading.Event()
        self.closing = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def close(self) -> None:
        self.closing.set()
        self.send_more.set()
        for s in [self.server, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection((LOOPBACK, self.upstream_port))
            self._sockets += [client, upstream]
            if self.closing.is_set():  # closed while this one was accepted
                client.close()
                upstream.close()
                return
            subscriber = threading.Event()
            threading.Thread(
                target=self._up, args=(client, upstream, subscriber), daemon=True
            ).start()
            threading.Thread(
                target=self._down, args=(upstream, client, subscriber), daemon=True
            ).start()

    def _up(
        self, client: socket.socket, upstream: socket.socket, subscriber: threading.Event
    ) -> None:
        try:
            while data := client.recv(65536):
                if b"SUBSCRIBE" in data.upper():
                    subscriber.set()
                upstream.sendall(data)
        except OSError:
            pass

    def _down(
        self, upstream: socket.socket, client: socket.socket, subscriber: threading.Event
    ) -> None:
        held = b""
        cut_here = False
        try:
            while data := upstream.recv(65536):
                if cut_here:
                    continue  # this stream is cut: nothing more reaches its client
                if not (subscriber.is_set() and self.armed.is_set()):
                    client.sendall(data)
                    continue
                held += data
                second = held.find(_MESSAGE, held.find(_MESSAGE) + 1) - 4  # its `*3\r\n` header
                if second < 0 or len(held) < second + 8:
                    continue
                self.armed.clear()
                cut_here = True
                self.cut.set()
                client.sendall(held[: second + 5])
                self.send_more.wait(30)
                client.sendall(held[second + 5 : second + 8])
                self.more_sent.set()
        except OSError:
            pass


def test_a_stream_cut_half_way_through_a_message_is_rebuilt_not_waited_on(
    redis_url: str, sqlite_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    proxy = CuttingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    try:
        running = start_listener(make_settings(proxy.url(), sqlite_url, tmp_path))
        listener = running.listener
        wait_until(lambda: listener.events_arriving and listener.health.subscribed.is_set(), 10)
        handle_key = listener.handle_key

        def handle_then_let_more_in(raw: bytes | str) -> None:
            # The first message of the cut stream: 3 more bytes arrive while it is handled, so
            # the read that follows finds new bytes, and still not a whole message.
            if proxy.cut.is_set() and not proxy.send_more.is_set():
                proxy.send_more.set()
                proxy.more_sent.wait(5)  # in the subscriber's socket before the read that follows
            handle_key(raw)

        listener.handle_key = handle_then_let_more_in  # type: ignore[method-assign]
        gaps = listener.subscription.gaps
        proxy.armed.set()
        direct = redis.Redis.from_url(redis_url)
        try:
            for i in range(3):
                direct.set(f"other-app:cut:{i}", b"", px=1)
            wait_until(proxy.cut.is_set, 10, message="no message reached the subscriber")
            # The old stream stays cut until the test ends: only a new subscription hears.
            wait_until(
                lambda: listener.subscription.gaps > gaps and listener.health.subscribed.is_set(),
                10,
                message="the subscription waited on the cut message instead of rebuilding",
            )
            heard = listener.foreign
            direct.set("other-app:after-cut", b"", px=1)
            wait_until(lambda: listener.foreign > heard, 10, message="no event after the cut")
        finally:
            direct.close()
    finally:
        proxy.close()
