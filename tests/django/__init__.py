"""Tests of keyexpiry.django (issue 40) on SQLite, MariaDB and PostgreSQL."""
