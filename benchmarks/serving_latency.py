"""Serving latency: the exported `retrieval` SavedModel against numpy brute force and FAISS.

    .venv/bin/python benchmarks/serving_latency.py --catalogs 1682 100000 1000000

For each catalog size a two-tower model is generated (random low-rank tables, d=64, the
default 20-item history; no training needed for latency) and exported with the real
`serving_export` code: the retrieval SavedModel and items.parquet / users.parquet. Then, in
one run, each contender family in its own worker process (their thread pools would fight
otherwise) and interleaved round by round (so load from other processes hits all alike),
on CPU:

- savedmodel: `retrieval` serving_default (raw user id + 20-item history strings -> query
  tower -> exact brute force -> top-100), loaded with tf.saved_model.load as TF Serving does;
- numpy: brute-force top-100 (matmul + argpartition + sort) over the vectors read from
  items.parquet, for the same users' vectors read from users.parquet (no query tower);
- faiss-ivf-npN (largest catalog only): the IVF-Flat inner-product index serving_export.ann
  builds from items.parquet, searched with nprobe N; its recall@100 against numpy brute
  force on 1000 users' vectors.

Batch 1 and batch 64: p50/p99 latency over all calls, throughput (queries/s) as the median
over rounds. Results: JSON (benchmarks/results/serving_latency.json) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np

DIM = 64
USERS = 10_000
K = 100
HISTORY = 20
BATCHES = (1, 64)
NPROBES = (8, 32, 128)


def generate_model(num_items: int, seed: int) -> Any:
    """A TrainedModel whose tables are low-rank + noise (structure like trained factors)."""
    import tensorflow as tf

    from recsys.core.config import ModelConfig
    from recsys.model import TrainedModel

    rng = np.random.default_rng(seed)
    # The measured query tower: a per-user table plus the mean-pooled history (pinned: the
    # code's defaults are the benchmarked model, a transformer without a user table).
    config = ModelConfig(
        embedding_dim=DIM,
        item_features=False,
        history_length=HISTORY,
        query_encoder="mean",
        user_embedding=True,
        negatives="in_batch",
    )
    model = TrainedModel.build(
        [f"u{i}" for i in range(USERS)], [f"i{i}" for i in range(num_items)], config
    )
    mixing = rng.normal(size=(16, DIM)).astype(np.float32)

    def table(rows: int) -> np.ndarray:
        latent = rng.normal(size=(rows, 16)).astype(np.float32)
        values = latent @ mixing + 2.0 * rng.normal(size=(rows, DIM)).astype(np.float32)
        return (0.05 * values / np.linalg.norm(values, axis=1, keepdims=True)).astype(np.float32)

    for embedding in (model.candidate_tower.embedding, model.query_tower.embedding):
        rows = embedding.embeddings.shape[0]
        embedding.embeddings.assign(tf.constant(table(rows)))
    return model


def export(model: Any, root: Path) -> tuple[Path, Path, float]:
    """The real export: SavedModels and items/users Parquet; (retrieval dir, emb dir, s)."""
    from serving_export.embeddings import write_item_embeddings, write_user_embeddings
    from serving_export.savedmodels import export_savedmodels

    start = time.perf_counter()
    exported = export_savedmodels(model, root / "export", 1, top_k=K, warmup=False)
    emb = root / "embeddings" / "1"
    write_item_embeddings(model, emb / "items.parquet", 1)
    write_user_embeddings(model, model.users, emb / "users.parquet", 1)
    return exported["retrieval"], emb, time.perf_counter() - start


def numpy_top_k(items: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k rows by dot product: one matmul, argpartition, sort of the k."""
    scores = queries @ items.T
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def percentile_ms(samples: list[float], q: float) -> float:
    return round(float(np.percentile(samples, q)) * 1000, 3)


def _worker(kind: str, setup: dict[str, Any], conn: Any) -> None:
    """One contender family in its own process, timing calls when the parent asks.

    Separate processes keep TensorFlow's and OpenBLAS's spinning thread pools from stealing
    the cores from each other (in one process numpy's 1.7K-item batch took 30x longer right
    after a TensorFlow call); only one worker runs at a time.
    """
    from serving_export.embeddings import read_embeddings

    item_ids, items, _ = read_embeddings(Path(setup["emb_dir"]) / "items.parquet")
    user_ids, user_vectors, _ = read_embeddings(Path(setup["emb_dir"]) / "users.parquet")
    rows, histories = setup["rows"], setup["histories"]
    info: dict[str, Any] = {}
    if kind == "savedmodel":
        import tensorflow as tf

        fn = tf.saved_model.load(setup["retrieval_dir"]).signatures["serving_default"]
        requests = {
            b: {
                "user_id": tf.constant([user_ids[r] for r in rows[b]]),
                "history": tf.constant([[item_ids[j] for j in h] for h in histories[b]]),
                "k": tf.constant([K] * b, tf.int32),
            }
            for b in BATCHES
        }

        def call(_: str, b: int) -> Any:
            return fn(**requests[b])["item_ids"].numpy()

    else:
        vectors = {b: np.ascontiguousarray(user_vectors[rows[b]]) for b in BATCHES}
        index = None
        if kind == "faiss":
            from serving_export.ann import build_index

            start = time.perf_counter()
            index = build_index(items)
            info = {"index": f"IVF{index.nlist},Flat", "build_seconds": time.perf_counter() - start}

        def call(name: str, b: int) -> Any:
            if index is None:
                return numpy_top_k(items, vectors[b], K)
            index.nprobe = int(name.rsplit("np", 1)[1])
            return index.search(vectors[b], K)[1]

    for name in setup["contenders"]:  # warm-up: graph tracing, first touch of the pages
        for b in BATCHES:
            call(name, b)
    conn.send(info)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] == "run":
            _, name, b, calls = message
            latencies, start = [], time.perf_counter()
            for _ in range(calls):
                t = time.perf_counter()
                call(name, b)
                latencies.append(time.perf_counter() - t)
            conn.send((latencies, time.perf_counter() - start))
        elif message[0] == "recall":  # recall@K of each nprobe against numpy brute force
            from serving_export.ann import exact_top_k, recall_at_k

            sample = user_vectors[setup["recall_rows"]]
            exact = exact_top_k(items, sample, K)
            recalls = {}
            for name in setup["contenders"]:
                index.nprobe = int(name.rsplit("np", 1)[1])
                recalls[name] = recall_at_k(index, items, sample, K, exact)
            conn.send(recalls)
        elif message[0] == "topk":  # the SavedModel's ids for users with empty histories
            import tensorflow as tf

            b = 64
            empty = tf.fill([b, 0], "")
            ids = fn(user_id=requests[b]["user_id"], history=empty, k=requests[b]["k"])
            index_of = {item: i for i, item in enumerate(item_ids)}
            conn.send([[index_of[x.decode()] for x in row] for row in ids["item_ids"].numpy()])
        elif message[0] == "exact":
            conn.send(numpy_top_k(items, vectors[64], K).tolist())


def bench_catalog(
    num_items: int, rounds: int, calls: dict[int, int], ann: bool, seed: int
) -> dict[str, Any]:
    """Latency and throughput of every contender on one generated catalog."""
    import gc
    import multiprocessing

    rng = np.random.default_rng(seed)
    families = {"savedmodel": ["savedmodel"], "numpy": ["numpy"]}
    if ann:
        families["faiss"] = [f"faiss-ivf-np{n}" for n in NPROBES]
    with tempfile.TemporaryDirectory(prefix="recsys-serving-bench-") as tmp:
        t = time.perf_counter()
        model = generate_model(num_items, seed)
        generated = time.perf_counter() - t
        retrieval_dir, emb_dir, export_s = export(model, Path(tmp))
        del model
        gc.collect()
        base = {
            "emb_dir": str(emb_dir),
            "retrieval_dir": str(retrieval_dir),
            "rows": {b: rng.choice(USERS, size=b, replace=False) for b in BATCHES},
            "histories": {b: rng.choice(num_items, size=(b, HISTORY)) for b in BATCHES},
            "recall_rows": rng.choice(USERS, size=1000, replace=False),
        }
        spawn = multiprocessing.get_context("spawn")
        workers, infos = {}, {}
        for kind, contenders in families.items():  # one at a time: setup is measured alone
            parent, child = spawn.Pipe()
            setup = {**base, "contenders": contenders}
            proc = spawn.Process(target=_worker, args=(kind, setup, child))
            proc.start()
            workers[kind] = (proc, parent)
            infos[kind] = parent.recv()
        owner = {name: kind for kind, names in families.items() for name in names}
        contenders = list(owner)
        latencies = {(n, b): [] for n in contenders for b in BATCHES}
        throughput = {(n, b): [] for n in contenders for b in BATCHES}
        for r in range(rounds):
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for name in order:
                conn = workers[owner[name]][1]
                for b in BATCHES:
                    conn.send(("run", name, b, calls[b]))
                    times, elapsed = conn.recv()
                    latencies[name, b] += times
                    throughput[name, b].append(b * calls[b] / elapsed)
        # Sanity: the SavedModel's exact top-K is numpy's top-K (ids), same users.
        workers["savedmodel"][1].send(("topk",))
        got = workers["savedmodel"][1].recv()
        workers["numpy"][1].send(("exact",))
        ref = workers["numpy"][1].recv()
        overlap = np.mean([len(set(g) & set(e)) / K for g, e in zip(got, ref, strict=True)])
        recalls = {}
        if ann:
            workers["faiss"][1].send(("recall",))
            recalls = workers["faiss"][1].recv()
        for proc, conn in workers.values():
            conn.send(("stop",))
            proc.join()
    result: dict[str, Any] = {
        "items": num_items,
        "generate_seconds": round(generated, 2),
        "export_seconds": round(export_s, 2),
        "savedmodel_vs_numpy_top100_overlap": round(float(overlap), 4),
        "contenders": {},
    }
    for name in contenders:
        result["contenders"][name] = {
            f"batch_{b}": {
                "p50_ms": percentile_ms(latencies[name, b], 50),
                "p99_ms": percentile_ms(latencies[name, b], 99),
                "queries_per_s": round(float(np.median(throughput[name, b])), 1),
                "calls": len(latencies[name, b]),
            }
            for b in BATCHES
        }
    if ann:
        numpy_stats = result["contenders"]["numpy"]
        result["ann"] = {
            "index": infos["faiss"]["index"],
            "build_seconds": round(infos["faiss"]["build_seconds"], 2),
            "recall_queries": 1000,
            "by_nprobe": {
                name: {
                    "recall_at_100": round(recalls[name], 4),
                    **{
                        f"speedup_vs_numpy_p50_batch_{b}": round(
                            numpy_stats[f"batch_{b}"]["p50_ms"]
                            / result["contenders"][name][f"batch_{b}"]["p50_ms"],
                            1,
                        )
                        for b in BATCHES
                    },
                }
                for name in families["faiss"]
            },
        }
    return result


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/BENCHMARKS.md."""
    lines = [
        "| items | contender | b=1 p50 ms | b=1 p99 ms | b=1 q/s | b=64 p50 ms | b=64 p99 ms "
        "| b=64 q/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for name, stats in res["contenders"].items():
            one, many = stats["batch_1"], stats["batch_64"]
            lines.append(
                f"| {res['items']:,} | {name} | {one['p50_ms']} | {one['p99_ms']} | "
                f"{one['queries_per_s']:,.0f} | {many['p50_ms']} | {many['p99_ms']} | "
                f"{many['queries_per_s']:,.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalogs", type=int, nargs="+", default=[1682, 100_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(REPO / "benchmarks/results/serving_latency.json"))
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU serving is what is measured
    results = []
    for n in args.catalogs:
        # Fewer calls per round on big catalogs: one 1M-item batch-64 call is ~0.5 s here.
        calls = {1: 100, 64: 20} if n <= 200_000 else {1: 20, 64: 4}
        ann = n == max(args.catalogs)
        res = bench_catalog(n, args.rounds, calls, ann, args.seed)
        print(json.dumps(res), flush=True)
        results.append(res)
    import tensorflow as tf

    report = {
        "command": "benchmarks/serving_latency.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
