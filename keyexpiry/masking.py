"""Credentials in URLs masked for logs, errors and output: one function for every spelling, which
settings, the Redis clients and the ledger all use."""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus


def mask_url(url: str | None) -> str:
    """`url` with every credential replaced by `***`, safe for logs, errors and output.

    Masked, whatever their spelling: the password of the user-info part (as `urlsplit` reads it,
    and as SQLAlchemy does: up to the first `@`, so one holding `/`, `?` or `#` is masked whole),
    and the value of every query argument whose name, percent-decoded and stripped of case and
    punctuation, names a credential (`password`, `passwd`, PyMySQL's spelling, `pwd`,
    `ssl_password`, `ssl_keyfile_password`, `sentinel_password`, `token`, `secret`, `api_key`,
    `auth…`, …). Parsing never fails: a malformed URL is masked the same way. The user name and
    the rest of the URL are kept as written.
    """
    if not url:
        return "(embedded)"
    masked, _ = _mask(url)
    return masked


def url_secrets(url: str | None) -> list[str]:
    """The credentials `mask_url` hides in `url`, as written and percent-decoded: what
    `redact` removes from text that may quote a piece of the URL (a driver's parse error)."""
    if not url:
        return []
    _, found = _mask(url)
    # A parser's error may quote a piece of one (redis-py's "Port could not be cast to integer
    # value as 'pa'" for `u:pa/ss@h`): the pieces between URL delimiters go too.
    pieces = {p for s in found for p in re.split(r"[/?#@&;=:]", s)}
    forms = {f for s in {*found, *pieces} for f in (s, unquote(s), unquote_plus(s))}
    return sorted((f for f in forms if len(f) >= _REDACT_MIN_CHARS), key=len, reverse=True)


def redact(text: str, *urls: str | None) -> str:
    """`text` with every credential of `urls` (see `url_secrets`) replaced by `***`: for
    messages that embed an exception raised while parsing or using one of them."""
    for url in urls:
        for secret in url_secrets(url):
            text = text.replace(secret, "***")
    return text


_REDACT_MIN_CHARS = 4
"""Shorter credentials are not cut out of free text: "pw" would cut every "pw" in a message
(`mask_url` masks them all the same, by position)."""

_SECRET_NAME_PARTS = ("pass", "pwd", "secret", "token", "key", "auth", "cred", "signature")
"""A query argument whose normalised name contains one of these carries a credential. Broad
on purpose: masking a harmless value (`ssl_keyfile`, `auth_plugin`) costs nothing."""
_SECRET_NAMES = ("pw", "sig", "pin")


def _is_secret_name(raw: str) -> bool:
    name = raw
    for _ in range(3):  # `pass%77ord`, and once more for a doubly encoded name
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    norm = "".join(c for c in name.casefold() if c.isalnum())
    return norm in _SECRET_NAMES or any(part in norm for part in _SECRET_NAME_PARTS)


def _mask(url: str) -> tuple[str, list[str]]:
    """(masked url, the credentials it held)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    found: list[str] = []
    head = ""
    # The user-info part ends at an `@`: urlsplit (redis-py) takes the last one before the
    # path, SQLAlchemy the first one after `user:` (a password may hold `/`, `?`, `#`):
    # whichever ends later. Erring on the safe side: `redis://h:1/0?name=a@b` shows as
    # `redis://h:***@b` (an unencoded `@` in a query is rare; a `?` in a password is not).
    netloc = re.match(r"[^/?#]*", rest)
    at = netloc.group().rfind("@") if sep and netloc else -1
    alchemy = re.match(r"[^:/?#@]*:[^@]*@", rest) if sep else None
    if alchemy is not None:
        at = max(at, alchemy.end() - 1)
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        user, colon, password = userinfo.partition(":")
        if colon:
            found.append(password)
            head = f"{user}:***@"
        else:
            head = f"{userinfo}@"
    start = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    if start < 0:
        return f"{scheme}{sep}{head}{rest}", found
    items = []
    for item in rest[start + 1 :].split("&"):
        pieces = re.split(r"[;#]", item)
        equals = item.find("=")
        if equals >= 0 and any(_is_secret_name(p.partition("=")[0]) for p in pieces):
            found.append(item[equals + 1 :])
            item = item[: equals + 1] + "***"
        items.append(item)
    return f"{scheme}{sep}{head}{rest[: start + 1]}{'&'.join(items)}", found
