# The two set-up commands of the README:  `make demo`  and  `make test`.
# Both build the virtual environment first (deploy/install.sh: torch's CPU build first, pinned, then the rest).
# `make test` also installs Debian's chromium for the page's browser tests (deploy/install-chromium.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# the browser tests drive Debian's chromium, never a browser download
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt deploy/install.sh
	bash deploy/install.sh $(VENV)
	touch $@

demo: install
	$(VENV)/bin/pelt demo

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	bash deploy/install-chromium.sh
	PELT_TEST_DATABASE_URL="$${PELT_TEST_DATABASE_URL:-$$(bash deploy/local-postgres.sh)}" \
		$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
