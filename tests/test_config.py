"""Config validation: clear errors for unknown keys and bad values; stable digests."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys.core.config import load_config, parse_config
from recsys.core.errors import ConfigError
from tests.conftest import REPO

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    assert load_config(path).model_name


def test_repo_configs_are_found() -> None:
    """The shipped configs are found (an empty glob would skip the test above)."""
    assert (CONFIGS / "default.yaml").is_file(), CONFIGS


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"training\.epoch: unknown key"):
        parse_config({"training": {"epoch": 3}})


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.embedding_dim"):
        parse_config({"model": {"embedding_dim": 0}})


def test_user_embedding_is_a_bool_or_auto() -> None:
    assert parse_config({"model": {"user_embedding": "auto"}}).model.user_embedding == "auto"
    assert parse_config({"model": {"user_embedding": False}}).model.user_embedding is False
    with pytest.raises(ConfigError, match=r"model\.user_embedding"):
        parse_config({"model": {"user_embedding": "sometimes"}})


def test_path_required_for_file_sources() -> None:
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        parse_config({"data": {"source": "csv"}})


def test_model_name_cannot_escape_paths() -> None:
    with pytest.raises(ConfigError, match="model_name"):
        parse_config({"model_name": "../etc"})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_digest_and_flat_params() -> None:
    a, b = parse_config({}), parse_config({"training": {"epochs": 3}})
    assert a.digest() == parse_config({}).digest() != b.digest()
    assert b.flat()["training.epochs"] == 3


def test_input_override_picks_reader() -> None:
    cfg = parse_config({})
    assert cfg.with_input("x/events.parquet").data.source == "parquet"
    assert cfg.with_input("x/events.csv").data.source == "csv"
    ml = parse_config({"data": {"source": "movielens-100k", "path": "a/u.data"}})
    assert ml.with_input("b/u.data").data.source == "movielens-100k"


def test_per_row_training_needs_stored_histories_as_long_as_each_models() -> None:
    # The default candidates read 50 items; the Beam job stores 20 with each row by default.
    with pytest.raises(ConfigError, match=r"candidates\[1\] model\.history_length 50 .*20"):
        parse_config({"training": {"input": "rows"}})
    with pytest.raises(ConfigError, match=r"^.*: model\.history_length 30 is longer"):
        parse_config(
            {"training": {"input": "rows", "candidates": []}, "model": {"history_length": 30}}
        )
    assert parse_config({"training": {"input": "rows"}, "preprocess": {"history_length": 50}})
    assert parse_config({"training": {"input": "rows", "candidates": []}})
    assert parse_config({"model": {"history_length": 30}})  # sequences read the whole sequence
