"""What serving and the working directory say about the registry: derived from it, never edited.

The MLflow registry's aliases are the truth: `champion` (the served version) and `challenger`
(the newest candidate). Two local records follow them:

- `export/models.config`: TF Serving's labels `champion` / `challenger` -> the export version
  behind each aliased registered version (its run's `model_version` tag);
- `champion.json`: the champion's registered version, run folder, data folder, export version
  and date, which retention reads even while the tracking server is down.

`sync_serving` derives both from the aliases and rewrites whichever differs (atomically). The
nightly (after publishing, and at the end of every night), `recsys ab analyze --promote` and
`recsys repair` all call it, so no command moves an alias without moving serving with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mlflow import MlflowClient

from recsys.core.layout import Workdir
from recsys.core.records import ChampionRecord, RecordError, read_champion, write_record
from recsys.tracking import registry
from serving_export.serving_config import LABELS, read_version_labels, set_version_labels

log = logging.getLogger(__name__)

MODEL_VERSION_TAG = "model_version"
"""The run tag naming a registered version's export folder (`export/<model>/<N>`)."""


@dataclass
class ServingState:
    """What the aliases say serving must be: labels, the champion record, and what cannot be."""

    labels: dict[str, int]
    champion: ChampionRecord | None
    problems: list[str] = field(default_factory=list)


def derive_serving_state(client: MlflowClient, model_name: str) -> ServingState:
    """The labels of models.config and the record of champion.json, as the aliases imply."""
    labels: dict[str, int] = {}
    champion: ChampionRecord | None = None
    problems: list[str] = []
    for alias in LABELS:
        version = registry.alias_version(client, model_name, alias)
        if version is None:
            continue
        tags = client.get_run(version.run_id).data.tags if version.run_id else {}
        export = tags.get(MODEL_VERSION_TAG, "")
        if export.isdigit():
            labels[alias] = int(export)
        else:
            problems.append(
                f"{alias} is registered version {version.version}, whose run has no export "
                f"version (tag {MODEL_VERSION_TAG}): TF Serving gets no `{alias}` label"
            )
        if alias == registry.CHAMPION:
            champion = ChampionRecord(
                model_name=model_name,
                registered_version=str(version.version),
                run_dir=tags.get("run_dir"),
                data_dir=tags.get("data_dir"),
                export_version=export or None,
                run_date=tags.get("run_date"),
            )
    return ServingState(labels, champion, problems)


def serving_drift(state: ServingState, workdir: Workdir) -> list[str]:
    """How models.config and champion.json differ from `state` ([] when they agree)."""
    drift = []
    written = read_version_labels(workdir.export_root())
    if _exported_models(workdir) and written != state.labels:
        drift.append(f"models.config labels {written}, the registry's aliases say {state.labels}")
    try:
        recorded = champion_record(workdir)
    except RecordError as exc:  # a derived cache: the sync rewrites it, never stops on it
        return [*drift, f"champion.json cannot be read ({exc})"]
    if recorded != state.champion:
        was = recorded.registered_version if recorded else "none"
        now = state.champion.registered_version if state.champion else "none"
        drift.append(
            f"champion.json says champion version {was}, the registry says {now}"
            if was != now
            else f"champion.json differs from the champion's run tags ({recorded})"
        )
    return drift


def write_serving_state(state: ServingState, workdir: Workdir, base_path: str | None) -> list[str]:
    """Rewrite models.config and champion.json to `state`; returns what changed, and why not.

    A label whose export version is not on disk for every model stays out of models.config
    (TF Serving would refuse the whole file); that is added to `state.problems`. A registry
    with no `champion` at all (a store that was emptied, a wrong tracking URI) changes
    nothing: serving keeps what it has, and the problem says why.
    """
    if state.champion is None:
        if workdir.champion_file().is_file() or read_version_labels(workdir.export_root()):
            state.problems.append(
                "the registry names no champion: models.config and champion.json are left as "
                "they are (check tracking.uri, or set the alias: recsys repair then follows it)"
            )
        return []
    changed = serving_drift(state, workdir)
    state.problems += _missing_exports(state, workdir)
    if _exported_models(workdir):
        base = workdir.serving_base(base_path)  # a workdir in a bucket: its export/ URI
        set_version_labels(workdir.export_root(), state.labels, base)
    elif state.labels:
        state.problems.append(
            f"no exported model under {workdir.export_root()}: models.config was not written "
            "(run this with the --workdir the nightly exports to)"
        )
    _write_champion(workdir, state.champion)
    for line in changed:
        log.info("serving state: %s: rewritten from the registry", line)
    return changed


def sync_serving(
    client: MlflowClient, model_name: str, workdir: Workdir, base_path: str | None
) -> ServingState:
    """Serving derived from the aliases and written: how models.config and champion.json change."""
    state = derive_serving_state(client, model_name)
    write_serving_state(state, workdir, base_path)
    for problem in state.problems:
        log.warning("serving state: %s", problem)
    return state


def champion_record(workdir: Workdir) -> ChampionRecord | None:
    """The cached champion record (None if no champion was ever recorded here)."""
    return read_champion(workdir.champion_file())


def _write_champion(workdir: Workdir, record: ChampionRecord) -> None:
    path = workdir.champion_file()
    # Compared as text, so a file in an earlier release's shape is rewritten in today's.
    if (
        path.is_file()
        and path.read_text(encoding="utf-8") == record.model_dump_json(indent=2) + "\n"
    ):
        return
    write_record(path, record)


def _exported_models(workdir: Workdir) -> list[str]:
    root = workdir.export_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _missing_exports(state: ServingState, workdir: Workdir) -> list[str]:
    models = _exported_models(workdir)
    problems = []
    for alias, version in sorted(state.labels.items()):
        missing = [m for m in models if not (workdir.export(m) / str(version)).is_dir()]
        if missing:
            problems.append(
                f"{alias}: export version {version} is missing under {workdir.export_root()} "
                f"({', '.join(missing)}), so TF Serving gets no `{alias}` label; re-export it "
                "with the `recsys export --date D --run-id R` of its run (tag run_dir)"
            )
    return problems
