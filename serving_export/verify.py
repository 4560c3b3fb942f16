"""Verify exported SavedModels the way TF Serving will see them: from disk, in a new process.

A child Python process (serving_export/reload_check.py, run by path in isolated mode) imports
only TensorFlow, loads each SavedModel with tf.saved_model.load and calls serving_default on
sample user ids, some of them unknown, each with a sample item history (empty, catalog items,
unknown items). This process compares the outputs with the in-memory model: embeddings with
`model.user_embeddings`, retrieval with a numpy brute-force top-K over
`model.item_embeddings()`. `saved_model_cli show --all` runs alongside as a second opinion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The flag must be set before TensorFlow loads, even if this module is imported first.
import recsys  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)

# isort: split
import numpy as np
import tensorflow as tf

from recsys.errors import ExportVerificationError
from recsys.model import TrainedModel
from recsys.schema import HISTORY, USER_ID
from serving_export.embeddings import output_dim
from serving_export.savedmodels import EMBEDDING, ITEM_IDS, MODEL_NAMES, QUERY, RETRIEVAL, SCORES

RELOAD_SCRIPT = Path(__file__).resolve().with_name("reload_check.py")
SAVED_MODEL_CLI = Path(sys.executable).parent / "saved_model_cli"
MAX_KNOWN_SAMPLE = 64
# Several unknown ids so that more than one OOV bucket is exercised; "" is a real request too.
UNKNOWN_USER_IDS = (*(f"__recsys_verify_unknown_{i}__" for i in range(8)), "")
RELOAD_TIMEOUT_S = 600
_INPUTS = {
    HISTORY: {"dtype": "string", "shape": [None, None]},
    USER_ID: {"dtype": "string", "shape": [None]},
}
CLI_TIMEOUT_S = 300


def verify_export(
    model: TrainedModel,
    exported: dict[str, Path],
    tolerance: float,
    sample_user_ids: Sequence[str] | None = None,
) -> dict:
    """Reload each SavedModel in a fresh process and compare it with `model`; report or raise."""
    start = time.perf_counter()
    unknown_names = sorted(set(exported) - set(MODEL_NAMES))
    if not exported or unknown_names:
        raise ValueError(f"exported must map some of {MODEL_NAMES} to dirs, got {sorted(exported)}")
    exported = {name: Path(path) for name, path in exported.items()}
    user_ids = sample_users(model, sample_user_ids)
    histories = sample_histories(model, len(user_ids))
    child, outputs, cli_notes = _run_fresh_process_checks(exported, user_ids, histories)
    # CPU on both sides: GPUs default to TF32 matmuls (~1e-3 relative error), which would
    # swamp a 1e-5 tolerance; the artifact's correctness is not a property of the hardware.
    with tf.device("/CPU:0"):
        queries = model.user_embeddings(user_ids, histories)
        items = model.item_embeddings()
    report: dict[str, Any] = {
        "tolerance": tolerance,
        "sample_users": len(user_ids),
        "unknown_sample_users": len(set(user_ids) - set(model.users)),
        "fresh_process": {key: child[key] for key in ("tensorflow", "project_modules_loaded")},
        "models": {},
    }
    problems = []
    if child["project_modules_loaded"]:
        problems.append(f"fresh process imported project modules {child['project_modules_loaded']}")
    for name, path in exported.items():
        loaded = child["models"][name]
        if name == QUERY:
            result, found = _check_query(model, queries, outputs, loaded, tolerance)
        else:
            result, found = _check_retrieval(model, queries, items, outputs, loaded, tolerance)
        cli_note, cli_problem = cli_notes[name]
        found += [cli_problem] if cli_problem else []
        report["models"][name] = {"dir": str(path), **result, "saved_model_cli": cli_note}
        if found:
            problems.append(f"{name} SavedModel at {path}: " + ", ".join(found))
    if problems:
        raise ExportVerificationError(
            f"export does not reproduce the in-memory model (tolerance {tolerance:g}): "
            + "; ".join(problems)
        )
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def _run_fresh_process_checks(
    exported: dict[str, Path], user_ids: list[str], histories: list[list[str]]
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, tuple[str, str | None]]]:
    """The reload child's report and outputs, and saved_model_cli's verdict per model.

    saved_model_cli runs concurrently with the child: each is mostly a TensorFlow import.
    """
    with tempfile.TemporaryDirectory(prefix="recsys-verify-") as tmp:
        cli = {
            name: _start_cli(path, Path(tmp) / f"{name}.cli.txt") for name, path in exported.items()
        }
        try:
            child, outputs = _reload_in_fresh_process(exported, user_ids, histories, Path(tmp))
        except BaseException:
            _kill_cli(cli.values())
            raise
        return child, outputs, {name: _finish_cli(handle) for name, handle in cli.items()}


def sample_users(model: TrainedModel, given: Sequence[str] | None = None) -> list[str]:
    """Sample ids to verify with: `given` (or up to 64 vocabulary users) plus unknown ids."""
    if given is None:
        spread = np.linspace(0, len(model.users) - 1, num=min(MAX_KNOWN_SAMPLE, len(model.users)))
        given = [model.users[i] for i in np.unique(spread.astype(np.int64))]
    vocab = set(model.users)
    return list(given) + [uid for uid in UNKNOWN_USER_IDS if uid not in vocab]


def sample_histories(model: TrainedModel, n: int) -> list[list[str]]:
    """Deterministic histories for n sample users: empty, short, over-long, with unknown ids."""
    items = model.items
    longest = model.config.history_length + 3  # longer than kept: truncation is checked too
    histories = []
    for row in range(n):
        size = (0, 1, 3, longest)[row % 4]
        history = [items[(row * 7 + j * 3) % len(items)] for j in range(size)] if items else []
        if row % 5 == 2:
            history.append(f"__recsys_verify_unknown_item_{row}__")
        histories.append(history)
    return histories


def compare_topk(
    full_scores: np.ndarray,
    item_ids: Sequence[str],
    got_ids: np.ndarray,
    got_scores: np.ndarray,
    tolerance: float,
) -> dict[str, Any]:
    """Compare an exported top-K ([n, K] ids and scores) with brute force over `full_scores`.

    Scores must match the sorted top-K scores, each returned id must carry its own score, and
    ids must equal the reference at every position whose score is more than `tolerance` away
    from its neighbours (within that, float rounding may legitimately reorder tied items).
    """
    n, k = got_scores.shape
    order = np.argsort(-full_scores, axis=1, kind="stable")[:, : k + 1]
    expected = np.take_along_axis(full_scores, order, axis=1)
    index = {item: i for i, item in enumerate(item_ids)}
    got_idx = np.array([[index.get(str(x), -1) for x in row] for row in got_ids], dtype=np.int64)
    known = got_idx >= 0
    own = np.take_along_axis(full_scores, np.where(known, got_idx, 0), axis=1)
    gaps = np.abs(np.diff(expected, axis=1)) > tolerance  # [n, width - 1], width <= k + 1
    untied = np.ones((n, k), dtype=bool)
    untied[:, 1:] &= gaps[:, : k - 1]
    untied[:, : gaps.shape[1]] &= gaps
    return {
        "max_abs_diff_scores": float(np.abs(got_scores - expected[:, :k]).max(initial=0.0)),
        "max_abs_diff_id_scores": float(np.abs(own - got_scores)[known].max(initial=0.0)),
        "unknown_item_ids": int((~known).sum()),
        "rows_with_duplicate_ids": int(sum(len(set(row.tolist())) < k for row in got_idx)),
        "topk_id_mismatches": int(((got_idx != order[:, :k]) & untied).sum()),
        "tied_positions": int((~untied).sum()),
    }


def _signature_problems(got: dict[str, Any], inputs: dict, outputs: dict) -> list[str]:
    expected = {"inputs": inputs, "outputs": outputs}
    actual = {key: got[key] for key in expected}
    return [] if actual == expected else [f"serving_default is {actual}, expected {expected}"]


def _check_query(
    model: TrainedModel,
    queries: np.ndarray,
    outputs: dict[str, np.ndarray],
    child: dict[str, Any],
    tolerance: float,
) -> tuple[dict[str, Any], list[str]]:
    """Signature and embeddings of the query model against `queries`; (report, problems)."""
    dim = output_dim(model)
    problems = _signature_problems(
        child,
        _INPUTS,
        {EMBEDDING: {"dtype": "float32", "shape": [None, dim]}},
    )
    got = outputs[f"{QUERY}.{EMBEDDING}"]
    if got.shape != queries.shape:
        problems.append(f"embedding shape {got.shape}, expected {queries.shape}")
        return {"signature": _signature(child)}, problems
    diff = float(np.abs(got - queries).max(initial=0.0))
    if not diff <= tolerance:
        problems.append(f"max abs embedding diff {diff:.3g}")
    result = {"signature": _signature(child), "max_abs_diff_embedding": diff}
    return result, problems


def _check_retrieval(
    model: TrainedModel,
    queries: np.ndarray,
    items: np.ndarray,
    outputs: dict[str, np.ndarray],
    child: dict[str, Any],
    tolerance: float,
) -> tuple[dict[str, Any], list[str]]:
    """Signature and top-K of the retrieval model against brute force; (report, problems)."""
    got_ids, got_scores = outputs[f"{RETRIEVAL}.{ITEM_IDS}"], outputs[f"{RETRIEVAL}.{SCORES}"]
    k = got_scores.shape[1] if got_scores.ndim == 2 else -1
    problems = _signature_problems(
        child,
        _INPUTS,
        {
            ITEM_IDS: {"dtype": "string", "shape": [None, k]},
            SCORES: {"dtype": "float32", "shape": [None, k]},
        },
    )
    if not 1 <= k <= len(model.items) or got_ids.shape != (len(queries), k):
        problems.append(f"K={k} outside [1, {len(model.items)}] or ids shape {got_ids.shape}")
        return {"signature": _signature(child), "k": k}, problems
    full = queries @ items.T
    stats = compare_topk(full, model.items, got_ids, got_scores, tolerance)
    diff = max(stats["max_abs_diff_scores"], stats["max_abs_diff_id_scores"])
    if not diff <= tolerance:
        problems.append(f"max abs score diff {diff:.3g}")
    counted = ("unknown_item_ids", "rows_with_duplicate_ids", "topk_id_mismatches")
    problems += [f"{stats[key]} {key.replace('_', ' ')}" for key in counted if stats[key]]
    return {"signature": _signature(child), "k": k, **stats}, problems


def _signature(child: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": child["inputs"], "outputs": child["outputs"]}


def _reload_in_fresh_process(
    exported: dict[str, Path], user_ids: list[str], histories: list[list[str]], tmp: Path
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run reload_check.py in a new interpreter; return its report and output arrays."""
    request = {
        "models": {name: str(path) for name, path in exported.items()},
        "user_ids": user_ids,
        "histories": histories,
        "outputs": str(tmp / "outputs.npz"),
        "report": str(tmp / "report.json"),
    }
    (tmp / "request.json").write_text(json.dumps(request), encoding="utf-8")
    # CPU only (exact float32, as the reference; no GPU memory taken from a training job), and
    # no Keras flag: TF Serving has no Keras, so the export must not need it.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_USE_LEGACY_KERAS", None)
    cmd = [sys.executable, "-I", str(RELOAD_SCRIPT), str(tmp / "request.json")]
    try:
        proc = subprocess.run(
            cmd,
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=RELOAD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ExportVerificationError(
            f"reloading {list(request['models'].values())} took over {RELOAD_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        raise ExportVerificationError(
            f"reloading {list(request['models'].values())} in a fresh process failed "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    with np.load(tmp / "outputs.npz", allow_pickle=False) as npz:
        outputs = {key: npz[key] for key in npz.files}
    return json.loads((tmp / "report.json").read_text(encoding="utf-8")), outputs


def _start_cli(model_dir: Path, log: Path) -> tuple[subprocess.Popen, Path] | None:
    """Start `saved_model_cli show --all` in the background; None when it is not installed."""
    if not SAVED_MODEL_CLI.is_file():
        return None
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [str(SAVED_MODEL_CLI), "show", "--dir", str(model_dir), "--all"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return proc, log


def _kill_cli(handles: Iterable[tuple[subprocess.Popen, Path] | None]) -> None:
    """Stop background saved_model_cli runs whose result is no longer needed."""
    for handle in handles:
        if handle is not None:
            handle[0].kill()
            handle[0].wait()


def _finish_cli(handle: tuple[subprocess.Popen, Path] | None) -> tuple[str, str | None]:
    """(note for the report, problem or None) once saved_model_cli has finished."""
    if handle is None:
        return f"skipped: {SAVED_MODEL_CLI} not found", None
    proc, log = handle
    try:
        proc.wait(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "timed out", f"saved_model_cli did not finish in {CLI_TIMEOUT_S} s"
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        return "failed", f"saved_model_cli exited {proc.returncode}: {text.strip()[-1000:]}"
    if "signature_def['serving_default']" not in text:
        return "no serving_default", "saved_model_cli does not list serving_default"
    return "serving_default listed", None
