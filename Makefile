# Set-up is part of every target: a fresh clone needs only Python 3.11 and these commands.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= recsys-work
PYTEST_ARGS ?=
# Two worker processes, each taking a whole test file (its module fixtures are set up once):
# the suite's nightlies are mostly single-threaded Python (2 cores: 51 min, one process 74 in CI).
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
# Apache Airflow's own venv (its pins clash with ours): only for the DAG's check.
AIRFLOW_VENV ?= .venv-airflow
AIRFLOW_BIN := $(AIRFLOW_VENV)/bin

.PHONY: run test lint install clean airflow-check

$(BIN)/recsys: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(BIN)/recsys

install: $(BIN)/recsys

run: install
	$(BIN)/recsys nightly --config configs/default.yaml --workdir $(WORKDIR)

test: install
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The Airflow DAG (deploy/airflow), checked by Airflow itself: its tasks run $(BIN)/recsys.
$(AIRFLOW_BIN)/airflow: deploy/airflow/requirements.txt
	test -x $(AIRFLOW_BIN)/python || $(PYTHON) -m venv $(AIRFLOW_VENV) || python3 -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_BIN)/python -m pip install -q --upgrade "pip>=24"
	$(AIRFLOW_BIN)/python -m pip install -q -r deploy/airflow/requirements.txt
	touch $(AIRFLOW_BIN)/airflow

airflow-check: install $(AIRFLOW_BIN)/airflow
	$(AIRFLOW_BIN)/python deploy/airflow/check_dag.py --recsys $(BIN)/recsys

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy

clean:
	rm -rf $(WORKDIR) .pytest_cache
