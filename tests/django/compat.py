"""Django's `@task` from django.tasks (Django 6) or the django-tasks backport (Django 5.2)."""

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task  # type: ignore[no-redef]

__all__ = ["task"]
