"""The whole pipeline on real MovieLens 100K: the model must beat popularity (same protocol)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from conductor import stages
from recsys.core.config import load_config, set_values
from recsys.core.layout import Workdir

pytestmark = [pytest.mark.slow, pytest.mark.movielens]


@pytest.mark.timeout(1800)  # a few minutes alone; more on a machine shared with benchmarks
def test_movielens_100k_beats_popularity(ml100k: Path, tmp_path: Path) -> None:
    shipped = load_config(Path(__file__).resolve().parent.parent / "configs/movielens-100k.yaml")
    # One epoch (and a one-epoch refit) of the shipped settings keeps this within CI's budget:
    # the log is dense, so its dense_log rule applies, at about 5x the cost per epoch. The
    # full run's figures are in docs/BENCHMARKS.md.
    config = set_values(shipped, {"training.epochs": 1})
    workdir = Workdir(tmp_path)
    date = dt.date(1998, 4, 30)  # after the last rating in u.data
    data_dir, stats = stages.preprocess(config, workdir, date, str(ml100k / "u.data"))
    assert stats["input_rows"] == 100_000 and stats["rejected"] == 0
    assert stats["splits"]["test"] == 943
    run_dir, _ = stages.train(config, workdir, date, data_dir)
    assert config.dense_log is not None
    train = json.loads((run_dir / "train.json").read_text())
    assert train["dense_log_settings"] == config.dense_log.settings
    _, report = stages.evaluate(config, workdir, date, run_dir.name)
    model, popularity = report["model"], report["baselines"]["popularity"]
    assert model["eval_users"] == popularity["eval_users"] == 943
    assert model["recall_at_100"] > popularity["recall_at_100"]
