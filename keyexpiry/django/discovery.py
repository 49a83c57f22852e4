"""Which Django task functions a listener runs: those of the installed apps' `tasks.py` (and of
`KEYEXPIRY["TASKS"]`'s modules) whose backend is keyexpiry's."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from django.apps import apps

from keyexpiry.django.backend import TasksBackend
from keyexpiry.django.compat import Task, task_backends
from keyexpiry.django.functions import spec_of
from keyexpiry.registry import Registry


def discover(registry: Registry, modules: Iterable[str] = ()) -> list[str]:
    """Import every installed app's `tasks` module (and `modules`), and register each task
    function found there whose backend is keyexpiry's. Returns their paths, sorted."""
    names = [f"{config.name}.tasks" for config in apps.get_app_configs()]
    found: list[str] = []
    for name in [*names, *modules]:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that app has no tasks module
            raise
        for value in vars(module).values():
            if not isinstance(value, Task) or value.func.__module__ != module.__name__:
                continue
            if not isinstance(task_backends[value.backend], TasksBackend):
                continue
            spec_of(value, registry)
            found.append(f"{value.func.__module__}.{value.func.__qualname__}")
    return sorted(found)
