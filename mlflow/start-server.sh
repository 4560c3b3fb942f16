#!/usr/bin/env bash
# Start a local MLflow tracking server for recsys (see mlflow/README.md).
# By default it serves the same SQLite store that `recsys nightly` writes when no tracking URI is
# set, so runs logged either way show up together. Extra arguments go to `mlflow server`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
store="${MLFLOW_STORE_DIR:-${RECSYS_WORKDIR:-recsys-work}/mlflow}"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
workers="${MLFLOW_WORKERS:-1}"

mlflow_bin="$repo/.venv/bin/mlflow"
[[ -x "$mlflow_bin" ]] || mlflow_bin="$(command -v mlflow)" || {
  echo "mlflow not found: run 'make install' first (or put mlflow on PATH)" >&2
  exit 1
}

mkdir -p "$store/artifacts"
store="$(cd "$store" && pwd)"  # SQLite URIs and artifact roots must not depend on the cwd

# The job runner and its huey consumers only serve MLflow's GenAI features; recsys needs none.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

echo "MLflow server: http://$host:$port  store: $store/mlflow.db  artifacts: $store/artifacts" >&2
exec "$mlflow_bin" server \
  --backend-store-uri "sqlite:///$store/mlflow.db" \
  --default-artifact-root "$store/artifacts" \
  --host "$host" --port "$port" --workers "$workers" \
  "$@"
