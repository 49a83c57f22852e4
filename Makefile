# One place for every command README, CI and developers use.
PYTHON ?= python3
# Another interpreter (`make test PYTHON=python3.13`, a name or a path) gets a venv of its own:
# .venv stays the one README's commands use.
VENV := $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# What runs keyexpiry (demo, listen, web): the package alone, none of the test extras
# (playwright, mypy, matplotlib, ... would triple the venv of someone who only runs the demo).
RUN_STAMP := $(VENV)/.run-stamp
PYTEST_ARGS ?=
# Four workers on two cores: at two the suite took 22 minutes, half of it waiting (CPU at about
# one core). At four, the fault scenarios starved each other past their timing bounds, so at
# most two of them run at once (tests/slots.py; KEYEXPIRY_TEST_FAULT_SLOTS) and the other
# workers run the rest meanwhile. `loadgroup` keeps the few tests that load the machine for half
# a minute or more (xdist_group "heavy") on one worker, one after another.
XDIST ?= -n 4 --dist loadgroup
# The peers benchmark has a venv of its own: arq pins redis-py below 6 (and brings hiredis), which
# the main venv must not get (its mypy checks keyexpiry against the redis-py it really uses).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-stamp
BENCH_ARGS ?= --runs 3

SOAK_MINUTES ?= 10
SOAK_LEDGER ?= mariadb
SOAK_REDIS ?= sentinel
SOAK_ARGS ?=

.PHONY: demo listen web dist test test-fast lint format servers reliability screenshots bench-peers bench-runnow soak clean

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

## demo: the main job on the embedded default (bundled redis-server + SQLite), nothing else needed
demo: $(RUN_STAMP)
	$(BIN)/keyexpiry demo

## listen: a listener for the example tasks on the embedded default (or KEYEXPIRY_* URLs)
listen: $(RUN_STAMP)
	$(BIN)/keyexpiry listen --tasks tasks.orders,tasks.auctions,tasks.refunds

## servers: the real redis-server, MariaDB and PostgreSQL the tests start on loopback ports (and
## faketime, the headless Chromium the dashboard's browser test drives, the `mariadb` and
## `redis-cli` clients docs/PROTOCOL.md's test creates tasks with, PHP with PDO MySQL, PDO PostgreSQL and phpredis
## the PHP producer's test (contrib/php) runs, and the Galera provider, rsync for its state
## transfers and HAProxy the fault suite's Galera cluster needs, Patroni and etcd for its
## PostgreSQL-under-Patroni ledger, ip and iptables for its network namespaces)
servers:
	@command -v redis-server >/dev/null && command -v mariadbd >/dev/null && command -v faketime >/dev/null \
	  && command -v chromium >/dev/null && command -v mariadb >/dev/null && command -v redis-cli >/dev/null \
	  && test -f /usr/lib/galera/libgalera_smm.so && command -v rsync >/dev/null \
	  && command -v haproxy >/dev/null && ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 \
	  && command -v patroni >/dev/null && command -v etcd >/dev/null \
	  && command -v ip >/dev/null && command -v iptables >/dev/null \
	  && command -v php >/dev/null \
	  && php -r 'exit(extension_loaded("pdo_mysql") && extension_loaded("pdo_pgsql") && extension_loaded("redis") ? 0 : 1);' \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  redis-server redis-tools mariadb-server mariadb-client faketime chromium galera-4 rsync haproxy \
	  postgresql patroni etcd-server iproute2 iptables php-cli php-mysql php-pgsql php-redis; }

lint: $(STAMP)
	$(BIN)/ruff check keyexpiry tasks tests examples
	$(BIN)/ruff format --check keyexpiry tasks tests examples
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format keyexpiry tasks tests examples
	$(BIN)/ruff check --fix keyexpiry tasks tests examples

## test: the whole suite against real servers (installs what it needs)
test: $(STAMP) servers lint
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

## test-fast: the suite without the fault scenarios and the browser test (CI runs it on the newest
## other Python it finds: `make test-fast PYTHON=python3.13`)
test-fast: $(STAMP) servers
	$(BIN)/pytest $(XDIST) --ignore=tests/faults --ignore=tests/test_web_browser.py $(PYTEST_ARGS)

## web: the dashboard on http://127.0.0.1:8080/ (loopback only unless KEYEXPIRY_WEB_TOKEN is set)
web: $(RUN_STAMP)
	$(BIN)/keyexpiry web --tasks tasks.orders,tasks.auctions,tasks.refunds

## screenshots: the dashboard in headless Chromium, written to docs/dashboard*.png
screenshots: $(STAMP) servers
	KEYEXPIRY_SCREENSHOT_DIR=docs $(BIN)/pytest -p no:xdist tests/test_web_browser.py

## reliability: the fault suite alone, writing its table to docs/RELIABILITY.md
reliability: $(STAMP) servers
	KEYEXPIRY_RELIABILITY_OUT=docs/RELIABILITY.md $(BIN)/pytest $(XDIST) tests/faults $(PYTEST_ARGS)

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q -e '.[test,peers]'
	@touch $(PEERS_STAMP)

## bench-peers: steady on keyexpiry, huey and arq side by side (BENCH_ARGS, default --runs 3)
bench-peers: $(PEERS_STAMP) servers
	$(PEERS_VENV)/bin/keyexpiry bench --scenario steady $(BENCH_ARGS)

## bench-runnow: run-now tasks on keyexpiry beside Celery, Dramatiq, RQ, arq and huey (BENCH_ARGS;
## at full size one run takes about half an hour here: `make bench-runnow BENCH_ARGS="--runs 1"`)
bench-runnow: $(PEERS_STAMP) servers
	$(PEERS_VENV)/bin/keyexpiry bench --scenario run-now $(BENCH_ARGS)

## soak: SOAK_MINUTES (default 10) of 500 tasks/s on SOAK_REDIS (sentinel, or cluster) and SOAK_LEDGER
## (mariadb, postgres, patroni or patroni-sync) with a fault every minute (SOAK_ARGS=--network: one
## listener in a network namespace, partitions and a slow lossy link in the rotation); verdict,
## history, plots in bench-results/soak/
soak: $(STAMP) servers
	$(BIN)/keyexpiry bench --scenario soak --minutes $(SOAK_MINUTES) --backend $(SOAK_LEDGER) \
		--redis $(SOAK_REDIS) $(SOAK_ARGS)

## dist: a wheel in dist/ (keyexpiry is not on a package index yet: `pip install dist/keyexpiry-*.whl`)
dist: $(RUN_STAMP)
	rm -rf dist
	$(BIN)/pip wheel -q --no-deps -w dist .

clean:
	rm -rf .venv .venv-python3* $(PEERS_VENV) .mypy_cache .ruff_cache .pytest_cache build dist
