"""Optional approximate nearest-neighbour index over items.parquet (FAISS, inner product).

The towers are trained with dot-product logits on L2-normalised vectors, so the index uses
the same similarity: METRIC_INNER_PRODUCT (= cosine here). IVF-Flat keeps exact vectors and
scores, and only approximates which cells are searched, so its one knob is nprobe. Recall@K
against exact brute force is measured on query vectors (users.parquet: the real query
distribution) and recorded in the manifest; brute force stays the default (`export.ann`).
ScaNN is not used: installing it on TF 2.21 breaks `import tensorflow_recommenders`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from recsys.core.errors import EmbeddingsContractError
from recsys.core.layout import EmbeddingsFile
from recsys.topk import ExactNumpyTopK, IndexTopK
from serving_export.manifest import file_sha256, read_manifest

INDEX_FILE = EmbeddingsFile.ANN_INDEX
RECALL_QUERIES = 1000
# faiss warns below ~39 training points per centroid; keep clusters well fed.
_POINTS_PER_LIST = 39
# k-means is trained on at most this many points per list (faiss samples them): 1M items at
# 256 per list (faiss's default) took over 10 minutes on 2 cores; 64 keeps it to seconds.
_TRAIN_POINTS_PER_LIST = 64


def default_nlist(num_items: int) -> int:
    """sqrt(n) inverted lists, at most n / 39, at least 1.

    FAISS suggests 4-16 sqrt(n) for large n; sqrt(n) keeps the k-means that runs every night
    cheap on CPU, and nprobe buys the recall back (docs/BENCHMARKS.md has the sweep).
    """
    return int(max(1, min(np.sqrt(num_items), num_items // _POINTS_PER_LIST)))


def build_index(vectors: np.ndarray, nlist: int | None = None, nprobe: int = 16) -> Any:
    """An IVF-Flat inner-product index over [n, d] float32 vectors (row i has id i)."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    nlist = min(nlist or default_nlist(n), max(n, 1))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.max_points_per_centroid = _TRAIN_POINTS_PER_LIST
    index.cp.seed = 1234  # faiss's default, written down: the same vectors give the same index
    index.train(vectors)
    index.add(vectors)
    index.nprobe = min(nprobe, nlist)
    return index


def exact_top_k(items: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """[q, k] item rows of the k highest dot products per query (recsys.topk, numpy exact)."""
    return ExactNumpyTopK(items)(queries, k)[1]


def recall_at_k(
    index: Any, items: np.ndarray, queries: np.ndarray, k: int, exact: np.ndarray | None = None
) -> float:
    """Mean share of the exact top-k (brute force, or `exact` if given) the index returns."""
    if not len(queries) or not len(items):
        return float("nan")
    k = min(k, len(items))
    _, found = IndexTopK(index)(queries, k)
    exact = exact_top_k(items, queries, k) if exact is None else exact[:, :k]
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(found, exact, strict=True)]
    return float(np.mean(hits) / k)


def build_ann(
    directory: Path,
    items: np.ndarray,
    queries: np.ndarray,
    nlist: int | None,
    nprobe: int,
    recall_k: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Build, measure and write `directory/items.faiss`; the manifest's `ann` entry."""
    import faiss

    start = time.perf_counter()
    index = build_index(items, nlist, nprobe)
    built = time.perf_counter() - start
    if len(queries) > RECALL_QUERIES:
        rows = np.random.default_rng(seed).choice(len(queries), RECALL_QUERIES, replace=False)
        queries = queries[np.sort(rows)]
    k = min(recall_k, len(items))
    recall = recall_at_k(index, items, queries, k)
    path = Path(directory) / INDEX_FILE
    faiss.write_index(index, str(path))
    return {
        "library": "faiss",
        "faiss_version": faiss.__version__,
        "index": f"IVF{index.nlist},Flat",
        "metric": "inner_product",
        "nlist": int(index.nlist),
        "nprobe": int(index.nprobe),
        "file": INDEX_FILE,
        "sha256": file_sha256(path),
        "ids": "row i of items.parquet",
        "recall": {"k": k, "value": round(recall, 6), "queries": len(queries)},
        "build_seconds": round(built, 3),
    }


def load_ann_index(directory: Path, verify_checksum: bool = True) -> Any:
    """The version's faiss index with its recorded nprobe, checked against the manifest."""
    import faiss

    manifest = read_manifest(directory)
    entry = manifest.get("ann")
    if not entry:
        raise EmbeddingsContractError(f"{directory}: this version has no ANN index", "ann")
    path = Path(directory) / entry["file"]
    if verify_checksum and file_sha256(path) != entry["sha256"]:
        raise EmbeddingsContractError(
            f"{path}: sha256 differs from the manifest; refusing to load it", "checksum"
        )
    index = faiss.read_index(str(path))
    if index.d != manifest["embedding_dim"]:
        raise EmbeddingsContractError(
            f"{path}: index dim {index.d}, the manifest says {manifest['embedding_dim']}", "dim"
        )
    faiss.extract_index_ivf(index).nprobe = entry["nprobe"]
    return index
