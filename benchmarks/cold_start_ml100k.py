"""Cold-start items on MovieLens 100K: are vectors built from genres and titles useful?

Protocol (everything computed here, per seed; the means over seeds are reported):

1. Cold items: `--fraction` of the items with at least 10 ratings, drawn per seed
   (`--seeds`). Every rating of a cold item is removed from the log; the rest goes through
   our Beam job and trains our default config (`configs/movielens-100k.yaml`), so the
   model never sees a cold item's id.
2. Each user who rated a cold item is a test user; the positives are the cold items they
   rated. The query is the user's vector from the exported `query` SavedModel (user id and
   last `history_length` training items); the candidates are the cold items only, embedded
   by the exported `candidate` SavedModel from their id (unknown to the model) and raw
   `u.item` genres and title. Ranking is exact over the cold items.
3. Same users, same candidates, same metrics for: the candidate model with ids only (the
   out-of-vocabulary bucket vector, what the export gave before item features), a
   content baseline (cosine of the user's genre profile over training ratings and the
   item's genre multi-hot), cold-item popularity in the held-out ratings (an oracle: it
   peeks at the test ratings, shown as a ceiling for non-personalised ranking), and random.

Usage:
    .venv/bin/python benchmarks/cold_start_ml100k.py --data datasets/ml-100k \
        --out benchmarks/results/cold_start_ml100k.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf

from beam_jobs.items import read_items
from conductor import stages
from recsys.core.config import ItemsConfig, load_config
from recsys.core.layout import Workdir
from recsys.model import TrainedModel
from serving_export import samples
from serving_export.savedmodels import export_savedmodels
from serving_export.signatures import CANDIDATE, QUERY, SIGNATURE

REPO = Path(__file__).resolve().parent.parent
DATE = dt.date(1998, 4, 30)  # after the last rating in u.data
KS = (10, 50)


def read_ratings(path: Path) -> np.ndarray:
    """u.data as an [n, 4] int64 array: user, item, rating, timestamp."""
    return np.loadtxt(path, dtype=np.int64, delimiter="\t")


def pick_cold(ratings: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A seeded `fraction` of the items with at least 10 ratings."""
    items, counts = np.unique(ratings[:, 1], return_counts=True)
    eligible = items[counts >= 10]
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(eligible, size=round(fraction * len(eligible)), replace=False))


def metrics(scores: np.ndarray, positives: list[np.ndarray], seed: int) -> dict[str, float]:
    """Mean Recall@K and NDCG@10 over users; `scores` is [users, cold items].

    Equal scores are ordered at random: item ids correlate with popularity in MovieLens, so
    breaking ties by id would favour whatever gives many ties (the shared OOV buckets).
    """
    tiebreak = np.random.default_rng(seed).random(scores.shape)
    order = np.lexsort((tiebreak, -scores), axis=1)
    out: dict[str, list[float]] = {f"recall_at_{k}": [] for k in KS} | {"ndcg_at_10": []}
    discounts = 1.0 / np.log2(np.arange(2, 12))
    for row, pos in zip(order, positives, strict=True):
        hit = np.isin(row, pos)
        for k in KS:
            out[f"recall_at_{k}"].append(hit[:k].sum() / len(pos))
        ideal = discounts[: min(10, len(pos))].sum()
        out["ndcg_at_10"].append(float((hit[:10] * discounts).sum() / ideal))
    return {name: round(float(np.mean(values)), 4) for name, values in out.items()}


def signature(model_dir: Path) -> Any:
    return tf.saved_model.load(str(model_dir)).signatures[SIGNATURE]


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The whole protocol for one draw of cold items."""
    data = Path(args.data)
    ratings = read_ratings(data / "u.data")
    cold = pick_cold(ratings, args.fraction, seed)
    is_cold = np.isin(ratings[:, 1], cold)
    warm, held_out = ratings[~is_cold], ratings[is_cold]
    features = dict(read_items(ItemsConfig(path=str(data / "u.item"), format="movielens-100k")))
    config = load_config(args.config)
    config = config.model_copy(
        update={
            "data": config.data.model_copy(
                update={"items": ItemsConfig(path=str(data / "u.item"), format="movielens-100k")}
            )
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "u.data"
        np.savetxt(log, warm, fmt="%d", delimiter="\t")
        workdir = Workdir(Path(tmp) / "work")
        data_dir, _ = stages.preprocess(config, workdir, DATE, str(log))
        tf.keras.utils.set_random_seed(config.training.seed)
        run_dir, _ = stages.train(config, workdir, DATE, data_dir)
        model = TrainedModel.load(run_dir / "model")
        assert not set(map(str, cold)) & set(model.items), "a cold item reached the vocabulary"
        exported = export_savedmodels(model, Path(tmp) / "export", 1, 10, warmup=False)

        users = np.unique(held_out[:, 0])
        positives_by_user = {u: [] for u in users}
        for u, i in held_out[:, :2]:
            positives_by_user[u].append(i)
        index = {item: j for j, item in enumerate(cold)}
        positives = [np.array([index[i] for i in positives_by_user[u]]) for u in users]
        history_length = config.model.history_length
        order = np.lexsort((warm[:, 1], warm[:, 3]))
        histories: dict[int, list[str]] = {}
        for u, i in warm[order][:, :2]:
            histories.setdefault(int(u), []).append(str(i))
        user_hist = [histories.get(int(u), [])[-history_length:] for u in users]
        query = signature(exported[QUERY])(
            user_id=tf.constant(samples.strings([str(u) for u in users])),
            history=tf.constant(samples.padded(user_hist)),
        )["embedding"].numpy()

        ids = [str(i) for i in cold]
        genres = [list(features[i][0]) for i in ids]
        titles = [features[i][1] for i in ids]
        embed = signature(exported[CANDIDATE])
        with_features = embed(
            item_id=tf.constant(samples.strings(ids)),
            genres=tf.constant(samples.padded(genres)),
            title=tf.constant(samples.strings(titles)),
        )["embedding"].numpy()
        ids_only = embed(
            item_id=tf.constant(samples.strings(ids)),
            genres=tf.constant(samples.padded([[] for _ in ids])),
            title=tf.constant(samples.strings([""] * len(ids))),
        )["embedding"].numpy()

        genre_names = sorted({g for gs, _ in features.values() for g in gs})
        g_index = {g: j for j, g in enumerate(genre_names)}
        multi_hot = np.zeros((len(ids), len(genre_names)))
        for row, gs in enumerate(genres):
            multi_hot[row, [g_index[g] for g in gs]] = 1
        profile = np.zeros((len(users), len(genre_names)))
        user_row = {u: r for r, u in enumerate(users)}
        for u, i in warm[:, :2]:
            if u in user_row:
                for g in features.get(str(i), ((), ""))[0]:
                    profile[user_row[u], g_index[g]] += 1

        def unit(x: np.ndarray) -> np.ndarray:
            return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

        popularity = np.bincount([index[i] for i in held_out[:, 1]], minlength=len(cold))
        rng = np.random.default_rng(seed)
        return {
            "seed": seed,
            "data": {
                "cold_items": len(cold),
                "cold_ratings": len(held_out),
                "test_users": len(users),
                "train_vocabulary": len(model.items),
                "mean_positives_per_user": round(float(np.mean([len(p) for p in positives])), 2),
            },
            "models": {
                "ours: candidate SavedModel, id + genres + title": metrics(
                    query @ with_features.T, positives, seed
                ),
                "ours: candidate SavedModel, id only (OOV bucket)": metrics(
                    query @ ids_only.T, positives, seed
                ),
                "content: genre profile x genre multi-hot (cosine)": metrics(
                    unit(profile) @ unit(multi_hot).T, positives, seed
                ),
                "oracle popularity (test ratings)": metrics(
                    np.tile(popularity, (len(users), 1)).astype(float), positives, seed
                ),
                "random": metrics(rng.random((len(users), len(cold))), positives, seed),
            },
        }


def main() -> int:
    """Run the protocol for each seed and print/write the per-seed results and their means."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "datasets/ml-100k"))
    parser.add_argument("--config", default=str(REPO / "configs/movielens-100k.yaml"))
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/cold_start_ml100k.json"))
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs = [run(args, seed) for seed in args.seeds]
    names = list(runs[0]["models"])
    mean = {
        name: {
            metric: round(float(np.mean([r["models"][name][metric] for r in runs])), 4)
            for metric in runs[0]["models"][name]
        }
        for name in names
    }
    results = {
        "protocol": __doc__.split("reported):")[1].split("Usage:")[0].strip(),
        "mean_over_seeds": mean,
        "runs": runs,
    }
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
