# The two set-up commands of the README:  `make demo`  and  `make test`.
# Both build the virtual environment first (deploy/install.sh: every package from the hashed lock in deploy/lock/).
# `make test` also installs Debian's chromium for the page's browser tests (deploy/install-chromium.sh).
VENV ?= .venv
TEST_PROCESSES ?= 2  # pytest-xdist processes of `make test` (3 on 2 cores overloaded them: leases expired)
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# the browser tests drive Debian's chromium, never a browser download
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
# Python caches compiled bytecode even where the environment turns it off (PYTHONDONTWRITEBYTECODE=1):
# otherwise every test process, Ray worker and `pelt` child recompiles pelt's modules, and pytest
# re-rewrites every test module in each of its processes (collection alone: 18.3 s without, 11.3 s with)
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install demo test test-fast lint lock bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml deploy/install.sh deploy/lock/dev.txt deploy/lock/torch-cpu.txt
	bash deploy/install.sh $(VENV) dev
	touch $@

# relock after a change to pyproject.toml, constraints.txt or deploy/lock/ (uv.toml, *.in); locked versions stay
lock: install
	$(PY) deploy/lock.py $(LOCK_ARGS)

demo: install
	$(VENV)/bin/pelt demo

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# every test, on TEST_PROCESSES pytest-xdist processes (tests/tiers.py: a module stays on one process, the
# tests that start Ray or a service stack run one at a time on one), the 25 slowest named at the end
test: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	bash deploy/install-chromium.sh
	url="$${PELT_TEST_DATABASE_URL:-}"; \
	if [ -z "$$url" ]; then url="$$(bash deploy/local-postgres.sh)" || exit 1; fi; \
	PELT_TEST_DATABASE_URL="$$url" $(PY) -m pytest -n $(TEST_PROCESSES) --dist loadscope --durations=25 $(PYTEST_ARGS)

# the inner loop: every test not marked slow, SQLite only (no Ray, no browser, no service processes, no
# PostgreSQL, none that took a second or more in the last measured full run: tests/tiers.py)
test-fast: install
	$(PY) -m pytest -n 2 --dist loadscope -m "not slow and not gpu and not postgres" $(PYTEST_ARGS)
