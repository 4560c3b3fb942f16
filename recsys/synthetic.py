"""The embedded default data: a deterministic synthetic interaction log.

Users and items get latent taste vectors u, v ~ N(0, I/sqrt(d)); item popularity follows a
power law p_j ~ 1/rank^a. A user's interactions are drawn without replacement with
probability proportional to `p_j * exp(strength * u . v_j)`, so both popularity and taste
carry signal and a personalised model can beat the popularity baseline measurably.
Timestamps are spread over `days` days, each user's in increasing order.
"""

from __future__ import annotations

import csv
import datetime as dt
from pathlib import Path

import numpy as np

from recsys.config import SyntheticConfig

HEADER = ("user_id", "item_id", "timestamp", "weight")


def generate(config: SyntheticConfig) -> list[tuple[str, str, int, float]]:
    """Rows (user_id, item_id, timestamp seconds, weight) in user then time order."""
    rng = np.random.default_rng(config.seed)
    d = config.latent_dim
    users = rng.normal(0, 1 / np.sqrt(d), (config.num_users, d))
    items = rng.normal(0, 1 / np.sqrt(d), (config.num_items, d))
    log_pop = -config.popularity_exponent * np.log(np.arange(1, config.num_items + 1))
    rng.shuffle(log_pop)
    start = int(dt.datetime.fromisoformat(config.start_date).replace(tzinfo=dt.UTC).timestamp())
    span = config.days * 86400
    counts = np.clip(
        rng.geometric(1 / config.mean_interactions_per_user, config.num_users),
        3,
        config.num_items // 2,
    )
    rows: list[tuple[str, str, int, float]] = []
    for u in range(config.num_users):
        logits = log_pop + config.taste_strength * np.sqrt(d) * (items @ users[u])
        # Gumbel top-k = sampling without replacement proportional to exp(logits).
        keys = logits + rng.gumbel(size=config.num_items)
        chosen = np.argsort(-keys)[: counts[u]]
        times = np.sort(rng.integers(start, start + span, size=len(chosen)))
        rating = np.clip(np.round(3 + 2 * np.tanh(items[chosen] @ users[u] * np.sqrt(d))), 1, 5)
        rows.extend(
            (f"u{u}", f"i{j}", int(t), float(r))
            for j, t, r in zip(chosen, times, rating, strict=True)
        )
    return rows


def write_csv(config: SyntheticConfig, path: Path) -> Path:
    """Write the synthetic log as a CSV with a header (the same reader as real CSV input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        writer.writerows(generate(config))
    tmp.replace(path)
    return path
