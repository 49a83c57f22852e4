"""Which classes and methods a Redis key may run, and how their arguments are typed (the
types themselves, and their canonical strings in a key, are `keyexpiry.arguments`).

Only classes registered here, and only their methods marked with `@exposed`, can ever run: a key
names a registered class and an exposed method; it is never a module path, never resolved with
`getattr` on arbitrary objects, and never imports anything.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar, overload

from keyexpiry import limits
from keyexpiry.arguments import CONVERTERS, Converter, encode_by_type
from keyexpiry.errors import ArgumentError, ConfigError, UnknownTaskError
from keyexpiry.flow.rules import Rate, parse_concurrency, parse_group, parse_rate
from keyexpiry.keys import check_name, clip, shorten
from keyexpiry.payloads import PAYLOAD_PARAMETER
from keyexpiry.schedules.rules import Cadence, cadence

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
_EXPOSED_ATTR = "__keyexpiry_exposed__"


@dataclass(frozen=True, slots=True)
class ExposeOptions:
    """Per-method settings given to `@exposed`."""

    timeout_s: float | None = None
    retry_schedule_s: tuple[float, ...] | None = None
    transactional: bool = False
    """Run in a ledger transaction that also records the run as done (`current().tx`)."""
    concurrency: int | None = None
    """At most this many runs at once over the whole fleet."""
    rate: Rate | None = None
    """At most this many starts per period over the whole fleet."""
    one_at_a_time: tuple[str, ...] | None = None
    """Argument names: runs with equal values of them never overlap, fleet-wide."""
    schedule: Cadence | None = None
    """Runs on this recurrence, declared by every listener that registers the class (schedule
    name: `Class.method`)."""

    @property
    def shaped(self) -> bool:
        """Whether any flow rule applies (then each start needs a permit from Redis)."""
        return bool(self.concurrency or self.rate or self.one_at_a_time)


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
    is_async: bool = False
    """An `async def` method: the listener awaits it on its event loop."""
    takes_payload: bool = False
    """The method has a parameter named `payload`: it receives the task's payload (keyword),
    which is no argument of the key."""
    checked: bool = True
    """False for a task this process knows only by name (a producer without the handler's code
    and without a declared signature): its arguments are encoded by their own types."""
    runnable: bool = True
    """False for a signature declared without the code (`Registry.declare`): creatable, never
    run here."""

    def encode_args(self, args: Sequence[object]) -> tuple[str, ...]:
        """Check Python values against the signature and return their canonical key strings.

        Strings are accepted for any type and parsed (that is how the CLI passes them); other
        values are converted to the annotated type when that loses nothing (`5.0` for an int).
        A task known only by name (`checked` false) encodes each value by its own type, with
        the same canonical rules; the listener that runs it checks them against the handler.
        """
        if not self.checked:
            return tuple(encode_by_type(self.label, i, value) for i, value in enumerate(args))
        self._check_count(len(args))
        out: list[str] = []
        for param, value in zip(self.params, args, strict=False):
            conv = param.converter
            if isinstance(value, str) and conv.type_name != "str":
                value = self._parse_one(param, value)
            else:
                try:
                    value = conv.coerce(value)
                except TypeError as exc:
                    raise ArgumentError(
                        f"{self.label}: argument {param.name!r} must be {conv.type_name}, "
                        f"{shorten(str(exc), 120)}"
                    ) from None
                except ValueError as exc:
                    raise ArgumentError(
                        f"{self.label}: argument {param.name!r} must be {conv.type_name}: "
                        f"{shorten(str(exc), 120)}"
                    ) from None
            out.append(conv.encode(value))
        return tuple(out)

    def legacy_args(self, args: Sequence[object]) -> tuple[str, ...]:
        """The key strings keyexpiry 0.1 made of `args` before keys became canonical (a Decimal
        as written, `19.90`; an int given for a float, `5`), so `cancel` still finds a task
        created before the upgrade. Only called after `encode_args` accepted `args`."""
        if not self.checked:
            return self.encode_args(args)  # no signature: no older spelling to guess
        out: list[str] = []
        for param, value, canonical in zip(self.params, args, self.encode_args(args), strict=False):
            if isinstance(value, Decimal | int) and not isinstance(value, bool):
                out.append(str(value))
            elif isinstance(value, str) and param.converter.type_name == "Decimal":
                out.append(str(Decimal(value)))
            else:
                out.append(canonical)
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
        if count == len(self.params):
            return  # every parameter given: the common case, with nothing to count
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
    *,
    timeout_s: float | None = None,
    retry_schedule_s: Sequence[float] | None = None,
    transactional: bool = False,
    concurrency: int | None = None,
    rate: str | None = None,
    one_at_a_time: str | Sequence[str] | None = None,
    cron: str | None = None,
    every_s: float | None = None,
    tz: str = "UTC",
    catch_up: str = "latest",
    overlap: str = "skip",
) -> Callable[[F], F]: ...
def exposed(
    func: F | None = None,
    /,
    *,
    timeout_s: float | None = None,
    retry_schedule_s: Sequence[float] | None = None,
    transactional: bool = False,
    concurrency: int | None = None,
    rate: str | None = None,
    one_at_a_time: str | Sequence[str] | None = None,
    cron: str | None = None,
    every_s: float | None = None,
    tz: str = "UTC",
    catch_up: str = "latest",
    overlap: str = "skip",
) -> Any:
    """Mark a method of a task class as runnable from a key; use bare or with options.

    The method may be `async def`: the listener awaits it on an event loop of its own, with the
    same claims, timeout (the coroutine is cancelled), retries and outcome as a plain one.

    `timeout_s`: a run longer than this counts as a failed attempt.
    `retry_schedule_s`: delays before each retry; its length is the number of retries.
    `transactional`: the handler gets `current().tx`, a connection to the ledger's database in
    the transaction that records the run as done: its writes there commit with that record, or
    roll back with a failure (which retries per schedule), a timeout or a lost claim.

    Flow rules, fleet-wide (every listener together), for shaping bursts (README "Shaping
    bursts"); a task held back by one stays pending, is not an attempt, and starts when allowed:
    `concurrency`: at most this many runs at once.
    `rate`: at most this many starts per second, minute or hour (`"200/s"`, `"30/min"`).
    `one_at_a_time`: an argument name (or a list of them): runs whose values of it are equal
    never overlap (`one_at_a_time="order_id"`); runs of other values go on in parallel.

    A recurring schedule, for a method without arguments (README "Recurring schedules"):
    `cron` (5 fields, or `@daily`…) in time zone `tz` (IANA name, default UTC), or `every_s`
    seconds; `catch_up` after downtime ("latest", "all", "none") and `overlap` for a run still
    going when the next falls due ("skip", "wait"). Every listener that registers the class
    declares it, named `Class.method`; each occurrence runs once per claim across the fleet.
    """
    if not isinstance(transactional, bool):
        raise ConfigError(f"@exposed transactional must be True or False, got {transactional!r}")
    # Checked here, at import time: a bad value must never reach the listener's threads.
    options = ExposeOptions(
        timeout_s=None
        if timeout_s is None
        else limits.number(
            timeout_s,
            "@exposed timeout_s",
            low=0,
            high=limits.MAX_DELAY_S,
            error=ConfigError,
            above_low=True,
        ),
        retry_schedule_s=limits.delays(retry_schedule_s, "@exposed retry_schedule_s", ConfigError),
        transactional=transactional,
        concurrency=None
        if concurrency is None
        else parse_concurrency(concurrency, "@exposed concurrency"),
        rate=None if rate is None else parse_rate(rate, "@exposed rate"),
        one_at_a_time=None
        if one_at_a_time is None
        else parse_group(one_at_a_time, "@exposed one_at_a_time"),
        schedule=None
        if cron is None and every_s is None
        else _cadence("@exposed", cron, every_s, tz, catch_up, overlap),
    )

    def mark(f: F) -> F:
        setattr(f, _EXPOSED_ATTR, options)
        return f

    return mark(func) if func is not None else mark


class _NoCode:
    """The class of a task this process can create but not run (`Registry.by_name`)."""


class Registry:
    """Maps class names to task classes and their exposed methods."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], TaskSpec] = {}
        self._classes: dict[str, type] = {}
        self._declared: dict[tuple[str, str], TaskSpec] = {}

    def declare(self, name: str, /, **params: Any) -> TaskSpec:
        """Declare the signature of task `name` ("Class.method") without its code, as
        `param=type` in order (a type a task method may annotate; a default is not declared):
        a producer then gets the handler's checks and canonical keys at create time. Declared
        tasks are never run by this registry's listener."""
        class_name, sep, method = name.partition(".")
        if not sep:
            raise ConfigError(f"{clip(name)}: name a task as 'Class.method'")
        check_name(class_name, "class name")
        check_name(method, "method name")
        declared: list[Param] = []
        for param, hint in params.items():
            conv = CONVERTERS.get(hint)
            if conv is None:
                names = ", ".join(c.type_name for c in CONVERTERS.values())
                raise ConfigError(f"{name}: parameter {param} has type {hint!r}; allowed: {names}")
            declared.append(Param(param, conv, True))
        spec = TaskSpec(
            class_name, method, _NoCode, tuple(declared), ExposeOptions(), runnable=False
        )
        self._declared[(class_name, method)] = spec
        return spec

    def by_name(self, class_name: str, method: str) -> TaskSpec:
        """The spec a producer creates `class_name.method` with: the registered one; else a
        declared signature (`declare`); else, in a registry without any task class (a process
        that only produces: it imported no handler code), one that encodes arguments by their
        own types, which the listener that runs the task checks against the handler.

        UnknownTaskError for a method a registered class does not expose, and for a class
        neither registered nor declared in a registry that has classes: a process that knows
        its tasks refuses a name it does not know (a typo would make a task nobody runs)."""
        spec = self._specs.get((class_name, method))
        if spec is not None:
            return spec
        declared = self._declared.get((class_name, method))
        if declared is not None and class_name not in self._classes:
            return declared
        if self._classes:
            return self.resolve(class_name, method)  # raises
        check_name(class_name, "class name")
        check_name(method, "method name")
        return TaskSpec(
            class_name, method, _NoCode, (), ExposeOptions(), checked=False, runnable=False
        )

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
                f"task class {clip(class_name)} is not registered (import its module with "
                "--tasks, or declare it: keyexpiry.signature)"
            )
        return spec

    def has_class(self, class_name: str) -> bool:
        """Whether a task class is registered under `class_name`."""
        return class_name in self._classes

    def class_names(self) -> frozenset[str]:
        """The names of the registered task classes."""
        return frozenset(self._classes)

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
            if inspect.isasyncgenfunction(member) or inspect.isgeneratorfunction(member):
                raise ConfigError(
                    f"{name}.{attr} is a generator; a task method is a plain or `async def` one"
                )
            if options.transactional and inspect.iscoroutinefunction(member):
                # Its transaction would be a blocking connection used on the event loop.
                raise ConfigError(
                    f"{name}.{attr}: @exposed(transactional=True) is for plain methods, "
                    "not `async def` ones"
                )
            params = _params(cls, member)
            _check_group(f"{name}.{attr}", options, params)
            _check_schedule(f"{name}.{attr}", options, params)
            self._specs[(name, attr)] = TaskSpec(
                name,
                attr,
                cls,
                params,
                options,
                inspect.iscoroutinefunction(member),
                PAYLOAD_PARAMETER in inspect.signature(member).parameters,
            )
            found = True
        if not found:
            raise ConfigError(f"task class {name} has no method marked @exposed")


def _cadence(
    where: str, cron: str | None, every_s: float | None, tz: str, catch_up: str, overlap: str
) -> Cadence:
    try:
        return cadence(cron=cron, every_s=every_s, tz=tz, catch_up=catch_up, overlap=overlap)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_schedule(label: str, options: ExposeOptions, params: tuple[Param, ...]) -> None:
    if options.schedule is None:
        return
    if params:
        raise ConfigError(
            f"{label}: @exposed(cron=/every_s=) is for a method without arguments; schedule one "
            "per argument set with Client.schedule(name, target, *args, cron=…)"
        )
    if options.transactional:
        raise ConfigError(f"{label}: a scheduled method cannot be transactional=True (yet)")


def _check_group(label: str, options: ExposeOptions, params: tuple[Param, ...]) -> None:
    # Said when the class is registered (its module imported), not when a run starts.
    names = [p.name for p in params]
    for group in options.one_at_a_time or ():
        if group not in names:
            raise ConfigError(
                f"{label}: one_at_a_time={group!r} names no argument of it "
                f"(its arguments: {', '.join(names) or 'none'})"
            )


def group_positions(spec: TaskSpec) -> tuple[int, ...]:
    """Where the arguments named by `one_at_a_time` stand among the key's arguments."""
    names = [p.name for p in spec.params]
    return tuple(names.index(n) for n in spec.options.one_at_a_time or ())


def _params(cls: type, func: Callable[..., Any]) -> tuple[Param, ...]:
    label = f"{cls.__name__}.{func.__name__}"
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:
        raise ConfigError(f"{label}: cannot read type annotations: {exc}") from None
    params: list[Param] = []
    payload_seen = False
    for i, p in enumerate(inspect.signature(func).parameters.values()):
        if i == 0:
            continue  # self
        if p.name == PAYLOAD_PARAMETER:
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise ConfigError(f"{label}: `payload` must be a parameter passed by name")
            payload_seen = True
            continue  # the task's payload, passed by name: no argument of the key
        if payload_seen and p.kind is not p.KEYWORD_ONLY:
            # The key's arguments are passed by position: one after `payload` would take it.
            raise ConfigError(f"{label}: `payload` must come after the task's arguments")
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


def signature(name: str, /, **params: Any) -> TaskSpec:
    """Declare task `name`'s signature in the default registry without its code
    (`Registry.declare`): `keyexpiry.signature("OrderTimeout.close_unpaid", order_id=int)`."""
    return default_registry.declare(name, **params)


def task(cls: type[T] | None = None, *, name: str | None = None) -> Any:
    """Register a task class in the default registry (bare, or `@task(name="Alias")`)."""
    return default_registry.register(cls, name=name)
