"""`keyexpiry bench`: scenario benchmarks against real redis-server, MariaDB and SQLite."""
