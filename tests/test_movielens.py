"""The whole pipeline on real MovieLens 100K: the model must beat popularity (same protocol)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from conductor import stages
from recsys.core.config import load_config
from recsys.core.layout import Workdir

pytestmark = [pytest.mark.slow, pytest.mark.movielens]


def test_movielens_100k_beats_popularity(ml100k: Path, tmp_path: Path) -> None:
    config = load_config(Path(__file__).resolve().parent.parent / "configs/movielens-100k.yaml")
    workdir = Workdir(tmp_path)
    date = dt.date(1998, 4, 30)  # after the last rating in u.data
    data_dir, stats = stages.preprocess(config, workdir, date, str(ml100k / "u.data"))
    assert stats["input_rows"] == 100_000 and stats["rejected"] == 0
    assert stats["splits"]["test"] == 943
    run_dir, _ = stages.train(config, workdir, date, data_dir)
    _, report = stages.evaluate(config, workdir, date, run_dir.name)
    model, popularity = report.model, report.baselines["popularity"]
    assert model["eval_users"] == popularity["eval_users"] == 943
    assert model["recall_at_100"] > popularity["recall_at_100"]
