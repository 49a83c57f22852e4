"""Fleet-wide permits to start a task, kept in Redis: concurrency slots, one-at-a-time groups and
rate tokens per task method, and the held-back counts listeners publish for the dashboard.

Each method's permits are three keys sharing one hash tag (one Cluster slot, so one script sees
them all): a sorted set of the runs holding a permit (member → expiry, ms, on Redis's clock), a
hash of the groups they hold (group value → member) and the rate's theoretical arrival time. A
permit expires unless its listener refreshes it (every heartbeat): a listener that dies gives its
slots back within `takeover_after_s`, like its claims. Times are Redis's (`TIME`), so listeners'
clocks never disagree about a rate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from keyexpiry import limits

GRANTED, LIMIT, GROUP, RATE = 0, 1, 2, 3
"""What `Permits.acquire` answers for each candidate."""
REASONS = {LIMIT: "limit", GROUP: "group", RATE: "rate"}
PERMIT_TTL_MAX_MS = 86_400_000
"""The longest a permit lasts unrefreshed: `takeover_after_s`'s highest value (one day). A
permit due to expire later than that from now was written by no listener (forged, or a clock
gone wrong): it is dropped, not kept for ever."""
HELD_COUNT_MAX = 1_000_000
"""Most tasks one listener can say it holds back (`runner.gate.HELD_MAX` is 200,000): a count
beyond, or one that is no whole number, makes its entry no listener's."""

# A member is "group \n token \n task key": its group is read back when it expires unreleased.
_ACQUIRE = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local ttl = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local interval = tonumber(ARGV[3])
local tolerance = tonumber(ARGV[4])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms)
for _, m in ipairs(gone) do
  local g = string.match(m, '^([^\\n]*)\\n')
  if g and g ~= '' and redis.call('HGET', KEYS[2], g) == m then redis.call('HDEL', KEYS[2], g) end
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms) end
-- Expiring further ahead than any listener's ttl: written by none of them, dropped.
local far = '(' .. (now_ms + PERMIT_TTL_MAX_MS)
local forged = redis.call('ZRANGEBYSCORE', KEYS[1], far, '+inf')
for _, m in ipairs(forged) do
  local g = string.match(m, '^([^\\n]*)\\n')
  if g and g ~= '' and redis.call('HGET', KEYS[2], g) == m then redis.call('HDEL', KEYS[2], g) end
end
if #forged > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], far, '+inf') end
local running = redis.call('ZCARD', KEYS[1])
-- A rate's time is never further ahead than one start past the burst; one that is (forged,
-- or left by a slower rate since changed) or is no number is taken as that bound, and written
-- back so below: it can hold starts back by one interval, never for ever.
local tat = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if tat ~= tat or tat > now_us + tolerance + interval then tat = now_us + tolerance + interval end
local out = {}
local wait = 0
local n = (#ARGV - 4) / 2
for i = 1, n do
  local m = ARGV[3 + 2 * i]
  local g = ARGV[4 + 2 * i]
  local code = 0
  if redis.call('ZSCORE', KEYS[1], m) then
    redis.call('ZADD', KEYS[1], now_ms + ttl, m)
  else
    if g ~= '' then
      local holder = redis.call('HGET', KEYS[2], g)
      if holder and redis.call('ZSCORE', KEYS[1], holder) then code = 2 end
    end
    if code == 0 and limit > 0 and running >= limit then code = 1 end
    if code == 0 and interval > 0 then
      local at = math.max(tat, now_us)
      if at - tolerance > now_us then
        code = 3
        if wait == 0 then wait = at - tolerance - now_us end
      else
        tat = at + interval
      end
    end
    if code == 0 and (limit > 0 or g ~= '') then
      -- A start under a rate alone holds nothing afterwards: no member to keep or give back.
      redis.call('ZADD', KEYS[1], now_ms + ttl, m)
      running = running + 1
      if g ~= '' then redis.call('HSET', KEYS[2], g, m) end
    end
  end
  out[i] = code
end
if interval > 0 and tat > now_us then
  local keep_ms = math.ceil((tat - now_us) / 1000) + 1000
  redis.call('SET', KEYS[3], string.format('%.3f', tat), 'PX', keep_ms)
end
out[n + 1] = math.floor(wait)
return out
"""

# Refreshed permits outlive a loss of Redis's data (failover, FLUSHALL): they are written anew,
# and a group held by nobody alive is taken back.
_REFRESH = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  local m = ARGV[i]
  redis.call('ZADD', KEYS[1], now_ms + ttl, m)
  local g = string.match(m, '^([^\\n]*)\\n')
  if g and g ~= '' then
    local holder = redis.call('HGET', KEYS[2], g)
    if not holder or not redis.call('ZSCORE', KEYS[1], holder) then
      redis.call('HSET', KEYS[2], g, m)
    end
  end
end
return #ARGV - 1
"""

_RELEASE = """
for i = 1, #ARGV do
  local m = ARGV[i]
  redis.call('ZREM', KEYS[1], m)
  local g = string.match(m, '^([^\\n]*)\\n')
  if g and g ~= '' and redis.call('HGET', KEYS[2], g) == m then redis.call('HDEL', KEYS[2], g) end
end
return #ARGV
"""


def member(group: str, token: str, key: str) -> str:
    """The permit of one run: its group value ('' for none), its claim's token, its key."""
    return f"{group}\n{token}\n{key}"


def task_keys(task: str, prefix: str = "") -> list[str]:
    """The three keys of `task`'s (`Class.method`) permits, in one hash slot."""
    base = f"{prefix}#keyexpiry#flow{{{task}}}"
    return [base + ":runs", base + ":groups", base + ":rate"]


@dataclass(frozen=True, slots=True)
class Terms:
    """A method's rules as the scripts take them."""

    concurrency: int = 0
    """0: no limit."""
    interval_us: float = 0
    """The rate's spacing of starts; 0: no rate."""
    tolerance_us: float = 0
    """How far ahead of the spacing a start may come (the burst)."""


_ACQUIRE = _ACQUIRE.replace("PERMIT_TTL_MAX_MS", str(PERMIT_TTL_MAX_MS))


class Permits:
    """The scripts on one Redis client (a single server, Sentinel's master or a Cluster)."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_ms: int) -> None:
        self._prefix = prefix
        self.ttl_ms = ttl_ms
        self._acquire = client.register_script(_ACQUIRE)
        self._refresh = client.register_script(_REFRESH)
        self._release = client.register_script(_RELEASE)

    def acquire(
        self, task: str, terms: Terms, candidates: Sequence[tuple[str, str]]
    ) -> tuple[list[int], float]:
        """Try to give each (member, group) a permit, in order; returns each one's answer
        (`GRANTED`, `LIMIT`, `GROUP`, `RATE`) and, when the rate refused one, seconds until it
        allows the next start (else 0)."""
        argv: list[Any] = [
            self.ttl_ms, terms.concurrency, repr(terms.interval_us), repr(terms.tolerance_us)
        ]  # fmt: skip
        for m, group in candidates:
            argv += [m, group]
        answer = self._acquire(keys=task_keys(task, self._prefix), args=argv)
        if not isinstance(answer, list) or len(answer) != len(candidates) + 1:
            raise redis.ResponseError(f"flow permits: an answer not the script's: {answer!r:.80}")
        # Bounded as the script bounds them: an answer it cannot give holds back, briefly.
        codes = [c if c in (GRANTED, LIMIT, GROUP, RATE) else LIMIT for c in answer[:-1]]
        wait_us = answer[-1] if isinstance(answer[-1], int) else 0
        return codes, min(max(wait_us, 0), terms.interval_us) / 1_000_000

    def refresh(self, task: str, members: Sequence[str]) -> None:
        """Push out the expiry of permits still in use (and write back any Redis lost)."""
        if members:
            self._refresh(keys=task_keys(task, self._prefix)[:2], args=[self.ttl_ms, *members])

    def release(self, task: str, members: Sequence[str]) -> None:
        """Give permits back: their slots and groups are free at once."""
        if members:
            self._release(keys=task_keys(task, self._prefix)[:2], args=list(members))


def held_key(prefix: str = "") -> str:
    """The hash in which each listener publishes what it holds back (field: its id)."""
    return f"{prefix}#keyexpiry#held"


def publish_held(
    client: redis.Redis, prefix: str, owner: str, now_ms: int, held: dict[str, dict[str, int]]
) -> None:
    """Say what this listener holds back now (`held_counts` reads it); nothing held: the entry
    goes."""
    if held:
        client.hset(held_key(prefix), owner, json.dumps({"at_ms": now_ms, "held": held}))
    else:
        client.hdel(held_key(prefix), owner)


def held_counts(
    client: redis.Redis, prefix: str, now_ms: int, stale_ms: int
) -> dict[str, dict[str, int]]:
    """What live listeners hold back, summed over the fleet: task (`Class.method`) → reason
    (`limit`, `rate`, `group`, `paused`) → tasks. A listener that has not published for
    `stale_ms` (dead, or stopped) counts for nothing."""
    totals: dict[str, dict[str, int]] = {}
    for raw in client.hvals(held_key(prefix)):
        try:
            entry = limits.json_loads(raw)
            # Ahead of now as well (no listener's clock is: they all read Redis's) it is stale:
            # a forged entry dated in 2100 would count for ever.
            if abs(now_ms - _whole(entry["at_ms"], 2**63)) > stale_ms:
                continue
            # Read whole before any of it counts: an entry is ours entirely or not at all.
            counts = [
                (str(task), str(reason), _whole(count, HELD_COUNT_MAX))
                for task, reasons in dict(entry["held"]).items()
                for reason, count in dict(reasons).items()
            ]
        except (ValueError, KeyError, TypeError, OverflowError):
            continue  # not one of ours (anyone who can write to Redis can write here): ignored
        for task, reason, count in counts:
            into = totals.setdefault(task, {})
            into[reason] = into.get(reason, 0) + count
    return totals


def _whole(value: object, most: int) -> int:
    """`value` if it is a whole number from 0 to `most` (as `publish_held` writes them);
    ValueError otherwise (a real, a bool, text, a count no listener holds)."""
    if type(value) is not int or not 0 <= value <= most:
        raise ValueError(f"not a whole number from 0 to {most}")
    return value
