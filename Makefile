# Set-up is part of every target: a fresh clone needs only Python 3.11 and these commands.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= recsys-work
PYTEST_ARGS ?=

.PHONY: run test lint install clean

$(BIN)/recsys: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(BIN)/recsys

install: $(BIN)/recsys

run: install
	$(BIN)/recsys nightly --config configs/default.yaml --workdir $(WORKDIR)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy

clean:
	rm -rf $(WORKDIR) .pytest_cache
