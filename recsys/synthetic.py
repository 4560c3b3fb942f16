"""The embedded default data: a deterministic synthetic interaction log.

Users and items get latent taste vectors u, v ~ N(0, I/sqrt(d)); item popularity follows a
power law p_j ~ 1/rank^a. A user's interactions are drawn without replacement with
probability proportional to `p_j * exp(strength * u . v_j)`, so both popularity and taste
carry signal and a personalised model can beat the popularity baseline measurably.
Timestamps are spread over `days` days, each user's in increasing order.

The item side file gives every item 1-3 of 18 genres, the genre directions its latent vector
points to most (so genres carry the same signal as the ids), and a title "Item <n>".

`shape: sessions` (`generate_sessions`) is vectorised for logs of millions of rows: the
per-user model above scores the whole catalog for every user (users x items work). Each item
belongs to the topic its latent vector points to most (of `topics` random directions); a
user's interactions come in sessions (a new one starts with probability
1/mean_session_length), each on one topic drawn with probability softmax(strength * z_u)
(z_u: the user's standardised topic affinities). A session's next item is, with probability
`sequential_probability`, the successor of the previous one in a fixed random order of its
topic's items (the sequence signal a sequence encoder can learn), else a fresh draw from the
topic, proportional to the power-law popularity. Sessions start uniformly over the days and
their items are 1-120 s apart; each user's timestamps strictly increase. Users are generated
in blocks of BLOCK_USERS, each block from its own seeded stream: the output does not depend
on memory or on how it is written.

The taste shape above draws from the whole catalog for every user (users x items work): up to
TASTE_LOOP_LIMIT cells it runs user by user (`generate`, whose random stream is the default
data), above it in blocks of users at once (`generate_taste_blocks`: the same model, drawn
by successive sampling from each block's scores, two-level over chunks of items, a seeded
stream per block). Both large generators log their progress (users, rows, ETA).
"""

from __future__ import annotations

import csv
import datetime as dt
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from threadpoolctl import threadpool_limits

from recsys.core.config import SyntheticConfig

HEADER = ("user_id", "item_id", "timestamp", "weight")
ITEM_HEADER = ("item_id", "title", "genres")
GENRES = (
    "Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
    "War", "Western",
)  # fmt: skip
GENRE_SEPARATOR = "|"

log = logging.getLogger(__name__)


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


def _taste_setup(
    config: SyntheticConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Item log-popularity, interactions per user, first second and span of the log."""
    log_pop = -config.popularity_exponent * np.log(np.arange(1, config.num_items + 1))
    rng.shuffle(log_pop)
    start = int(dt.datetime.fromisoformat(config.start_date).replace(tzinfo=dt.UTC).timestamp())
    counts = np.clip(
        rng.geometric(1 / config.mean_interactions_per_user, config.num_users),
        3,
        config.num_items // 2,
    )
    return log_pop, counts, start, config.days * 86400


def generate(config: SyntheticConfig) -> list[tuple[str, str, int, float]]:
    """Rows (user_id, item_id, timestamp seconds, weight) in user then time order.

    The reference sampler (one user at a time: a Gumbel top-k over the whole catalog): its
    random stream defines the default data. `generate_taste_blocks` draws from the same model
    for large logs.
    """
    rng, users, items = _latent(config)
    d = config.latent_dim
    log_pop, counts, start, span = _taste_setup(config, rng)
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


TASTE_LOOP_LIMIT = 20_000_000
"""Users x items up to which the taste shape uses `generate` (a few seconds; the default data
is 2,000 x 1,000); above it, `generate_taste_blocks`: the same model, vectorised."""


def write_csv(config: SyntheticConfig, path: Path) -> Path:
    """Write the synthetic log as a CSV with a header (the same reader as real CSV input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    if config.shape == "sessions":
        _write_table_csv(generate_sessions(config), tmp)
    elif config.num_users * config.num_items > TASTE_LOOP_LIMIT:
        _write_table_csv(generate_taste_blocks(config), tmp)
    else:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(HEADER)
            writer.writerows(generate(config))
    tmp.replace(path)
    return path


TASTE_BLOCK_CELLS = 1 << 22
"""Users x items per block of `generate_taste_blocks` (32 MB of float64 scores): a block holds
max(1, TASTE_BLOCK_CELLS // num_items) users (part of its output's definition)."""
_REJECTION_ROUNDS = 8  # then a user's remaining items come from one Gumbel top-k


class _Progress:
    """Log lines while a large log is generated: users and rows so far, rate, ETA."""

    def __init__(self, users: int, every_seconds: float = 5.0) -> None:
        self.users, self.every = users, every_seconds
        self.started = self.last = time.monotonic()
        self.rows = 0

    def update(self, users_done: int, rows: int) -> None:
        """Count a finished block; log at most every `every` seconds, and at the end."""
        self.rows += rows
        now = time.monotonic()
        if now - self.last < self.every and users_done < self.users:
            return
        self.last, elapsed = now, now - self.started
        eta = elapsed / max(users_done, 1) * (self.users - users_done)
        log.info(
            "synthetic log: %s of %s users (%d%%), %s rows, %.0f s elapsed%s",
            f"{users_done:,}", f"{self.users:,}", 100 * users_done // max(self.users, 1),
            f"{self.rows:,}", elapsed, f", ETA {eta:.0f} s" if users_done < self.users else "",
        )  # fmt: skip


def generate_taste_blocks(config: SyntheticConfig) -> Iterator[pa.Table]:
    """The taste shape for large logs: tables of a block of users each, in user then time order.

    The same model as `generate` (latent vectors, popularity, counts and timestamps drawn the
    same way): each user's items are drawn without replacement with probability proportional
    to `p_j * exp(strength * sqrt(d) * u . v_j)`, in draw order, by successive sampling (a
    repeat is drawn again) from the scores of a block of users at once; a user still short
    after a few rounds takes the rest from one Gumbel top-k over the items not yet drawn. Each
    block has its own seeded stream, so the output does not depend on memory or threads.
    """
    rng, users, items = _latent(config)
    log_pop, counts, start, span = _taste_setup(config, rng)
    d = config.latent_dim
    # Items padded to whole chunks (weight 0: log-popularity -inf) for the two-level draw.
    chunk = _chunk_size(config.num_items)
    padded = -(-config.num_items // chunk) * chunk
    scaled = np.zeros((d, padded))
    scaled[:, : config.num_items] = config.taste_strength * np.sqrt(d) * items.T
    log_pop = np.concatenate([log_pop, np.full(padded - config.num_items, -np.inf)])
    per_block = max(1, TASTE_BLOCK_CELLS // padded)
    progress = _Progress(config.num_users)
    # One BLAS thread: a (users x d) @ (d x items) product per block is too small to share.
    with threadpool_limits(1):
        for block, first in enumerate(range(0, config.num_users, per_block)):
            rng = np.random.default_rng([config.seed, 5, block])
            ids = np.arange(first, min(first + per_block, config.num_users))
            logits = users[ids] @ scaled
            logits += log_pop
            user, item = _successive_draws(logits, chunk, counts[ids], config.num_items, rng)
            yield _taste_table(config, users, items, ids[user], item, start, span, rng)
            progress.update(int(ids[-1]) + 1, len(item))


def _taste_table(
    config: SyntheticConfig,
    users: np.ndarray,
    items: np.ndarray,
    user: np.ndarray,
    item: np.ndarray,
    start: int,
    span: int,
    rng: np.random.Generator,
) -> pa.Table:
    """Rows of drawn (user, item) pairs: each user's times ascending in draw order, ratings."""
    stamp = rng.integers(start, start + span, size=len(user))
    stamp = stamp[np.lexsort((stamp, user))]
    return _rows_table(config, users, items, user, item, stamp)


def _rows_table(
    config: SyntheticConfig,
    users: np.ndarray,
    items: np.ndarray,
    user: np.ndarray,
    item: np.ndarray,
    stamp: np.ndarray,
) -> pa.Table:
    """The log's columns for (user, item, time) rows; the rating follows the pair's taste."""
    taste = np.einsum("ij,ij->i", users[user], items[item]) * np.sqrt(config.latent_dim)
    rating = np.clip(np.round(3 + 2 * np.tanh(taste)), 1, 5)
    return pa.table(
        {
            "user_id": _prefixed("u", user),
            "item_id": _prefixed("i", item),
            "timestamp": pa.array(stamp, pa.int64()),
            "weight": pa.array(rating, pa.float64()),
        }
    )


def _chunk_size(n_items: int) -> int:
    """Items per chunk of the two-level draw: the power of two nearest sqrt(n_items)."""
    return 1 << max(0, round(np.log2(n_items) / 2))


def _successive_draws(
    logits: np.ndarray, chunk: int, counts: np.ndarray, n_items: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(row, item) pairs: `counts[r]` distinct items per row r, drawn in order with
    probability proportional to exp(logits[r]) among the items not drawn yet.

    A draw picks a chunk of `chunk` items by the chunks' sums, then an item inside it: no
    cumulative sum over the whole catalog (the slow part of a plain inverse-CDF draw).
    """
    rows = len(logits)
    logits -= logits.max(axis=1, keepdims=True)
    weights = np.exp(logits).reshape(rows, -1, chunk)
    chunk_cdf = np.cumsum(weights.sum(axis=2), axis=1)
    taken_rows: list[np.ndarray] = []
    taken_items: list[np.ndarray] = []
    need = counts.astype(np.int64).copy()
    for attempt in range(_REJECTION_ROUNDS):
        if not need.any():
            break
        # More candidates each round: repeats abound for a user whose taste is concentrated.
        draws = np.minimum(need << attempt, 2 * n_items) + 2 * (need > 0)
        row = np.repeat(np.arange(rows), draws)
        item = _draw(weights, chunk_cdf, row, rng, n_items)
        keep = _first_new(row, item, n_items, taken_rows, taken_items)
        row, item = row[keep], item[keep]
        rank = np.arange(len(row)) - np.searchsorted(row, row)  # position within its row
        fits = rank < need[row]
        taken_rows.append(row[fits])
        taken_items.append(item[fits])
        need -= np.bincount(row[fits], minlength=rows)
    for r in np.flatnonzero(need):
        extra = _gumbel_rest(logits[r], int(r), int(need[r]), taken_rows, taken_items, rng)
        taken_rows.append(np.full(len(extra), r))
        taken_items.append(extra)
    row, item = np.concatenate(taken_rows), np.concatenate(taken_items)
    order = np.argsort(row, kind="stable")  # rows grouped, each in draw order
    return row[order], item[order]


def _draw(
    weights: np.ndarray,
    chunk_cdf: np.ndarray,
    row: np.ndarray,
    rng: np.random.Generator,
    n_items: int,
) -> np.ndarray:
    """One item per entry of `row`, with probability proportional to its weight in that row."""
    target = rng.random(len(row)) * chunk_cdf[row, -1]
    last = chunk_cdf.shape[1] - 1
    size = weights.shape[2]
    chunk = np.minimum((chunk_cdf[row] <= target[:, None]).sum(axis=1), last)
    before = np.where(chunk > 0, chunk_cdf[row, np.maximum(chunk - 1, 0)], 0.0)
    inside = np.cumsum(weights[row, chunk], axis=1)
    position = (inside <= (target - before)[:, None]).sum(axis=1)
    # Rounding can point one past a chunk's last item: keep it on a real item of the chunk.
    valid = np.minimum(size, n_items - chunk * size) - 1
    return chunk * size + np.minimum(position, valid)


def _first_new(
    row: np.ndarray,
    item: np.ndarray,
    n_items: int,
    taken_rows: list[np.ndarray],
    taken_items: list[np.ndarray],
) -> np.ndarray:
    """Mask of the candidates that are each (row, item)'s first and not drawn before."""
    key = row * n_items + item
    _, first = np.unique(key, return_index=True)
    keep = np.zeros(len(key), dtype=bool)
    keep[first] = True
    if taken_rows:
        keep &= ~np.isin(key, np.concatenate(taken_rows) * n_items + np.concatenate(taken_items))
    return keep


def _gumbel_rest(
    logits: np.ndarray,
    row: int,
    need: int,
    taken_rows: list[np.ndarray],
    taken_items: list[np.ndarray],
    rng: np.random.Generator,
) -> np.ndarray:
    """A row's remaining `need` items, in draw order: a Gumbel top-k over those not drawn."""
    keys = logits + rng.gumbel(size=len(logits))
    for rows, items in zip(taken_rows, taken_items, strict=True):
        keys[items[rows == row]] = -np.inf
    return np.argsort(-keys, kind="stable")[:need]


BLOCK_USERS = 1 << 16
"""Users per generated block of `generate_sessions` (part of its output's definition)."""
_SESSION_SPAN = 6 * 3600  # sessions start early enough to end inside the last day


@dataclass
class _Topics:
    """Items grouped by topic: popularity CDF per topic, and each item's successor."""

    by_topic: np.ndarray  # item indices sorted by topic
    cdf: np.ndarray  # cumulative popularity along by_topic
    lo: np.ndarray  # [topics] first position of each topic in by_topic
    hi: np.ndarray  # [topics] one past its last position
    successor: np.ndarray  # [items] the next item of the item's topic order
    directions: np.ndarray  # [d, topics]


def _topics(config: SyntheticConfig, items: np.ndarray) -> _Topics:
    rng = np.random.default_rng([config.seed, 2])
    directions = rng.normal(size=(config.latent_dim, config.topics))
    topic = np.argmax(items @ directions, axis=1)
    log_pop = -config.popularity_exponent * np.log(np.arange(1, config.num_items + 1))
    popularity = np.exp(rng.permutation(log_pop))
    by_topic = np.argsort(topic, kind="stable")
    bounds = np.searchsorted(topic[by_topic], np.arange(config.topics + 1))
    # A random cycle through each topic's items: item -> the next one in that cycle.
    cycle = np.lexsort((rng.random(config.num_items), topic))
    nxt = np.roll(cycle, -1)
    last = np.searchsorted(topic[cycle], np.arange(config.topics), side="right") - 1
    first = bounds[:-1]
    has = bounds[1:] > first
    nxt[last[has]] = cycle[first[has]]
    successor = np.empty(config.num_items, np.int64)
    successor[cycle] = nxt
    return _Topics(
        by_topic, np.cumsum(popularity[by_topic]), first, bounds[1:], successor, directions
    )


def generate_sessions(config: SyntheticConfig) -> Iterator[pa.Table]:
    """Tables (user_id, item_id, timestamp, weight) of the `sessions` shape, a block of users
    each, in user then time order."""
    _, users, items = _latent(config)
    topics = _topics(config, items)
    affinity = users @ topics.directions
    affinity = (affinity - affinity.mean()) / max(float(affinity.std()), 1e-12)
    counts = np.clip(
        np.random.default_rng([config.seed, 3]).geometric(
            1 / config.mean_interactions_per_user, config.num_users
        ),
        3,
        config.num_items // 2,
    )
    start = int(dt.datetime.fromisoformat(config.start_date).replace(tzinfo=dt.UTC).timestamp())
    span = config.days * 86400 - _SESSION_SPAN
    progress = _Progress(config.num_users)
    for block, first in enumerate(range(0, config.num_users, BLOCK_USERS)):
        rng = np.random.default_rng([config.seed, 4, block])
        ids = np.arange(first, min(first + BLOCK_USERS, config.num_users))
        user = np.repeat(ids, counts[ids])
        item, session = _session_items(config, topics, affinity, user, rng)
        order, stamp = _timestamps(user, session, start, max(span, 1), rng)
        user, item = user[order], item[order]
        yield _rows_table(config, users, items, user, item, stamp)
        progress.update(int(ids[-1]) + 1, len(user))


def _session_items(
    config: SyntheticConfig,
    topics: _Topics,
    affinity: np.ndarray,
    user: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """(item, session number) per row of `user` (rows grouped by user)."""
    n = len(user)
    begins = rng.random(n) < 1 / config.mean_session_length
    begins[0] = True
    begins[1:] |= user[1:] != user[:-1]
    session = np.cumsum(begins) - 1
    starts = np.flatnonzero(begins)
    # Gumbel-max: one topic per session with probability softmax(strength * affinity).
    logits = config.taste_strength * affinity[user[starts]]
    topic = np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)[session]
    lo, hi = topics.lo[topic], topics.hi[topic]
    base = np.where(lo > 0, topics.cdf[np.maximum(lo - 1, 0)], 0.0)
    target = base + rng.random(n) * (topics.cdf[hi - 1] - base)
    where = np.clip(np.searchsorted(topics.cdf, target, side="right"), lo, hi - 1)
    item = topics.by_topic[where]
    # Sequential steps depend on the row before: walk session positions in order.
    position = np.arange(n) - starts[session]
    follow = (position > 0) & (rng.random(n) < config.sequential_probability)
    order = np.argsort(position, kind="stable")
    bounds = np.searchsorted(position[order], np.arange(position.max() + 2))
    for p in range(1, len(bounds) - 1):
        rows = order[bounds[p] : bounds[p + 1]]
        rows = rows[follow[rows]]
        item[rows] = topics.successor[item[rows - 1]]
    return item, session


def _timestamps(
    user: np.ndarray, session: np.ndarray, start: int, span: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(row order by user then time, timestamps in that order): a row's session start plus
    1-120 s per earlier row of the session; strictly increasing per user (an overlap of two
    sessions is pushed a second later)."""
    n = len(user)
    begins = np.flatnonzero(np.diff(session, prepend=-1))
    session_start = start + rng.integers(0, span, size=len(begins))
    gap = rng.integers(1, 121, size=n)
    gap[begins] = 0
    elapsed = np.cumsum(gap)
    stamp = session_start[session] + elapsed - elapsed[begins][session]
    order = np.lexsort((stamp, user))
    user, stamp = user[order], stamp[order]
    # Strictly increasing within a user: running max of (t - i), offset per user.
    idx = np.arange(n)
    offset = user.astype(np.int64) << 40
    return order, np.maximum.accumulate(stamp - idx + offset) - offset + idx


def _prefixed(prefix: str, values: np.ndarray) -> pa.Array:
    return pc.binary_join_element_wise(prefix, pa.array(values).cast(pa.string()), "")


def _write_table_csv(tables: Iterable[pa.Table], path: Path) -> None:
    """Blocks as one CSV (header once, no quoting: the ids hold no separators)."""
    schema = pa.schema(
        [
            ("user_id", pa.string()),
            ("item_id", pa.string()),
            ("timestamp", pa.int64()),
            ("weight", pa.float64()),
        ]
    )
    options = pacsv.WriteOptions(include_header=False, quoting_style="none")
    with path.open("wb") as fh:
        fh.write((",".join(HEADER) + "\n").encode())
        with pacsv.CSVWriter(fh, schema, write_options=options) as writer:
            for table in tables:
                writer.write_table(table)
