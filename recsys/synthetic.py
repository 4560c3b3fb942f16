"""The embedded default data: a deterministic synthetic interaction log.

Users and items get latent taste vectors u, v ~ N(0, I/sqrt(d)); item popularity follows a
power law p_j ~ 1/rank^a. A user's interactions are drawn without replacement with
probability proportional to `p_j * exp(strength * u . v_j)`, so both popularity and taste
carry signal and a personalised model can beat the popularity baseline measurably.
Timestamps are spread over `days` days, each user's in increasing order.

The item side file gives every item 1-3 of 18 genres, the genre directions its latent vector
points to most (so genres carry the same signal as the ids), and a title "Item <n>".
"""

from __future__ import annotations

import csv
import datetime as dt
from pathlib import Path

import numpy as np

from recsys.core.config import SyntheticConfig

HEADER = ("user_id", "item_id", "timestamp", "weight")
ITEM_HEADER = ("item_id", "title", "genres")
GENRES = (
    "Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
    "War", "Western",
)  # fmt: skip
GENRE_SEPARATOR = "|"


def _latent(config: SyntheticConfig) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(config.seed)
    d = config.latent_dim
    users = rng.normal(0, 1 / np.sqrt(d), (config.num_users, d))
    items = rng.normal(0, 1 / np.sqrt(d), (config.num_items, d))
    return rng, users, items


def item_features(config: SyntheticConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """(item_id, title, genres) per item: 1-3 genres its latent vector points to most."""
    _, _, items = _latent(config)
    # A separate generator: the interaction log must not change when this function changes.
    rng = np.random.default_rng([config.seed, 1])
    directions = rng.normal(size=(config.latent_dim, len(GENRES)))
    scores = items @ directions
    how_many = rng.integers(1, 4, size=config.num_items)
    rows = []
    for j in range(config.num_items):
        top = np.argsort(-scores[j])[: how_many[j]]
        rows.append((f"i{j}", f"Item {j}", tuple(GENRES[g] for g in sorted(top))))
    return rows


def items_path(log_path: Path) -> Path:
    """Where the item side file of a synthetic log lives: next to it, `.<stem>.items.csv`.

    The leading dot keeps it out of the log's inputs when the folder itself is the input
    (beam_jobs.inputs skips dot files) and out of tools that expect one log per folder.
    """
    return log_path.with_name(f".{log_path.stem}.items.csv")


def write_items_csv(config: SyntheticConfig, path: Path) -> Path:
    """Write the item side file: item_id,title,genres (genres separated by '|')."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(ITEM_HEADER)
        writer.writerows(
            (item, title, GENRE_SEPARATOR.join(genres))
            for item, title, genres in item_features(config)
        )
    tmp.replace(path)
    return path


def generate(config: SyntheticConfig) -> list[tuple[str, str, int, float]]:
    """Rows (user_id, item_id, timestamp seconds, weight) in user then time order."""
    rng, users, items = _latent(config)
    d = config.latent_dim
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
