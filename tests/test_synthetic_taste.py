"""The taste shape of the embedded generator: the default data unchanged, large logs in blocks.

Up to TASTE_LOOP_LIMIT users x items the reference per-user loop writes the log (the default
data's exact bytes, which tests and benchmarks rely on); above it, blocks of users are drawn
at once from the same model, with progress lines.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from recsys import synthetic
from recsys.core.config import SyntheticConfig, load_config

# sha256 of configs/default.yaml's synthetic log as the per-user loop has always written it.
DEFAULT_SHA256 = "75d4f0ea107b3e11fcee6d6881d11fbb673e3a7e78cb8d49c61c06afb2fa6324"


def test_the_default_data_is_byte_identical(tmp_path: Path) -> None:
    config = load_config(None).data.synthetic
    written = synthetic.write_csv(config, tmp_path / "default.csv")
    assert hashlib.sha256(written.read_bytes()).hexdigest() == DEFAULT_SHA256


def _frame(rows: list[tuple[str, str, int, float]] | pa.Table) -> pd.DataFrame:
    if isinstance(rows, pa.Table):
        return rows.to_pandas()
    return pd.DataFrame(rows, columns=list(synthetic.HEADER))


def _item_counts(frame: pd.DataFrame, items: int) -> np.ndarray:
    return np.bincount(frame["item_id"].str[1:].astype(int), minlength=items)


def test_blocks_draw_from_the_same_model_as_the_reference_loop() -> None:
    config = load_config(None).data.synthetic.model_copy(
        update={"num_users": 3000, "num_items": 400}
    )
    reference = _frame(synthetic.generate(config))
    blocks = _frame(pa.concat_tables(synthetic.generate_taste_blocks(config)))
    # The same users with the same number of interactions each (drawn the same way).
    pd.testing.assert_series_equal(
        reference.groupby("user_id").size(), blocks.groupby("user_id").size()
    )
    assert not blocks.duplicated(["user_id", "item_id"]).any()
    # The same law: how often each item is drawn, and which item comes first (draw order).
    assert np.corrcoef(_item_counts(reference, 400), _item_counts(blocks, 400))[0, 1] > 0.99
    firsts = [f.sort_values("timestamp", kind="stable").groupby("user_id").head(1)
              for f in (reference, blocks)]  # fmt: skip
    assert np.corrcoef(*(_item_counts(f, 400) for f in firsts))[0, 1] > 0.9
    assert abs(reference["weight"].mean() - blocks["weight"].mean()) < 0.02
    # Each user's times ascend within the log's days.
    assert blocks.groupby("user_id")["timestamp"].apply(lambda t: t.is_monotonic_increasing).all()
    assert blocks["timestamp"].between(reference["timestamp"].min() - 86400,
                                       reference["timestamp"].max() + 86400).all()  # fmt: skip


def test_a_large_taste_log_is_written_in_blocks_with_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = SyntheticConfig(num_users=2000, num_items=12_000, item_features=False)
    assert config.num_users * config.num_items > synthetic.TASTE_LOOP_LIMIT
    with caplog.at_level(logging.INFO, logger="recsys.synthetic"):
        first = synthetic.write_csv(config, tmp_path / "a.csv").read_bytes()
    assert "synthetic log: 2,000 of 2,000 users (100%)" in caplog.text
    frame = pd.read_csv(tmp_path / "a.csv")
    assert list(frame.columns) == list(synthetic.HEADER) and frame["user_id"].nunique() == 2000
    assert synthetic.write_csv(config, tmp_path / "b.csv").read_bytes() == first  # deterministic
