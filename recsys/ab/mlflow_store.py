"""A/B experiments in MLflow: the definition as experiment tags, each analysis as a run.

MLflow experiment `ab-<name>`: tag `ab.definition` (the definition as JSON) and
`ab.variant.<v>` / `ab.version.<v>` (model reference and the registered version it meant).
Each analysis is a run `analysis-<last day>` with the numbers as metrics and the decision as
tags; `promote` moves `champion` with the registry code the nightly gate uses.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, RunStatus

from recsys.ab.analysis import Analysis
from recsys.ab.definition import ExperimentDefinition, make_definition
from recsys.core.errors import ConfigError
from recsys.tracking import registry

DEFINITION_TAG = "ab.definition"
_VERSION = re.compile(r"^v?(\d+)$")


def experiment_name(name: str) -> str:
    """The MLflow experiment of an A/B test."""
    return f"ab-{name}"


def version_number(ref: str) -> str | None:
    """`3` for the references `3` and `v3`; None for an alias."""
    match = _VERSION.match(ref)
    return match.group(1) if match else None


def resolve_version(client: MlflowClient, model_name: str, ref: str) -> str | None:
    """The registered version behind `3`, `v3` or an alias (None if the alias is unset)."""
    if (number := version_number(ref)) is not None:
        return number
    version = registry.alias_version(client, model_name, ref)
    return str(version.version) if version is not None else None


def pin_versions(
    client: MlflowClient, definition: ExperimentDefinition, model_name: str
) -> ExperimentDefinition:
    """The definition with each variant's model reference resolved to a version (if unset)."""
    versions = dict(definition.versions)
    for variant, ref in definition.variants.items():
        if variant not in versions:
            found = resolve_version(client, model_name, ref)
            if found is not None:
                versions[variant] = found
    return definition.model_copy(update={"versions": versions, "model_name": model_name})


def record_definition(
    client: MlflowClient, experiment_id: str, definition: ExperimentDefinition
) -> None:
    """Store the definition (and each variant's model) as tags of the MLflow experiment."""
    client.set_experiment_tag(experiment_id, DEFINITION_TAG, definition.model_dump_json())
    for variant, ref in definition.variants.items():
        client.set_experiment_tag(experiment_id, f"ab.variant.{variant}", ref)
        if variant in definition.versions:
            client.set_experiment_tag(
                experiment_id, f"ab.version.{variant}", definition.versions[variant]
            )


def stored_definition(client: MlflowClient, name: str) -> ExperimentDefinition | None:
    """The definition recorded for experiment `name`, if any."""
    experiment = client.get_experiment_by_name(experiment_name(name))
    if experiment is None or DEFINITION_TAG not in experiment.tags:
        return None
    data = json.loads(experiment.tags[DEFINITION_TAG])
    return make_definition(data, f"MLflow experiment {experiment_name(name)}")


def analysis_metrics(analysis: Analysis) -> dict[str, float]:
    """Every number of an analysis as MLflow metrics (`<metric>.<field>`)."""
    out: dict[str, float] = {
        "srm_p_value": analysis.srm_p_value,
        "days": float(analysis.days),
        "decision_winner_is_treatment": float(analysis.decision.winner == analysis.treatment),
        **{f"users.{v}": float(n) for v, n in analysis.users.items()},
    }
    fields = ("control", "treatment", "diff", "ci_low", "ci_high", "p_value", "rel", "rel_low",
              "rel_high", "seq_low", "seq_high", "seq_p_value", "mde")  # fmt: skip
    for name, result in analysis.metrics.items():
        out.update({f"{name}.{f}": float(getattr(result, f)) for f in fields})
    return out


def log_analysis(
    client: MlflowClient,
    experiment_id: str,
    analysis: Analysis,
    definition: ExperimentDefinition,
    artifacts: list[Path],
    extra_tags: dict[str, str] | None = None,
) -> str:
    """One run for this analysis: tags (models, decision, SRM), metrics, chart and JSON."""
    decision = analysis.decision
    tags = {
        "ab.experiment": analysis.experiment,
        "ab.primary_metric": analysis.primary,
        "ab.decision": decision.status,
        "ab.winner": decision.winner or "none",
        "ab.decision_line": decision.line(analysis.experiment)[:5000],
        "ab.srm": "mismatch" if decision.status == "srm" else "ok",
        "ab.last_day": analysis.last_day,
        "model_name": definition.model_name or "",
        **(extra_tags or {}),
    }
    for variant in (analysis.control, analysis.treatment):
        tags[f"ab.model.{variant}"] = definition.variants[variant]
        tags[f"ab.version.{variant}"] = definition.versions.get(variant, "unknown")
    run = client.create_run(experiment_id, tags=tags, run_name=f"analysis-{analysis.last_day}")
    run_id = run.info.run_id
    try:
        stamp = run.info.start_time
        metrics = [
            Metric(k, v, stamp, 0) for k, v in analysis_metrics(analysis).items()
            if math.isfinite(v)
        ]  # fmt: skip
        client.log_batch(run_id, metrics=metrics)
        for artifact in artifacts:
            client.log_artifact(run_id, str(artifact))
    except Exception:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    return run_id


def promote_winner(
    client: MlflowClient, analysis: Analysis, definition: ExperimentDefinition, run_id: str
) -> str | None:
    """Point `champion` at the winner's version when the decision names one; else None."""
    winner = analysis.decision.winner
    if winner is None:
        client.set_tag(run_id, "ab.promoted", "false")
        return None
    name = definition.model_name
    version = definition.versions.get(winner)
    if not name or version is None:
        raise ConfigError(
            f"experiment {definition.name}: variant {winner!r} has no registered model version "
            f"(model {definition.variants[winner]!r}); record the experiment with "
            "`recsys ab assign` while its aliases are set, or give versions in the definition"
        )
    current = registry.alias_version(client, name, registry.CHAMPION)
    if current is None or str(current.version) != str(version):
        registry.set_alias(client, name, registry.CHAMPION, version)
    client.set_tag(run_id, "ab.promoted", "true")
    client.set_tag(run_id, "ab.promoted_version", str(version))
    return str(version)
