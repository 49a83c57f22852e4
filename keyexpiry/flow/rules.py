"""Flow rules of a task method: how many of its runs at once over the fleet (`concurrency`), how
many starts per second, minute or hour (`rate`), and which argument makes runs wait for each other
(`one_at_a_time`). Checked where they are declared (`@exposed`), so a listener never sees a bad
one."""

from __future__ import annotations

import re
from dataclasses import dataclass

from keyexpiry.errors import ConfigError
from keyexpiry.keys import shorten

MAX_CONCURRENCY = 100_000
MAX_RATE = 1_000_000
"""Most starts per period a rate may allow (1,000,000/s is beyond any listener fleet)."""
BURST_SHARE = 50
"""A rate of R per period lets R // BURST_SHARE (at least 1) start back to back: 2 %."""

_PERIODS_S = {
    "s": 1.0, "sec": 1.0, "second": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0,
    "h": 3600.0, "hour": 3600.0,
}  # fmt: skip
_RATE = re.compile(r"\s*(\d+)\s*/\s*([a-z]+)\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most `count` starts in any window of `period_s` seconds, fleet-wide.

    Enforced as a generic cell rate (GCRA): up to `burst` starts back to back, then one every
    `interval_s`, chosen so that no window of `period_s` holds more than `count` starts. The
    steady pace is therefore a hair below `count` (1,961/s for "2000/s") and a wave is spread,
    never sent as a block at the start of each second.
    """

    count: int
    period_s: float

    @property
    def burst(self) -> int:
        """How many may start back to back after a quiet spell."""
        return max(1, self.count // BURST_SHARE)

    @property
    def interval_s(self) -> float:
        """The spacing of starts once the burst is spent."""
        return self.period_s / (self.count - self.burst + 1)

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "min", 3600.0: "h"}[self.period_s]
        return f"{self.count}/{unit}"


def parse_rate(value: object, field: str) -> Rate:
    """`"200/s"`, `"30/min"`, `"1000/h"` as a `Rate`; ConfigError naming `field` otherwise."""
    if not isinstance(value, str):
        raise ConfigError(
            f'{field} must be a text like "200/s", "30/min" or "1000/h", got '
            f"{shorten(repr(value), 80)}"
        )
    match = _RATE.fullmatch(value.lower())
    period = _PERIODS_S.get(match.group(2)) if match else None
    if match is None or period is None:
        raise ConfigError(
            f'{field} must be a count per s, min or h, like "200/s", got {shorten(repr(value), 80)}'
        )
    count = int(match.group(1))
    if not 1 <= count <= MAX_RATE:
        raise ConfigError(f"{field} must allow 1 to {MAX_RATE} starts per period, got {count}")
    return Rate(count, period)


def parse_concurrency(value: object, field: str) -> int:
    """A fleet-wide concurrency limit: a whole number from 1; ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field} must be a whole number of runs, got {shorten(repr(value), 80)}")
    if not 1 <= value <= MAX_CONCURRENCY:
        raise ConfigError(f"{field} must be from 1 to {MAX_CONCURRENCY}, got {value}")
    return value


def parse_group(value: object, field: str) -> tuple[str, ...]:
    """The argument name(s) whose values make a group: a name, or a list of names."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not names:
        raise ConfigError(
            f"{field} must name an argument (or a list of them), got {shorten(repr(value), 80)}"
        )
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{field}: {shorten(repr(name), 80)} is no argument name")
    return tuple(names)


def rate_interval_us(rate: Rate) -> float:
    """The GCRA emission interval in microseconds (a fraction kept: at 100,000/s whole ones
    would be 7 % off), a billionth longer: the sums of fractions never land a start one
    rounding error early, inside a full window."""
    return rate.interval_s * 1_000_000 * (1 + 1e-9)
