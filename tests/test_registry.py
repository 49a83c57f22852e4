"""Registry: only exposed methods of registered classes run, with typed arguments."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

import pytest

from keyexpiry import Registry, exposed
from keyexpiry.errors import ArgumentError, ConfigError, KeyFormatError, UnknownTaskError


def make_registry() -> Registry:
    reg = Registry()

    @reg.register
    class Orders:
        @exposed(timeout_s=5, retry_schedule_s=[1, 2])
        def close(self, order_id: int, amount: Decimal, urgent: bool = False) -> None: ...

        @exposed
        def note(self, text: str, when: dt.date, ref: uuid.UUID, ratio: float) -> None: ...

        def helper(self) -> None: ...

    return reg


def test_arguments_are_converted_and_checked_at_create() -> None:
    spec = make_registry().resolve("Orders", "close")
    assert spec.encode_args([218, Decimal("9.90")]) == ("218", "9.9")
    assert spec.encode_args(["218", "9.90", "true"]) == ("218", "9.9", "true")
    assert spec.decode_args(["218", "9.90", "true"]) == (218, Decimal("9.90"), True)
    assert spec.options.timeout_s == 5
    assert spec.options.retry_schedule_s == (1, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "takes 2..3 argument"),
        ([1, 2, 3, 4], "takes 2..3 argument"),
        (["x", "1"], "must be int"),
        ([True, "1"], "must be int"),
        ([1.5, "1"], "must be int"),
        ([1, "nan"], "must be Decimal"),
        ([1, "1", "maybe"], "must be bool"),
    ],
)
def test_wrong_count_or_type_is_a_clear_error(args: list[object], message: str) -> None:
    spec = make_registry().resolve("Orders", "close")
    with pytest.raises(ArgumentError, match=message):
        spec.encode_args(args)


def test_other_supported_types_round_trip() -> None:
    spec = make_registry().resolve("Orders", "note")
    values = ("a@b c", dt.date(2026, 11, 21), uuid.UUID(int=7), 0.1)
    assert spec.decode_args(spec.encode_args(values)) == values


@pytest.mark.parametrize(
    "class_name, method",
    [
        ("Orders", "helper"),
        ("Orders", "__init__"),
        ("Orders", "__class__"),
        ("Nope", "close"),
        ("os", "system"),
    ],
)
def test_only_exposed_methods_of_registered_classes_resolve(class_name: str, method: str) -> None:
    with pytest.raises(UnknownTaskError):
        make_registry().resolve(class_name, method)


def test_bind_returns_a_fresh_instance_method() -> None:
    spec = make_registry().resolve("Orders", "close")
    first, second = spec.bind(), spec.bind()
    assert first.__self__ is not second.__self__  # type: ignore[attr-defined]


def test_registration_refuses_what_a_key_could_not_express() -> None:
    reg = Registry()
    with pytest.raises(ConfigError, match="no method marked"):

        @reg.register
        class Empty:
            pass

    with pytest.raises(ConfigError, match="type"):

        @reg.register
        class BadType:
            @exposed
            def run(self, items: list[int]) -> None: ...

    with pytest.raises(ConfigError, match="positional"):

        @reg.register
        class Kw:
            @exposed
            def run(self, *, a: int) -> None: ...

    with pytest.raises(ConfigError, match="without arguments"):

        @reg.register
        class NeedsArgs:
            def __init__(self, x: int) -> None: ...

            @exposed
            def run(self) -> None: ...

    with pytest.raises(KeyFormatError):
        reg.register(type("Bad", (), {"_hidden": exposed(lambda self: None)}))


def test_two_classes_cannot_share_a_name() -> None:
    reg = Registry()

    @reg.register(name="Shared")
    class A:
        @exposed
        def run(self) -> None: ...

    with pytest.raises(ConfigError, match="two task classes"):

        @reg.register(name="Shared")
        class B:
            @exposed
            def run(self) -> None: ...
