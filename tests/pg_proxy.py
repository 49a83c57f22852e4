"""`PGProxy`: the ambiguous-commit proxy of tests/proxy.py for PostgreSQL's wire protocol (v3).

What psycopg 3 sends, and where each thing commits:

- a new connection starts with an SSLRequest (sslmode `prefer`): the proxy answers `N` itself (no
  TLS, whatever the server would offer, so the rest can be read), then the StartupMessage; these
  have no type byte, every later message has one (1 byte, then an int32 length counting itself);
- a statement is sent with the extended protocol: Parse `P` (statement name, SQL text with `$n`
  placeholders), Bind `B` (portal, statement name, the parameter values), Describe `D`, Execute
  `E`, Sync `S`; once psycopg has prepared a statement (its 5th run on a connection) only Bind
  names it, so the proxy keeps each connection's named statements. Several Bind/Execute may
  share one Sync (`executemany`, in pipeline mode);
- BEGIN (`BEGIN ISOLATION LEVEL …`), COMMIT and ROLLBACK are simple Queries `Q`.

Outside a BEGIN block a statement commits when the server reaches the Sync after its Execute (or
as its simple Query runs): `break_statement` matches each statement of the batch a Sync ends, and
breaks the Sync. Inside a block the statements go into the transaction that COMMIT ends:
`break_commit` breaks that COMMIT. "commit" cuts both sides before the Sync (or COMMIT) reaches
the server, which then rolls back; "reply" and "hold" forward it and drop the server's answer,
"reply" cutting both sides once the answer is whole (ReadyForQuery: the server has committed).

Each statement is seen as its SQL text with its parameters written in, as PyMySQL sends them
(`status='running'`), so the rules of tests/proxy.py (`updates_status`) match on either server.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from tests.proxy import Fault, Pair, WireProxy

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_PLACEHOLDER = re.compile(rb"\$(\d+)")


@dataclass
class _State:
    startup: bool = True
    """Before the StartupMessage: messages have no type byte."""
    statements: dict[bytes, bytes] = field(default_factory=dict)
    """Named (and the unnamed) prepared statements: their SQL text."""
    portals: dict[bytes, bytes] = field(default_factory=dict)
    """Bound portals: their statement's text with the parameters written in."""
    in_block: bool = False
    """Between BEGIN and COMMIT/ROLLBACK."""
    batch: list[bytes] = field(default_factory=list)
    """Statements executed outside a block since the last Sync: they commit at the next one."""
    answer: bytes = b""
    """The server's bytes not yet read as a whole message."""
    ready: int = 0
    """ReadyForQuery messages the server sent (each ends the answer to a Sync or a Query)."""


class PGProxy(WireProxy):
    """Forwards a loopback port to the PostgreSQL server of `upstream_url` (see the module)."""

    default_port = 5432
    kind = "pg-proxy"

    def _new_state(self) -> _State:
        return _State()

    def _split(self, pair: Pair, buf: bytes) -> tuple[list[bytes], bytes]:
        state: _State = pair.state
        messages: list[bytes] = []
        pos = 0
        while True:
            if state.startup:
                if len(buf) - pos < 8:
                    break
                size, code = struct.unpack_from("!ii", buf, pos)
                if len(buf) - pos < size:
                    break
                message, pos = buf[pos : pos + size], pos + size
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    # No encryption: the client goes on in plain text, on this connection.
                    pair.client.sendall(b"N")
                    continue
                state.startup = False  # a StartupMessage (or a CancelRequest: the last one)
                messages.append(message)
                continue
            if len(buf) - pos < 5:
                break
            size = 1 + struct.unpack_from("!i", buf, pos + 1)[0]
            if len(buf) - pos < size:
                break
            messages.append(buf[pos : pos + size])
            pos += size
        return messages, buf[pos:]

    def _inspect(self, pair: Pair, message: bytes) -> Fault | None:
        state: _State = pair.state
        kind, body = message[:1], message[5:]
        if kind == b"P":
            name, rest = _cstring(body)
            state.statements[name] = _cstring(rest)[0]
        elif kind == b"B":
            portal, rest = _cstring(body)
            name, rest = _cstring(rest)
            state.portals[portal] = _written_in(state.statements.get(name, b""), rest)
        elif kind == b"C" and body[:1] == b"S":
            state.statements.pop(_cstring(body[1:])[0], None)
        elif kind == b"E":
            return self._executed(pair, state.portals.get(_cstring(body)[0], b""))
        elif kind == b"S":
            batch, state.batch = state.batch, []
            for text in batch:
                fault = self._statement(pair, text)
                if fault is not None:
                    return fault
        elif kind == b"Q":
            return self._executed(pair, _cstring(body)[0], simple=True)
        return None

    def _executed(self, pair: Pair, text: bytes, *, simple: bool = False) -> Fault | None:
        """`text` reaches the server; a COMMIT's fault is decided here, a statement's at the
        Sync after it, or here for a `simple` Query (it commits as it runs)."""
        state: _State = pair.state
        word = text.strip().rstrip(b";").strip().upper()
        if word.startswith((b"BEGIN", b"START TRANSACTION")):
            state.in_block = True
            pair.tx.clear()
        elif word in (b"COMMIT", b"END", b"COMMIT TRANSACTION", b"COMMIT WORK"):
            state.in_block = False
            return self._commit(pair)
        elif word in (b"ROLLBACK", b"ABORT", b"ROLLBACK TRANSACTION", b"ROLLBACK WORK"):
            state.in_block = False
            pair.tx.clear()
        elif state.in_block:
            pair.tx.append(text)
        elif simple:
            return self._statement(pair, text)
        else:
            state.batch.append(text)
        return None

    def _answered(self, pair: Pair, data: bytes) -> bool:
        state: _State = pair.state
        buf = state.answer + data
        before = state.ready
        pos = 0
        while len(buf) - pos >= 5:
            size = 1 + struct.unpack_from("!i", buf, pos + 1)[0]
            if len(buf) - pos < size:
                break
            if buf[pos] == ord("Z"):
                state.ready += 1
            pos += size
        state.answer = buf[pos:]
        return state.ready > before


def _cstring(data: bytes) -> tuple[bytes, bytes]:
    """A NUL-terminated string at the start of `data`, and what follows it."""
    end = data.index(b"\0")
    return data[:end], data[end + 1 :]


def _written_in(sql: bytes, bind: bytes) -> bytes:
    """`sql` with each `$n` replaced by the n-th value of a Bind message's body (after its portal
    and statement names): text values quoted as SQL literals, NULL, binary integers as numbers,
    other binary values as bytea literals."""
    (nformats,) = struct.unpack("!h", bind[:2])
    formats = struct.unpack(f"!{nformats}h", bind[2 : 2 + 2 * nformats])
    pos = 2 + 2 * nformats
    (nparams,) = struct.unpack("!h", bind[pos : pos + 2])
    pos += 2
    values: list[bytes] = []
    for i in range(nparams):
        (size,) = struct.unpack("!i", bind[pos : pos + 4])
        pos += 4
        if size < 0:
            values.append(b"NULL")
            continue
        raw = bind[pos : pos + size]
        pos += size
        binary = (formats[i] if nformats > 1 else formats[0] if nformats else 0) == 1
        if not binary:
            values.append(b"'" + raw.replace(b"'", b"''") + b"'")
        elif size in (2, 4, 8):
            values.append(str(int.from_bytes(raw, "big", signed=True)).encode())
        else:
            values.append(b"'\\x" + raw.hex().encode() + b"'")

    def value(m: re.Match[bytes]) -> bytes:
        n = int(m.group(1))
        return values[n - 1] if 0 < n <= len(values) else m.group(0)

    return _PLACEHOLDER.sub(value, sql)
