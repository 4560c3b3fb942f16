"""Exact top-K evaluation over the whole catalog (the protocol of docs/PROTOCOL.md).

For each evaluation user with one held-out target item, every catalog item is scored, the
user's known items (training, plus validation when testing) are removed, and the target's
rank r (0-based; ties broken by catalog order) gives the per-user values

    recall@K = 1[r < K]      ndcg@K = 1[r < K] / log2(r + 2)      rr@K = 1[r < K] / (r + 1)

averaged over users. coverage@K is the share of the catalog that appears in any user's
top K. A target missing from the catalog (an item never seen in training) is a miss.
Scores are computed in user batches, so memory is batch x catalog, never users x catalog.
Per batch the work is a few linear passes over the scores (mask, two rank counts, block
maxima); no sort or partition of whole catalog rows (see `recsys.topk.top_k_columns`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from threadpoolctl import threadpool_limits

from recsys.core import schema
from recsys.core.config import EvaluationConfig
from recsys.core.progress import bar
from recsys.item_tokens import PAD
from recsys.topk import top_k_columns

if TYPE_CHECKING:
    from recsys.data_io import Sequences

_MAX_THREADS = 4
"""Score batches evaluated at once, on as many threads (at most twice the CPU count)."""
_SCORE_BYTES = 256 << 20
"""Scores in flight over all threads; `evaluation.user_batch_size` caps a batch further."""
_BATCH_BYTES = 16 << 20
"""Scores (+ masks) of one batch: small enough that its passes mostly hit the CPU caches
(100K items: 32 users a batch, 1.6x faster than 134 users; docs/BENCHMARKS.md)."""

ScoreFn = Callable[[np.ndarray], np.ndarray]
"""Rows of evaluation users -> float scores [len(rows), num_items] in catalog order.

`evaluate` masks a copy, unless the function has `returns_fresh_arrays = True` (its float32
results are new arrays nobody else holds, so they are masked in place). It may be called from
several threads at once: it must not mutate shared state.
"""


@dataclass
class EvalSet:
    """Held-out targets and the items to exclude, in catalog index space."""

    users: list[str]
    targets: np.ndarray  # catalog index of each user's target, -1 if not in the catalog
    exclude: list[np.ndarray]  # per user: catalog indices to remove from the ranking
    num_items: int
    # Evaluation users these are a uniform sample of (None: these are all of them).
    population: int | None = None


def build_eval_set(
    catalog: list[str],
    eval_rows: dict[str, np.ndarray],
    known_rows: Iterable[dict[str, np.ndarray]],
) -> EvalSet:
    """Targets from `eval_rows`; exclusions from `known_rows` (e.g. train and validation).

    `known_rows` may be whole splits or batches of them (`dataset.iter_split`): they are
    read once, keeping only the (user, item) pairs of evaluation users as int64 keys, so
    memory is 8 bytes per such pair, not the splits' rows as Python strings.
    """
    items = pa.array(catalog, pa.string())
    users = _str(eval_rows[schema.USER_ID])
    targets = id_positions(eval_rows[schema.ITEM_ID], items)
    distinct = pc.unique(pa.array(users, pa.string()))
    user_row = id_positions(users, distinct)
    num_items = max(len(catalog), 1)
    keys = []
    for rows in known_rows:
        row = id_positions(rows[schema.USER_ID], distinct)
        item = id_positions(rows[schema.ITEM_ID], items)
        keep = (row >= 0) & (item >= 0)
        keys.append(sorted_unique(row[keep] * num_items + item[keep]))
    known = sorted_unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
    bounds = np.searchsorted(known, np.arange(len(distinct) + 1) * num_items)
    exclude = [
        _drop(known[bounds[r] : bounds[r + 1]] % num_items, t)
        for r, t in zip(user_row.tolist(), targets.tolist(), strict=True)
    ]
    return EvalSet(users, targets, exclude, len(catalog))


@dataclass
class EvalExamples:
    """One split's evaluation examples over per-user sequences (`data_io.Sequences`), as
    index arrays: one example per position of the split, in the sequences' order.

    Example i's user is row `rows[i]` of the sequences; its target is flat position
    `positions[i]` and its history the user's positions before it,
    `items[starts[i]:positions[i]]`; it excludes
    `exclude_items[exclude_offsets[i]:exclude_offsets[i + 1]]`.
    """

    rows: np.ndarray  # [n] int64
    starts: np.ndarray  # [n] int64: flat position of the user's first interaction
    positions: np.ndarray  # [n] int64
    targets: np.ndarray  # [n] int64 catalog index of the target, -1 outside the catalog
    exclude_offsets: np.ndarray  # [n + 1] int64
    exclude_items: np.ndarray  # catalog indices: the user's earlier splits' items, no target
    population: int | None = None  # examples these are a uniform sample of (None: all)

    def histories(self, items: np.ndarray, length: int) -> np.ndarray:
        """[n, length] int64: each example's last `length` history items (`items`: the
        sequences' lookup indices), oldest first, right-padded with PAD (the towers' input)."""
        sizes = np.minimum(self.positions - self.starts, length)
        out = np.full((len(sizes), length), PAD, np.int64)
        flat = concat_ranges(self.positions - sizes, self.positions)
        rows = np.repeat(np.arange(len(sizes)), sizes)
        out[rows, flat - np.repeat(self.positions - sizes, sizes)] = items[flat]
        return out

    def eval_set(self, users: Sequence[str], num_items: int) -> EvalSet:
        """The `EvalSet` of these examples; `users`: the sequences' user ids."""
        exclude = np.split(self.exclude_items, self.exclude_offsets[1:-1]) if len(self.rows) else []
        return EvalSet(
            [users[r] for r in self.rows.tolist()],
            self.targets,
            exclude,
            num_items,
            self.population,
        )


def eval_examples(
    sequences: Sequences, split: str, first_item: int = 0, sample: int = 0, seed: int = 0
) -> EvalExamples:
    """Every position of `split` (validation or test) as an evaluation example.

    Each example's history is the user's positions before it (several test positions of a
    user under the time-window split each get their own); its exclusions are the user's
    items of the earlier splits (validation: train; test: train and validation), the target
    itself never. `sequences.items` are int indices whose catalog starts at `first_item`
    (a model lookup's `oov_buckets`; lower values: ids outside the catalog). `sample` > 0
    keeps the seeded uniform sample `sample_indices` draws over the examples.
    """
    code = schema.SPLITS.index(split)
    items, offsets = sequences.items, sequences.offsets
    positions = np.flatnonzero(sequences.splits == code)
    population = len(positions)
    chosen = sample_indices(population, sample, seed)
    if chosen is not None:
        positions = positions[chosen]
    rows = np.searchsorted(offsets, positions, side="right") - 1
    targets = items[positions].astype(np.int64) - first_item
    targets[targets < 0] = -1
    offsets_out, excluded = _exclusions(sequences, rows, targets, code, first_item)
    return EvalExamples(
        rows,
        offsets[rows],
        positions,
        targets,
        offsets_out,
        excluded,
        population if chosen is not None else None,
    )


def _exclusions(
    sequences: Sequences, rows: np.ndarray, targets: np.ndarray, code: int, first_item: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per example (CSR): the distinct catalog items of its user's positions in splits
    before `code`, less its target."""
    # `rows` ascend (positions do): each user's examples are one run.
    first = np.append(True, rows[1:] != rows[:-1]) if len(rows) else np.zeros(0, bool)
    users, user_of_example = rows[first], np.cumsum(first) - 1
    offsets = sequences.offsets
    flat = concat_ranges(offsets[users], offsets[users + 1])
    owner = np.repeat(np.arange(len(users)), offsets[users + 1] - offsets[users])
    item = sequences.items[flat].astype(np.int64) - first_item
    keep = (sequences.splits[flat] < code) & (item >= 0)
    width = int(item[keep].max()) + 1 if keep.any() else 1
    # One sorted key per distinct (user, item): each user's items form one run.
    known = sorted_unique(owner[keep] * width + item[keep])
    bounds = np.searchsorted(known, np.arange(len(users) + 1) * width)
    lo, hi = bounds[user_of_example], bounds[user_of_example + 1]
    picked = known[concat_ranges(lo, hi)] % width
    example = np.repeat(np.arange(len(rows)), hi - lo)
    kept = picked != targets[example]
    counts = np.bincount(example[kept], minlength=len(rows))
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), picked[kept]


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of an int array, by one sort: numpy 2's hash-based np.unique is over 100x
    slower on (user, item) keys."""
    ordered = np.sort(values)
    return ordered[np.append(True, ordered[1:] != ordered[:-1])] if len(ordered) else ordered


def concat_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """np.arange(start, stop) of every pair, concatenated (without a Python loop)."""
    sizes = np.asarray(stops, np.int64) - np.asarray(starts, np.int64)
    before = np.cumsum(sizes) - sizes
    return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(starts - before, sizes)


def sample_rows(rows: dict[str, np.ndarray], size: int, seed: int) -> dict[str, np.ndarray]:
    """A uniform sample (without replacement, file order kept) of `size` evaluation rows;
    all of them when `size` is 0 or not smaller."""
    chosen = sample_indices(len(rows[schema.USER_ID]), size, seed)
    if chosen is None:
        return rows
    return {name: values[chosen] for name, values in rows.items()}


def sample_indices(total: int, size: int, seed: int) -> np.ndarray | None:
    """Sorted row numbers of `sample_rows`' sample of `total` rows; None: every row."""
    if not size or size >= total:
        return None
    return np.sort(np.random.default_rng(seed).choice(total, size, replace=False))


def sampled_batches(
    batches: Iterable[dict[str, np.ndarray]], chosen: np.ndarray | None
) -> Iterator[dict[str, np.ndarray]]:
    """The rows numbered `chosen` (sorted, over the whole stream) of a stream of row batches
    (`data_io.iter_split`), batch by batch: only the sample is ever kept. None: every row."""
    offset = 0
    for batch in batches:
        size = len(batch[schema.USER_ID])
        if chosen is None:
            yield batch
        else:
            lo, hi = np.searchsorted(chosen, [offset, offset + size])
            if hi > lo:
                rows = chosen[lo:hi] - offset
                yield {name: values[rows] for name, values in batch.items()}
        offset += size


def id_positions(
    values: Sequence[object] | np.ndarray | pa.Array, value_set: pa.Array
) -> np.ndarray:
    """Index of each id (bytes or str) in `value_set`; -1 when absent (one hash pass)."""
    if not len(values):
        return np.zeros(0, np.int64)
    ids = values if isinstance(values, pa.Array) else pa.array(values)
    if not pa.types.is_string(ids.type):
        ids = ids.cast(pa.string())
    found = pc.index_in(ids, value_set=value_set)
    return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def _drop(items: np.ndarray, target: int) -> np.ndarray:
    """The target itself is never excluded."""
    return items[items != target]


def _str(values: np.ndarray) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


@dataclass
class EvalResult:
    """Summary metrics, the per-user values they average, and each metric's confidence
    interval over users (`confidence_intervals`)."""

    metrics: dict[str, float]
    per_user: dict[str, np.ndarray]
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)

    def write_per_user(self, path: Path, users: list[str]) -> None:
        """Per-user values as Parquet (paired comparisons between models need them)."""
        columns = {"user_id": pa.array(users, pa.string())}
        columns.update({k: pa.array(v) for k, v in self.per_user.items()})
        pq.write_table(pa.table(columns), path)


def evaluate(
    score_fn: ScoreFn, data: EvalSet, config: EvaluationConfig, progress: str | None = None
) -> EvalResult:
    """Rank every catalog item for every evaluation user and compute the metrics.

    `progress` labels a bar of users ranked (recsys.core.progress: shown by the CLI only);
    None, as for the per-epoch validation, shows none.
    """
    n = len(data.users)
    ranks = np.full(n, np.inf)
    covered = np.zeros(data.num_items, dtype=bool)
    top = min(config.coverage_k, data.num_items)
    # Exclusions as one CSR array, so each batch masks with one fancy assignment.
    lengths = np.fromiter((len(e) for e in data.exclude), dtype=np.int64, count=n)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate(data.exclude).astype(np.int64) if n else np.zeros(0, np.int64)

    threads, batch = batch_plan(n, data.num_items, config.user_batch_size)

    def one_batch(start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        stop = min(start + batch, n)
        rows = np.arange(start, stop)
        scores = score_fn(rows)
        if not (getattr(score_fn, "returns_fresh_arrays", False) and scores.dtype == np.float32):
            scores = np.array(scores, dtype=np.float32)  # a copy: masked in place below
        batch_rows = np.repeat(np.arange(stop - start), lengths[start:stop])
        scores[batch_rows, flat[indptr[start] : indptr[stop]]] = -np.inf
        batch_ranks = _target_ranks(scores, data.targets[rows])
        if not top:
            return rows, batch_ranks, None
        best = top_k_columns(scores, top)
        return rows, batch_ranks, best[np.take_along_axis(scores, best, axis=1) > -np.inf]

    starts = range(0, n, batch)
    threads = min(threads, len(starts))
    ranked = bar(progress or "", n, "users", show=None if progress else False)
    results = []
    with ranked:
        if threads > 1:
            # Our threads already fill the cores: BLAS threads inside each product only contend
            # (one BLAS thread each: 1.6x faster on 2 cores, identical products).
            with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(threads) as pool:
                for result in pool.map(one_batch, starts):
                    ranked.update(len(result[0]))
                    results.append(result)
        else:
            for start in starts:
                results.append(one_batch(start))
                ranked.update(len(results[-1][0]))
    for rows, batch_ranks, best in results:
        ranks[rows] = batch_ranks
        if best is not None:
            covered[best] = True
    per_user = per_user_values(ranks, config)
    metrics = {
        name: float(values.mean()) if n else 0.0
        for name, values in per_user.items()
        if name != "rank"
    }
    metrics[f"coverage_at_{config.coverage_k}"] = float(covered.mean()) if data.num_items else 0.0
    metrics["eval_users"] = float(n)
    intervals = confidence_intervals(per_user, data.population)
    return EvalResult(metrics, per_user, intervals)


Z_95 = 1.959964


def confidence_intervals(
    per_user: dict[str, np.ndarray], population: int | None = None, z: float = Z_95
) -> dict[str, tuple[float, float]]:
    """95% normal-approximation interval of each per-user mean (rank excluded).

    mean +- z s / sqrt(n), s the per-user standard deviation. For a sample of n users drawn
    without replacement from `population`, times the finite-population correction
    sqrt((N - n) / (N - 1)): the interval of the metric over all N users that the sample
    estimates (zero width when the sample is everyone).
    """
    out = {}
    for name, values in per_user.items():
        n = len(values)
        if name == "rank" or n == 0:
            continue
        mean = float(values.mean())
        half = z * float(values.std(ddof=1)) / np.sqrt(n) if n > 1 else 0.0
        if population is not None and population > 1:
            half *= np.sqrt(max(population - n, 0) / (population - 1))
        out[name] = (mean - half, mean + half)
    return out


def batch_plan(users: int, num_items: int, user_batch_size: int) -> tuple[int, int]:
    """(threads, users per batch) of `evaluate`.

    numpy's passes release the GIL: batches on several threads use several cores. Memory
    stays bounded: `threads` batches in flight, each at most _BATCH_BYTES of scores (+1 byte
    per score for comparison masks) and all of them together at most _SCORE_BYTES. Twice the
    cores: BLAS products on some threads overlap numpy passes on others. Small jobs (ML-100K:
    ~8 MB of scores) run faster on one thread than the pool costs.
    """
    bytes_per_user = 5 * max(num_items, 1)
    threads = max(1, min(2 * (os.cpu_count() or 1), _MAX_THREADS))
    if users * bytes_per_user < _SCORE_BYTES // 4:
        threads = 1
    budget = min(_BATCH_BYTES, _SCORE_BYTES // threads)
    return threads, max(1, min(user_batch_size, max(16, budget // bytes_per_user)))


def _target_ranks(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """0-based rank of each target among the row's scores; inf when the target is unknown.

    Ties are broken by catalog order: equal scores at earlier columns rank first.
    """
    ranks = np.full(len(targets), np.inf)
    known = targets >= 0
    if not known.any():
        return ranks
    rows = np.nonzero(known)[0]
    # Fancy-indexing all rows would copy the whole batch: only subset when some are unknown.
    sub = scores if len(rows) == len(scores) else scores[rows]
    cols = targets[rows]
    target_scores = sub[np.arange(len(rows)), cols][:, None]
    higher = np.count_nonzero(sub > target_scores, axis=1)
    equal = np.count_nonzero(sub == target_scores, axis=1)
    # Exact float ties are rare: find the earlier ones only in the rows that have any.
    for r in np.nonzero(equal > 1)[0]:
        higher[r] += np.count_nonzero(sub[r, : cols[r]] == target_scores[r, 0])
    ranks[rows] = higher
    return ranks


def per_user_values(ranks: np.ndarray, config: EvaluationConfig) -> dict[str, np.ndarray]:
    """Recall@K for each K, NDCG@K and reciprocal rank@K per user, from 0-based ranks."""
    values: dict[str, np.ndarray] = {}
    for k in config.ks:
        values[f"recall_at_{k}"] = (ranks < k).astype(np.float64)
    hit = ranks < config.ndcg_k
    values[f"ndcg_at_{config.ndcg_k}"] = np.where(hit, 1 / np.log2(np.where(hit, ranks, 0) + 2), 0)
    hit = ranks < config.mrr_k
    values[f"mrr_at_{config.mrr_k}"] = np.where(hit, 1 / (np.where(hit, ranks, 0) + 1), 0)
    values["rank"] = np.where(np.isfinite(ranks), ranks, -1).astype(np.int64)
    return values


def dot_product_scores(user_vectors: np.ndarray, item_vectors: np.ndarray) -> ScoreFn:
    """Two-tower scores: the rows' query vectors times every item vector (float32)."""
    users = np.asarray(user_vectors, dtype=np.float32)
    items_t = np.ascontiguousarray(np.asarray(item_vectors, dtype=np.float32).T)

    def scores(rows: np.ndarray) -> np.ndarray:
        return users[rows] @ items_t

    scores.returns_fresh_arrays = True  # type: ignore[attr-defined]  # a new product each call
    return scores


def popularity_scores(item_counts: np.ndarray) -> ScoreFn:
    """The popularity baseline: every user gets the training counts as scores."""
    counts = item_counts.astype(np.float32)[None, :]
    return lambda rows: np.repeat(counts, len(rows), axis=0)
