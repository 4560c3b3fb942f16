"""The MLflow model registry, through MLflow's own client: versions and the two aliases.

`champion` is the version being served; `challenger` the newest candidate. Stages are
deprecated in MLflow 3, so only aliases are used (`models:/<name>@champion`). A version is
the run's MLflow Model (artifact `mlflow_model/`: the retrieval SavedModel behind a pyfunc,
serving_export.mlflow_model), so `mlflow.pyfunc.load_model("models:/<name>@champion")` and
`mlflow models serve` work on it. Versions registered before that point at the run's
`savedmodels/` folder, which MLflow cannot load (`legacy_reason` says so).
"""

from __future__ import annotations

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from recsys.core.layout import RunFile

CHAMPION = "champion"
CHALLENGER = "challenger"
# Folder of a nightly run's artifacts that holds its exported SavedModels (query/, retrieval/).
SAVEDMODELS = "savedmodels"
# Folder of a nightly run's artifacts that holds its MLflow Model: the registered source.
MLFLOW_MODEL = str(RunFile.MLFLOW_MODEL)
# Run tag naming the registered version, so a rerun never registers the same run twice.
VERSION_TAG = "registered_version"


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create the registered model unless it exists (another process may race us: fine)."""
    try:
        client.create_registered_model(name, description="recsys two-tower retrieval model")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def register_run(client: MlflowClient, name: str, run_id: str) -> ModelVersion:
    """The run's MLflow Model as a version of `name`; the existing version on a rerun."""
    ensure_registered_model(client, name)
    existing = [v for v in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")]
    if existing:
        return min(existing, key=lambda v: int(v.version))
    run = client.get_run(run_id)
    version = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri.rstrip('/')}/{MLFLOW_MODEL}",
        run_id=run_id,
        tags={"run_date": run.data.tags.get("run_date", "")},
        description=f"nightly run {run.info.run_name}",
    )
    client.set_tag(run_id, VERSION_TAG, str(version.version))
    return version


def alias_version(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    """The version an alias points to, or None if the model or alias does not exist."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def set_alias(client: MlflowClient, name: str, alias: str, version: str | int) -> None:
    """Point `alias` at `version` (moving it from wherever it was)."""
    client.set_registered_model_alias(name, alias, str(version))


def model_version(client: MlflowClient, name: str, version: str | int) -> ModelVersion:
    """One version of a registered model (MlflowException if missing)."""
    return client.get_model_version(name, str(version))


def legacy_reason(name: str, version: ModelVersion) -> str | None:
    """Why MLflow cannot load `version` (registered before versions were MLflow Models), or
    None when it can."""
    if (version.source or "").rstrip("/").endswith(f"/{MLFLOW_MODEL}"):
        return None
    return (
        f"version {version.version} of {name} was registered before versions were MLflow "
        f"Models (its source is a folder of SavedModels, {version.source}): "
        f"`models:/{name}@...` cannot be loaded or served by MLflow while it holds that alias. "
        "Its gate re-evaluation is unaffected; the next promoted version is loadable "
        "(`recsys nightly --force-promote` promotes tonight's)"
    )
