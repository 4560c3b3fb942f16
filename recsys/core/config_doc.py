"""docs/CONFIG.md, generated from the config's own definition (recsys.core.config, .auto).

    python -m recsys.core.config_doc docs/CONFIG.md     # rewrite it
    python -m recsys.core.config_doc                    # print it

A test regenerates it and fails when the file differs, so the reference cannot drift from
the code: a new setting needs a `Field(description=...)`, and its text lands here.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from recsys.core import auto
from recsys.core.config import RecsysConfig

COMMAND = "python -m recsys.core.config_doc docs/CONFIG.md"

_INTRO = f"""\
# Configuration reference

<!-- Generated from recsys/core/config.py and recsys/core/auto.py by `{COMMAND}`;
a test fails when this file is out of date. Edit the code, then rerun the command. -->

A recsys config is a YAML file; every key is checked, and an unknown key or a value out of
bounds is an error that names it. A config names only what differs from the defaults below.
The defaults are the settings the project is benchmarked with (the transformer query tower,
the softmax over the whole catalog up to {auto.FULL_SOFTMAX_MAX_ITEMS:,} items, early stopping,
a refit on every split), so a minimal config, `RecsysConfig()` in Python and a run without
`--config` all train that model. The shipped `configs/*.yaml` set only their data.

A setting's value comes from, in order: its `default`; the `file` (the YAML, or the
`RecsysConfig` given in Python); an `override` (`--set KEY=VALUE` on the command line, or a
trial of `recsys tune`); the `dense_log` rule; an `auto` rule (below), decided from the data
or on the training machine. `recsys config show --config C [--data D]` prints every setting
with its value and where it came from (without `--data`, an `auto` setting is shown with its
rule); each run folder keeps the same record as `resolved_config.yaml`, and MLflow logs the
values as the run's params (with `written.<key>` for a value `auto` or `dense_log` replaced).
"""


def render() -> str:
    """The whole of docs/CONFIG.md."""
    parts = [_INTRO, _auto_section()]
    for name, model, optional in sections("", RecsysConfig, False):
        parts.append(_section(name, model, optional))
    return "\n".join(parts)


def _auto_section() -> str:
    rows = [f"| `{r.key}` | {r.when} | {_cell(r.rule)} |" for r in auto.RULES]
    return "\n".join(
        [
            "## `auto` settings",
            "",
            "Settings whose value `auto` is decided when the run trains; the run records the",
            "decision and its inputs (e.g. `full: 1682 items <= 50000`).",
            "",
            "| setting | decided | rule |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def sections(
    prefix: str, model: type[BaseModel], optional: bool
) -> Iterator[tuple[str, type[BaseModel], bool]]:
    """Each settings class under `model` (itself first), with its dotted name."""
    yield prefix, model, optional
    for name, field in model.model_fields.items():
        inner, is_optional = _nested(field.annotation)
        if inner is not None:
            key = f"{prefix}{name}" + (".<key>" if _mapped(field.annotation) else "")
            yield from sections(f"{key}.", inner, is_optional)


def _nested(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The settings class a field holds (directly, optionally, or as mapping values)."""
    mapped = _mapped(annotation)
    if mapped is not None:
        return mapped, False
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = len(args) < len(typing.get_args(annotation))
    candidates = args if _is_union(annotation) else [annotation]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, optional
    return None, False


def _mapped(annotation: Any) -> type[BaseModel] | None:
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value
    return None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _section(prefix: str, model: type[BaseModel], optional: bool) -> str:
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    doc = " ".join((model.__doc__ or "").split())
    if optional:
        doc += " Absent (null) by default; give the section to use it."
    rows = [
        f"| `{prefix}{name}` | {_type(field)} | {_default(field)} | {_cell(field.description)} |"
        for name, field in model.model_fields.items()
        if _nested(field.annotation)[0] is None or _mapped(field.annotation) is not None
    ]
    table = ["| setting | type | default | description |", "|---|---|---|---|", *rows]
    return "\n".join([f"## {title}", "", doc, "", *(table if rows else []), ""])


def _type(field: FieldInfo) -> str:
    text = _annotation(field.annotation)
    bounds = _bounds(field.metadata)
    return f"{text}, {bounds}" if bounds else text


def _annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        inner = _annotation(args[0])
        bounds = _bounds(args[1].metadata) if isinstance(args[1], FieldInfo) else ""
        return f"{inner} ({bounds})" if bounds else inner
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if _is_union(annotation):
        return " or ".join("null" if a is type(None) else _annotation(a) for a in args)
    if origin is list:
        item = _annotation(args[0])
        return f"list of ({item})" if _is_union(args[0]) else f"list of {item}"
    if origin is dict:
        return f"mapping of {_annotation(args[0])} to {_annotation(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "settings (below)"
    names = {str: "text", int: "int", float: "number", bool: "bool"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


_BOUNDS = (
    ("ge", ">="),
    ("gt", ">"),
    ("le", "<="),
    ("lt", "<"),
    ("min_length", "length >="),
    ("max_length", "length <="),
)


def _bounds(metadata: list[Any]) -> str:
    found = []
    for item in metadata:  # pydantic's constraint objects: one attribute each
        for attr, sign in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} {_yaml(value)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            found.append(f"matching `{pattern}`")
    return ", ".join(found).replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, dict):
        value = {
            k: v.model_dump(exclude_defaults=True) if isinstance(v, BaseModel) else v
            for k, v in value.items()
        }
    return f"`{_yaml(value)}`".replace("|", "\\|")


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else str(value)


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def main(argv: list[str]) -> int:
    """Write docs/CONFIG.md to the path given, or print it."""
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
