"""Quality by segment: test users split by history length and by their test item's popularity.

A mean over all test users can hide a gain bought on popular items or long histories only;
these tables show each part. Both splits are taken at test time, from what every model knows
then (each user's training items and validation item):

- **history**: users in thirds by the number of items they have (terciles of users; users on
  an edge go to the lower band, so the bands' sizes can differ);
- **popularity**: the test item's band when the catalog is ranked by interaction count, each
  band holding about a third of all interactions: **head** (the few most popular items),
  **torso**, **tail** (the many rare ones; a test item outside the catalog is tail).

Per segment, each model's per-user metric is averaged over its seeds, then over the segment's
users; `relative` is (model - reference) / reference with a percentile-bootstrap 95% interval
over the segment's users (seeded), as `quality.py --paired` computes it for all users.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from benchmarks import protocol

HISTORY_BANDS = ("short", "medium", "long")
POPULARITY_BANDS = ("head", "torso", "tail")
METRICS = ("ndcg_at_10", "recall_at_10")


def history_bands(lengths: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Each user's band by item count (terciles), and the bands' labels with their ranges."""
    low, high = np.quantile(lengths, [1 / 3, 2 / 3], method="lower")
    band = np.where(lengths <= low, 0, np.where(lengths <= high, 1, 2))
    middle = "none" if high == low else str(high) if high == low + 1 else f"{low + 1}-{high}"
    ranges = [f"<= {low}", middle, f"> {high}"]
    return band, [f"{name} ({r})" for name, r in zip(HISTORY_BANDS, ranges, strict=True)]


def popularity_bands(counts: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Each target's band (head / torso / tail: a third of all interactions each), and labels.

    Items are ranked by count (most first); an item is head while the interactions of the items
    ranked before it are under a third of the total, torso under two thirds, else tail.
    """
    order = np.argsort(-counts, kind="stable")
    before = np.cumsum(counts[order]) - counts[order]
    item_band = np.empty(len(counts), np.int64)
    item_band[order] = np.searchsorted([counts.sum() / 3, 2 * counts.sum() / 3], before, "right")
    band = np.where(targets >= 0, item_band[np.maximum(targets, 0)], 2)
    sizes = [int((item_band == b).sum()) for b in range(3)]
    labels = [f"{n} ({s:,} items)" for n, s in zip(POPULARITY_BANDS, sizes, strict=True)]
    return band, labels


def segments_of_test_users(split: protocol.Split) -> dict[str, tuple[np.ndarray, list[str]]]:
    """Both segmentations of the test users (in the protocol's order: sorted user index)."""
    rows = sorted(split.test)
    every = [split.sequence(u, with_validation=True) for u in range(len(split.users))]
    counts = np.bincount(np.concatenate(every), minlength=len(split.catalog))
    targets = np.array([split.test[u] for u in rows], np.int64)
    return {
        "history": history_bands(np.array([len(every[u]) for u in rows])),
        "popularity": popularity_bands(counts, targets),
    }


def difference_interval(diff: np.ndarray, picks: np.ndarray) -> tuple[float, float, float]:
    """Mean of per-user differences and its 95% percentile-bootstrap interval.

    `picks` is [resamples, users] of user indices drawn with replacement; each row's mean
    difference is one bootstrap replicate.
    """
    low, high = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


def _relative(
    model: np.ndarray, reference: np.ndarray, rng: np.random.Generator, resamples: int
) -> str:
    base = reference.mean()
    if base == 0:
        return "n/a"
    diff = model - reference
    picks = rng.integers(0, len(diff), size=(resamples, len(diff)))
    mean, low, high = difference_interval(diff, picks)
    return f"{mean / base:+.1%} ({low / base:+.1%}, {high / base:+.1%})"


def segment_table(
    per_user: Mapping[str, Mapping[str, np.ndarray]],
    band: np.ndarray,
    labels: list[str],
    model: str,
    reference: str,
    resamples: int = 2_000,
) -> str:
    """Markdown: per band, users, every model's NDCG@10 / R@10, `model` against `reference`."""
    names = list(per_user)
    header = ["segment", "users", *(f"{n} NDCG@10 / R@10" for n in names)]
    header += [f"{model} vs {reference} {m}" for m in ("NDCG@10", "R@10")]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    rng = np.random.default_rng(0)
    for b, label in enumerate(labels):
        mask = band == b
        cells = [label, f"{int(mask.sum()):,}"]
        if not mask.any():
            lines.append("| " + " | ".join(cells + ["n/a"] * (len(header) - 2)) + " |")
            continue
        cells += [" / ".join(f"{per_user[n][m][mask].mean():.4f}" for m in METRICS) for n in names]
        cells += [
            _relative(per_user[model][m][mask], per_user[reference][m][mask], rng, resamples)
            for m in METRICS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
