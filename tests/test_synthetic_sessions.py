"""The vectorised `sessions` generator: deterministic, and the shape it promises."""

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recsys import synthetic
from recsys.core.config import SyntheticConfig

CONFIG = SyntheticConfig(
    shape="sessions", num_users=3000, num_items=600, mean_interactions_per_user=12
)


def _table(config: SyntheticConfig, path: Path) -> pa.Table:
    synthetic.write_csv(config, path)
    return pacsv.read_csv(path)


def test_same_config_same_bytes_and_blocks_are_independent(tmp_path, monkeypatch):
    first = synthetic.write_csv(CONFIG, tmp_path / "a.csv").read_bytes()
    assert synthetic.write_csv(CONFIG, tmp_path / "b.csv").read_bytes() == first
    assert first.startswith(b"user_id,item_id,timestamp,weight\n")
    # Each block draws from its own (seed, block) stream: the block size is part of the
    # output's definition (smaller blocks give other, equally valid draws).
    monkeypatch.setattr(synthetic, "BLOCK_USERS", 1000)
    again = synthetic.write_csv(CONFIG, tmp_path / "c.csv").read_bytes()
    assert hashlib.sha256(again).digest() != hashlib.sha256(first).digest()
    assert synthetic.write_csv(CONFIG, tmp_path / "d.csv").read_bytes() == again


def test_shape_power_law_sessions_in_order(tmp_path):
    table = _table(CONFIG, tmp_path / "log.csv")
    users = table["user_id"].to_numpy(zero_copy_only=False)
    items = np.array([int(i[1:]) for i in table["item_id"].to_pylist()])
    stamps = table["timestamp"].to_numpy()
    assert 10 * CONFIG.num_users <= len(table) <= 14 * CONFIG.num_users
    same = users[1:] == users[:-1]
    assert (stamps[1:][same] > stamps[:-1][same]).all()  # user then strictly later
    assert set(table["weight"].to_pylist()) <= {1, 2, 3, 4, 5}
    # Power law: the 1% most popular items take far more than 1% of the rows.
    counts = np.sort(np.bincount(items, minlength=CONFIG.num_items))[::-1]
    assert counts[: CONFIG.num_items // 100].sum() > 0.08 * len(items)
    # Order: within a session (rows < 2 minutes apart), the next item is the topic
    # successor of the previous one about `sequential_probability` of the time.
    _, _, latent = synthetic._latent(CONFIG)
    successor = synthetic._topics(CONFIG, latent).successor
    in_session = same & (stamps[1:] - stamps[:-1] <= 120)
    follows = successor[items[:-1][in_session]] == items[1:][in_session]
    assert 0.5 < follows.mean() < 0.8
    # Sessions start with probability 1/mean_session_length: about 5 rows each.
    starts = (~in_session).sum() + 1
    assert 3.5 < len(items) / starts < 6.5


def test_default_shape_is_the_original_taste_log(tmp_path):
    small = SyntheticConfig(num_users=20, num_items=30)
    rows = synthetic.generate(small)
    text = synthetic.write_csv(small, tmp_path / "t.csv").read_text().splitlines()
    assert small.shape == "taste"
    assert text[0] == "user_id,item_id,timestamp,weight"
    assert text[1] == ",".join(str(v) for v in rows[0])
