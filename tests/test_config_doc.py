"""docs/CONFIG.md is generated from the config's definition and must match the code."""

from __future__ import annotations

from recsys.core.config import RecsysConfig
from recsys.core.config_doc import COMMAND, render, sections
from tests.conftest import REPO


def test_every_setting_is_described() -> None:
    missing = [
        f"{prefix}{name}"
        for prefix, model, _ in sections("", RecsysConfig, False)
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not missing, f"settings without Field(description=...): {missing}"


def test_config_reference_is_current() -> None:
    written = (REPO / "docs" / "CONFIG.md").read_text()
    assert written == render(), (
        f"docs/CONFIG.md is out of date with recsys/core/config.py: run `{COMMAND}` "
        "(with the project's .venv/bin/python) and commit the result"
    )


def test_the_reference_lists_every_setting_and_auto_rule() -> None:
    text = render()
    for key in RecsysConfig().flat():
        if not key.startswith(("gate.guardrails.", "dense_log")):
            assert f"`{key}`" in text, key
    assert "| `model.negatives` |" in text and "at most 50,000 items" in text
