"""TCP proxies between a database client and its server that can lose what a commit says back.

`WireProxy` is the machinery (threads, rules, faults, a failover); a subclass reads one wire
protocol: `MySQLProxy` here, `tests.pg_proxy.PGProxy` for PostgreSQL. A proxy reads the client's
messages, remembers the statements of the transaction in progress on each connection, and when a
COMMIT ends a transaction that a rule matches it can:

- `"reply"`: forward the COMMIT, drop the server's answer and close both sides: the transaction
  committed, the client only sees a lost connection (the ambiguous commit);
- `"commit"`: close both sides without forwarding the COMMIT: the server rolls back, the client
  sees the same lost connection;
- `"hold"`: forward the COMMIT, drop the answer and keep both sides open: the client waits for
  ever with its transaction committed (a process frozen right after its claim committed).

A statement run in autocommit (a claim: no COMMIT follows) is matched on its own by
`break_statement`, with the same three faults: "reply" after the server committed it, "commit"
before the server saw it, "hold" with it committed.

PyMySQL's `commit()` is one COM_QUERY packet with the text `COMMIT` followed by a wait for the
server's OK; each statement is one COM_QUERY too, its parameters written into its text.

Threads and blocking sockets, so a test needs nothing but `with MySQLProxy(url) as proxy`.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from sqlalchemy.engine import make_url

from keyexpiry.bench.servers import LOOPBACK

Fault = Literal["reply", "commit", "hold"]
TxRule = Callable[[Sequence[bytes]], bool]
"""Decides from a transaction's statement texts whether its COMMIT is the one to break."""


@dataclass
class _Rule:
    when: TxRule
    times: int
    fault: Fault
    alone: bool = False
    """Matched against each statement on its own (an autocommitted one), not a COMMIT's
    transaction."""
    failover_s: float = 0.0
    """When it fires, the node is lost as in a failover: every other connection is cut and new
    ones are refused for this long."""


@dataclass(eq=False)
class Pair:
    """One client connection and the proxy's own connection to the server for it."""

    client: socket.socket
    server: socket.socket
    state: Any
    """What the protocol reader keeps about this connection (`WireProxy._new_state`)."""
    tx: list[bytes] = field(default_factory=list)
    """The statements of the transaction in progress."""
    swallow: Fault | None = None  # set when the server's next answer must be dropped
    closed: bool = False


class WireProxy:
    """Forwards a loopback port to the server of `upstream_url`; `url` (the property) goes
    through it. A subclass splits the client's byte stream into messages (`_split`), says which
    of them commit what (`_inspect`, through `_statement`/`_commit`), and when the server's
    answer to a broken commit is whole (`_answered`)."""

    default_port = 0
    """The protocol's port, for a URL that names none."""
    kind = "proxy"

    def __init__(self, upstream_url: str) -> None:
        self._target = make_url(upstream_url)
        self._upstream = (
            self._target.host or LOOPBACK,
            int(self._target.port or self.default_port),
        )
        self._listen = socket.create_server((LOOPBACK, 0))
        self.port: int = self._listen.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[Pair] = []
        self._rules: list[_Rule] = []
        self.broken = 0
        """How many COMMITs (or autocommitted statements) a rule has broken so far."""
        self.broken_event = threading.Event()
        self.commits_seen: list[Sequence[bytes]] = []
        """Every transaction that ended with COMMIT, as its statements (for diagnosis)."""
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=self.kind)
        self._refuse_until_s = 0.0
        self.answering_again_s: float | None = None
        """When the last failover's window ended (monotonic), once it has."""

    @property
    def url(self) -> str:
        """`upstream_url` with the proxy's port."""
        return self._target.set(host=LOOPBACK, port=self.port).render_as_string(hide_password=False)

    def break_commit(
        self, when: TxRule, *, fault: Fault = "reply", times: int = 1, failover_s: float = 0.0
    ) -> None:
        """Break the next `times` COMMITs of transactions for which `when(statements)` is true;
        with `failover_s`, as `break_statement` does."""
        with self._lock:
            self._rules.append(_Rule(when, times, fault, failover_s=failover_s))

    def break_statement(
        self, when: TxRule, *, fault: Fault = "reply", times: int = 1, failover_s: float = 0.0
    ) -> None:
        """Break the next `times` statements for which `when([statement])` is true, as they are
        committed (for statements that commit on their own: the server's answer is the
        commit's). With `failover_s`, the database is then out of reach for that long, every
        connection cut (a primary lost while a proxy still routes to it)."""
        with self._lock:
            self._rules.append(_Rule(when, times, fault, alone=True, failover_s=failover_s))

    def start(self) -> Self:
        """Accept connections on a background thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        try:
            self._listen.close()
        finally:
            with self._lock:
                pairs = list(self._pairs)
            for pair in pairs:
                self._cut(pair)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the protocol: what a subclass reads --------------------------------------------------
    def _new_state(self) -> Any:
        """A new connection's protocol state (`Pair.state`)."""
        return None

    def _split(self, pair: Pair, buf: bytes) -> tuple[list[bytes], bytes]:
        """The whole messages at the start of `buf`, and what is left of it."""
        raise NotImplementedError

    def _inspect(self, pair: Pair, message: bytes) -> Fault | None:
        """The fault `message` (about to be forwarded) meets, if a rule breaks it."""
        raise NotImplementedError

    def _answered(self, pair: Pair, data: bytes) -> bool:
        """Whether `data` from the server ends an answer ("reply" cuts the connection then, not
        before: the commit must have happened). Called on every chunk the server sends."""
        return True

    # --- what the protocol readers call ---------------------------------------------------------
    def _statement(self, pair: Pair, text: bytes) -> Fault | None:
        """`text` ran outside a transaction: it committed on its own."""
        return self._match([text], alone=True, pair=pair)

    def _commit(self, pair: Pair) -> Fault | None:
        """The transaction of `pair` commits now."""
        statements, pair.tx = pair.tx, []
        with self._lock:
            self.commits_seen.append(statements)
        return self._match(statements, alone=False, pair=pair)

    # --- internals -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return  # closed
            if time.monotonic() < self._refuse_until_s:
                client.close()  # the node is gone: the connection breaks at once
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = Pair(client, server, self._new_state())
            with self._lock:
                self._pairs.append(pair)
            for target in (self._client_to_server, self._server_to_client):
                threading.Thread(target=target, args=(pair,), daemon=True, name=self.kind).start()

    def _client_to_server(self, pair: Pair) -> None:
        buf = b""
        while True:
            try:
                data = pair.client.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._cut(pair)
                return
            messages, buf = self._split(pair, buf + data)
            for message in messages:
                fault = self._inspect(pair, message)
                if fault == "commit":
                    self._cut(pair)  # what came before it in `data` is not sent either
                    return
                if fault is not None:
                    pair.swallow = fault  # before sending: the answer may come back at once
            # What the client wrote at once goes on at once: one message per write would wait
            # on the server's delayed ACK (a PostgreSQL statement is five messages).
            if not messages:
                continue
            try:
                pair.server.sendall(b"".join(messages))
            except OSError:
                self._cut(pair)
                return

    def _match(self, statements: Sequence[bytes], *, alone: bool, pair: Pair) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.alone is alone and rule.times > 0 and rule.when(statements):
                    rule.times -= 1
                    self.broken += 1
                    self.broken_event.set()
                    if rule.failover_s:
                        self._fail_over(rule.failover_s, spare=pair)
                    return rule.fault
        return None

    def _fail_over(self, seconds: float, spare: Pair) -> None:
        """Refuse new connections for `seconds` and cut the others (under the lock); `spare`,
        whose statement fired the rule, meets its own fault."""
        self._refuse_until_s = time.monotonic() + seconds
        self.answering_again_s = None
        for pair in self._pairs:
            if pair is not spare:
                for sock in (pair.client, pair.server):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        def answered() -> None:
            self.answering_again_s = self._refuse_until_s

        threading.Timer(seconds, answered).start()

    def _server_to_client(self, pair: Pair) -> None:
        while True:
            try:
                data = pair.server.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._cut(pair)
                return
            whole = self._answered(pair, data)
            fault = pair.swallow
            if fault == "hold":
                continue  # the answer is dropped; the client waits on an open socket
            if fault == "reply":
                if whole:
                    self._cut(pair)
                    return
                continue
            try:
                pair.client.sendall(data)
            except OSError:
                self._cut(pair)
                return

    def _cut(self, pair: Pair) -> None:
        with self._lock:
            if pair.closed:
                return
            pair.closed = True
            if pair in self._pairs:
                self._pairs.remove(pair)
        for sock in (pair.client, pair.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


_COM_QUERY = 0x03
_HEADER = 4  # 3-byte little-endian payload length, 1-byte sequence number


class MySQLProxy(WireProxy):
    """A `WireProxy` for the MySQL protocol (MariaDB, PyMySQL)."""

    default_port = 3306
    kind = "mysql-proxy"

    def _split(self, pair: Pair, buf: bytes) -> tuple[list[bytes], bytes]:
        packets: list[bytes] = []
        pos = 0
        while len(buf) - pos >= _HEADER:
            end = pos + _HEADER + int.from_bytes(buf[pos : pos + 3], "little")
            if len(buf) < end:
                break
            packets.append(buf[pos:end])
            pos = end
        return packets, buf[pos:]

    def _inspect(self, pair: Pair, message: bytes) -> Fault | None:
        payload = message[_HEADER:]
        if not payload or payload[0] != _COM_QUERY:
            return None
        text = payload[1:]
        word = text.strip().upper()
        if word == b"ROLLBACK":
            pair.tx.clear()
            return None
        if word != b"COMMIT":
            pair.tx.append(text)
            return self._statement(pair, text)
        return self._commit(pair)


_UPDATE_SET = re.compile(rb"\bUPDATE\s+\S+\s+SET\b", re.IGNORECASE)
"""An UPDATE statement, also inside a WITH (PostgreSQL's claim), not a SELECT … FOR UPDATE."""


def updates_status(status: str, *, mentioning: str | None = None) -> TxRule:
    """A rule matching transactions with an UPDATE of the ledger that sets `status`, and that
    mention `mentioning` (a task key) when given.

    Statement texts hold their values: PyMySQL interpolates parameters (`status='running'`), and
    `PGProxy` writes each bound parameter into its statement's text the same way. The SET clause
    is the one without spaces around `=` (SQLAlchemy writes `status = …` in a WHERE)."""
    needle = f"status='{status}'".encode()
    key = mentioning.encode() if mentioning is not None else None

    def match(statements: Sequence[bytes]) -> bool:
        return any(
            _UPDATE_SET.search(s) is not None and needle in s and (key is None or key in s)
            for s in statements
        )

    return match
