"""The settings a run trains with: every `auto` decided, and where each value came from.

One function, `resolve_config`, turns a config, the data's stats.json and the devices the
trainer found into the config that is trained, in this order: the config's own values
(`default`, `file`: set in the YAML or the RecsysConfig given, `override`: `--set` or a tuning
trial), then the `dense_log` rule, then the `auto` rules of recsys.core.auto. Without the data
or the devices, the settings they decide stay `auto` and carry their rule. The trainer calls
it once; `recsys config show` prints it; each run folder keeps it as resolved_config.yaml and
MLflow logs its values as the run's params.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from recsys.core import auto
from recsys.core.config import RecsysConfig, set_values
from recsys.core.redact import redact_value

Source = Literal["default", "file", "override", "dense_log", "auto"]
SOURCES: tuple[Source, ...] = ("default", "file", "override", "dense_log", "auto")
"""Where a value can come from, in the order they apply (a later one replaces an earlier)."""

WRITTEN_PARAM = "written."
"""MLflow param prefix of a setting's written value where dense_log or auto changed it."""


@dataclass(frozen=True)
class Setting:
    """One setting's value and its origin.

    `written` is the value before `dense_log` or an `auto` rule replaced it (None otherwise);
    `why` says what decided it: the rule's inputs ("1682 items <= 50000"), or for an `auto`
    not decided yet, the rule itself.
    """

    value: Any
    source: Source
    written: Any = None
    why: str = ""

    @property
    def changed(self) -> bool:
        """Whether dense_log or an auto rule replaced the written value."""
        return self.source in ("dense_log", "auto") and self.written != self.value

    def record(self, key: str) -> dict[str, Any]:
        """This setting as plain data without credentials (resolved_config.yaml, train.json)."""
        out: dict[str, Any] = {"value": redact_value(key, self.value, environ={})}
        out["source"] = self.source
        if self.source in ("dense_log", "auto"):
            out["written"] = redact_value(key, self.written, environ={})
        if self.why:
            out["why"] = self.why
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Setting:
        """The inverse of `record`."""
        return cls(record["value"], record["source"], record.get("written"), record.get("why", ""))


@dataclass(frozen=True)
class Resolved:
    """The config that is trained, every setting's origin, and what dense_log applied."""

    config: RecsysConfig
    settings: dict[str, Setting]
    dense_log_settings: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # one line per decision taken (for the training log)

    def records(self) -> dict[str, dict[str, Any]]:
        """Every setting as plain data (see Setting.record)."""
        return {key: setting.record(key) for key, setting in self.settings.items()}


def resolve_config(
    config: RecsysConfig,
    stats: Mapping[str, Any] | None = None,
    device: auto.DeviceFacts | None = None,
) -> Resolved:
    """`config` as trained on data of these `stats` on this `device`, with each value's origin.

    Pure: the same config, stats and device facts give the same result. Without `stats` the
    data rules (and `dense_log`) stay undecided, without `device` the device rules.
    """
    settings = {key: Setting(value, source) for key, (value, source) in _written(config).items()}
    dense: dict[str, Any] = {}
    notes: list[str] = []
    if stats is not None:
        shape = auto.DataShape.from_stats(stats)
        config, dense = _dense_log(config, shape, settings, notes)
        config = _decide(config, _data_choices(config, shape), settings, notes)
    if device is not None:
        config = _decide(config, _device_choices(config, device), settings, notes)
    for rule in auto.RULES:
        current = settings[rule.key]
        if current.value == "auto":
            why = f"auto, decided {rule.when}: {rule.rule}"
            settings[rule.key] = dataclasses.replace(current, why=why)
    return Resolved(config, settings, dense, tuple(notes))


def _written(config: RecsysConfig) -> dict[str, tuple[Any, Source]]:
    """Each dotted setting's value as configured and whether a default, the file or an override
    set it (pydantic's fields-set record of the parsed config; RecsysConfig.overrides)."""
    overrides = config.overrides
    out: dict[str, tuple[Any, Source]] = {}
    for key, value in config.flat().items():
        source: Source = "default"
        if any(key == o or key.startswith(f"{o}.") for o in overrides):
            source = "override"
        elif _given(config, key):
            source = "file"
        out[key] = (value, source)
    return out


def _given(config: BaseModel, key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, BaseModel):
            return True  # inside a mapping or list that was given whole
        if part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return True


def _dense_log(
    config: RecsysConfig,
    shape: auto.DataShape,
    settings: dict[str, Setting],
    notes: list[str],
) -> tuple[RecsysConfig, dict[str, Any]]:
    rule = config.dense_log
    if rule is None:
        return config, {}
    applies, why = auto.dense_log_applies(shape, rule.min_events_per_user)
    if not applies:
        notes.append(f"dense_log: {why}: not applied")
        return config, {}
    for key, value in rule.settings.items():
        before = settings[key]
        settings[key] = Setting(value, "dense_log", before.value, f"dense_log: {why}")
    notes.append(f"dense_log: {why}: " + ", ".join(f"{k}={v}" for k, v in rule.settings.items()))
    return set_values(config, rule.settings, override=False), dict(rule.settings)


def _data_choices(config: RecsysConfig, shape: auto.DataShape) -> dict[str, auto.Choice]:
    window = config.model.history_length
    return {
        "model.negatives": auto.negatives(shape),
        "model.user_embedding": auto.user_embedding(shape, window),
        "training.learning_rate_schedule": auto.learning_rate_schedule(shape, window),
    }


def _device_choices(config: RecsysConfig, device: auto.DeviceFacts) -> dict[str, auto.Choice]:
    return {
        "training.precision": auto.precision(device),
        "training.jit_compile": auto.jit_compile(device, config.training.input),
        "training.strategy": auto.strategy(device),
    }


def _decide(
    config: RecsysConfig,
    choices: dict[str, auto.Choice],
    settings: dict[str, Setting],
    notes: list[str],
) -> RecsysConfig:
    """`config` with each of `choices` that is still `auto` set to its chosen value."""
    for key, (value, inputs) in choices.items():
        section_name, name = key.split(".")
        section = getattr(config, section_name)
        if getattr(section, name) != "auto":
            continue
        settings[key] = Setting(value, "auto", "auto", f"{_text(value)}: {inputs}")
        notes.append(f"{key}: auto -> {_text(value)} ({inputs})")
        section = section.model_copy(update={name: value})
        config = config.model_copy(update={section_name: section})
    return config


def _text(value: Any) -> str:
    """A value as YAML and the CLI spell it (true, null, [10, 50])."""
    return value if isinstance(value, str) else json.dumps(value)


def format_settings(resolved: Resolved) -> str:
    """`recsys config show`: one line per setting, `key = value  # source: why`."""
    width = max(len(key) for key in resolved.settings)
    records = resolved.records()
    values = {key: _text(record["value"]) for key, record in records.items()}
    value_width = min(max(len(v) for v in values.values()), 24)
    lines = []
    for key, record in records.items():
        origin = record["source"]
        if origin == "dense_log" and record["written"] != record["value"]:
            origin += f" (written {_text(record['written'])})"
        if record.get("why"):
            origin += f": {record['why']}"
        lines.append(f"{key:<{width}} = {values[key]:<{value_width}}  # {origin}")
    return "\n".join([*lines, *(f"# {note}" for note in resolved.notes)])


_HEADER = (
    "# The settings this run trained with, one per line: the value, where it came from\n"
    "# (default | file | override | dense_log | auto) and, for dense_log and auto, the value\n"
    "# written in the config and why it was replaced (docs/CONFIG.md).\n"
)


def write_settings(path: Path, records: Mapping[str, Mapping[str, Any]]) -> None:
    """Write `Resolved.records()` as YAML, one flow mapping per setting (resolved_config.yaml)."""
    lines = [
        yaml.safe_dump({key: dict(record)}, default_flow_style=None, sort_keys=False, width=10**6)
        for key, record in records.items()
    ]
    path.write_text(_HEADER + "".join(lines))


def read_settings(path: Path) -> dict[str, Setting]:
    """The settings `write_settings` wrote."""
    raw = yaml.safe_load(path.read_text()) or {}
    return {key: Setting.from_record(record) for key, record in raw.items()}


def mlflow_params(settings: Mapping[str, Setting]) -> dict[str, Any]:
    """The run's params: each resolved value, plus `written.<key>` where it was replaced."""
    params = {key: setting.value for key, setting in settings.items()}
    for key, setting in settings.items():
        if setting.changed:
            params[f"{WRITTEN_PARAM}{key}"] = setting.written
    return params
