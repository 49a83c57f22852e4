"""Which classes and methods a Redis key may run, and how their arguments are typed.

Only classes registered here, and only their methods marked with `@exposed`, can ever run: a key
names a registered class and an exposed method; it is never a module path, never resolved with
`getattr` on arbitrary objects, and never imports anything.
"""

from __future__ import annotations

import datetime as dt
import inspect
import re
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar, overload

from keyexpiry.errors import ArgumentError, ConfigError, UnknownTaskError
from keyexpiry.keys import check_name, clip, shorten

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
_EXPOSED_ATTR = "__keyexpiry_exposed__"
_INT = re.compile(r"[+-]?\d+\Z")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True, slots=True)
class ExposeOptions:
    """Per-method settings given to `@exposed`."""

    timeout_s: float | None = None
    retry_schedule_s: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Converter:
    """Turns one argument between its Python type and its string form inside a key."""

    type_name: str
    parse: Callable[[str], Any]
    encode: Callable[[Any], str]
    accepts: Callable[[Any], bool]


def _parse_int(text: str) -> int:
    if not _INT.match(text):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false)")


def _parse_decimal(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a decimal number") from None
    if not value.is_finite():
        raise ValueError(f"{text!r} is not a finite decimal")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is not a finite number")
    return value


CONVERTERS: dict[Any, Converter] = {
    str: Converter("str", str, str, lambda v: isinstance(v, str)),
    int: Converter(
        "int", _parse_int, str, lambda v: isinstance(v, int) and not isinstance(v, bool)
    ),
    float: Converter(
        "float",
        _parse_float,
        repr,
        lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    ),
    bool: Converter(
        "bool", _parse_bool, lambda v: "true" if v else "false", lambda v: isinstance(v, bool)
    ),
    Decimal: Converter(
        "Decimal", _parse_decimal, str, lambda v: isinstance(v, Decimal | int) and v is not True
    ),
    uuid.UUID: Converter("UUID", uuid.UUID, str, lambda v: isinstance(v, uuid.UUID)),
    dt.date: Converter(
        "date",
        dt.date.fromisoformat,
        lambda v: v.isoformat(),
        lambda v: isinstance(v, dt.date) and not isinstance(v, dt.datetime),
    ),
}
"""Argument types a task method may annotate; anything else is refused at registration."""


@dataclass(frozen=True, slots=True)
class Param:
    """One positional parameter of an exposed method."""

    name: str
    converter: Converter
    required: bool


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A registered class and one of its exposed methods, ready to validate and run calls."""

    class_name: str
    method: str
    cls: type
    params: tuple[Param, ...]
    options: ExposeOptions

    def encode_args(self, args: Sequence[object]) -> tuple[str, ...]:
        """Check Python values against the signature and return their key strings.

        Strings are accepted for any type and parsed (that is how the CLI passes them).
        """
        self._check_count(len(args))
        out: list[str] = []
        for param, value in zip(self.params, args, strict=False):
            conv = param.converter
            if isinstance(value, str) and conv.type_name != "str":
                value = self._parse_one(param, value)
            elif not conv.accepts(value):
                raise ArgumentError(
                    f"{self.label}: argument {param.name!r} must be {conv.type_name}, "
                    f"got {type(value).__name__} {shorten(repr(value), 80)}"
                )
            out.append(conv.encode(value))
        return tuple(out)

    def decode_args(self, args: Sequence[str]) -> tuple[Any, ...]:
        """Turn key strings back into typed values for the call."""
        self._check_count(len(args))
        return tuple(self._parse_one(p, a) for p, a in zip(self.params, args, strict=False))

    def bind(self) -> Callable[..., Any]:
        """A fresh instance's exposed method: each run gets its own object."""
        instance = self.cls()
        func: Callable[..., Any] = self.cls.__dict__[self.method]
        return func.__get__(instance, self.cls)  # type: ignore[no-any-return]

    @property
    def label(self) -> str:
        """`Class.method`, for messages."""
        return f"{self.class_name}.{self.method}"

    def _check_count(self, count: int) -> None:
        required = sum(1 for p in self.params if p.required)
        if not required <= count <= len(self.params):
            want = (
                str(required) if required == len(self.params) else f"{required}..{len(self.params)}"
            )
            raise ArgumentError(f"{self.label} takes {want} argument(s), got {count}")

    def _parse_one(self, param: Param, text: str) -> Any:
        try:
            return param.converter.parse(text)
        except (ValueError, TypeError) as exc:
            # The parsers quote the text they refuse, which may be megabytes long.
            raise ArgumentError(
                f"{self.label}: argument {param.name!r} must be {param.converter.type_name}: "
                f"{shorten(str(exc))}"
            ) from None


@overload
def exposed(func: F, /) -> F: ...
@overload
def exposed(
    *, timeout_s: float | None = None, retry_schedule_s: Sequence[float] | None = None
) -> Callable[[F], F]: ...
def exposed(
    func: F | None = None,
    /,
    *,
    timeout_s: float | None = None,
    retry_schedule_s: Sequence[float] | None = None,
) -> Any:
    """Mark a method of a task class as runnable from a key; use bare or with options.

    `timeout_s`: a run longer than this counts as a failed attempt.
    `retry_schedule_s`: delays before each retry; its length is the number of retries.
    """
    options = ExposeOptions(
        timeout_s=timeout_s,
        retry_schedule_s=tuple(retry_schedule_s) if retry_schedule_s is not None else None,
    )

    def mark(f: F) -> F:
        setattr(f, _EXPOSED_ATTR, options)
        return f

    return mark(func) if func is not None else mark


class Registry:
    """Maps class names to task classes and their exposed methods."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], TaskSpec] = {}
        self._classes: dict[str, type] = {}

    def register(self, cls: type[T] | None = None, *, name: str | None = None) -> Any:
        """Class decorator: register `cls` (under `name`, default its own name)."""

        def add(c: type[T]) -> type[T]:
            self._add(c, name or c.__name__)
            return c

        return add(cls) if cls is not None else add

    def resolve(self, class_name: str, method: str) -> TaskSpec:
        """The spec for `class_name.method`, or UnknownTaskError."""
        spec = self._specs.get((class_name, method))
        if spec is None:
            if class_name in self._classes:
                raise UnknownTaskError(
                    f"{class_name}.{shorten(method)} is not an exposed task method"
                )
            raise UnknownTaskError(
                f"task class {clip(class_name)} is not registered (import its module with --tasks)"
            )
        return spec

    def has_class(self, class_name: str) -> bool:
        """Whether a task class is registered under `class_name`."""
        return class_name in self._classes

    def specs(self) -> list[TaskSpec]:
        """Every registered (class, method), sorted by name."""
        return [self._specs[k] for k in sorted(self._specs)]

    def spec_for(self, func: Callable[..., Any]) -> TaskSpec:
        """The spec of an exposed method given as `Class.method`."""
        class_name, _, method = getattr(func, "__qualname__", "").rpartition(".")
        for spec in self._specs.values():
            if spec.method == method and spec.cls.__qualname__ == class_name:
                return spec
        raise UnknownTaskError(f"{func!r} is not an exposed method of a registered class")

    def _add(self, cls: type, name: str) -> None:
        check_name(name, "class name")
        existing = self._classes.get(name)
        same = existing is None or (existing.__module__, existing.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if not same:
            raise ConfigError(f"two task classes registered as {name!r}")
        try:
            cls()
        except TypeError as exc:
            raise ConfigError(
                f"task class {name} must be constructible without arguments: {exc}"
            ) from None
        self._classes[name] = cls
        found = False
        for attr, member in vars(cls).items():
            options = getattr(member, _EXPOSED_ATTR, None)
            if options is None or not callable(member):
                continue
            check_name(attr, "method name")
            self._specs[(name, attr)] = TaskSpec(name, attr, cls, _params(cls, member), options)
            found = True
        if not found:
            raise ConfigError(f"task class {name} has no method marked @exposed")


def _params(cls: type, func: Callable[..., Any]) -> tuple[Param, ...]:
    label = f"{cls.__name__}.{func.__name__}"
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:
        raise ConfigError(f"{label}: cannot read type annotations: {exc}") from None
    params: list[Param] = []
    for i, p in enumerate(inspect.signature(func).parameters.values()):
        if i == 0:
            continue  # self
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise ConfigError(f"{label}: only plain positional parameters are supported ({p.name})")
        hint = hints.get(p.name, str)
        conv = CONVERTERS.get(hint)
        if conv is None:
            names = ", ".join(c.type_name for c in CONVERTERS.values())
            raise ConfigError(f"{label}: parameter {p.name} has type {hint!r}; allowed: {names}")
        params.append(Param(p.name, conv, p.default is inspect.Parameter.empty))
    return tuple(params)


default_registry = Registry()
"""The registry `@task` adds to and the listener and CLI use."""


def task(cls: type[T] | None = None, *, name: str | None = None) -> Any:
    """Register a task class in the default registry (bare, or `@task(name="Alias")`)."""
    return default_registry.register(cls, name=name)
