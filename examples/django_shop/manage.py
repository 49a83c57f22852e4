#!/usr/bin/env python
"""The shop's manage.py: `python manage.py migrate`, `runserver`, `keyexpiry listen`."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
