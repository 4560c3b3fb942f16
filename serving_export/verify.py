"""Verify exported SavedModels the way TF Serving will see them: from disk, in a new process.

A child Python process (serving_export/reload_check.py, run by path in isolated mode) imports
only TensorFlow, loads each SavedModel with tf.saved_model.load, replays its TF Serving warmup
records and calls every signature (raw features and serialized tf.Examples) on sample inputs:
known and unknown users and items, empty/short/over-long histories, k below 1 and above the
maximum. This process compares the outputs with the in-memory model: embeddings with
`model.user_embeddings` and the candidate tower, retrieval with a numpy brute-force top-K over
`model.item_embeddings()`. `saved_model_cli show --all` runs alongside as a second opinion,
one model at a time.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The flag must be set before TensorFlow loads, even if this module is imported first.

# isort: split
import numpy as np
import tensorflow as tf

from recsys.core.children import die_with_parent
from recsys.core.errors import ExportVerificationError
from recsys.core.layout import temp_prefix
from recsys.model import TrainedModel
from serving_export import samples
from serving_export.samples import UNKNOWN_USER_IDS, sample_histories, sample_users
from serving_export.savedmodels import pad_score, signature_specs
from serving_export.signatures import (
    EMBEDDING,
    ITEM_IDS,
    MODEL_NAMES,
    PAD_ITEM_ID,
    PAD_SCORE,
    QUERY,
    RETRIEVAL,
    SCORES,
    SIGNATURES,
)

__all__ = ["UNKNOWN_USER_IDS", "sample_histories", "sample_users", "verify_export"]

RELOAD_SCRIPT = Path(__file__).resolve().with_name("reload_check.py")
SAVED_MODEL_CLI = Path(sys.executable).parent / "saved_model_cli"
RELOAD_TIMEOUT_S = 600
CLI_TIMEOUT_S = 300
# k sent for the "all" calls: far above any max_k, so the graph must clip it.
_ALL_K = 2**31 - 1


def verify_export(
    model: TrainedModel,
    exported: dict[str, Path],
    tolerance: float,
    sample_user_ids: Sequence[str] | None = None,
    max_k: int | None = None,
    expect_warmup: bool = True,
) -> dict:
    """Reload each SavedModel in a fresh process, call every signature, compare with `model`.

    Returns the report; raises ExportVerificationError naming every failing model. `max_k` is
    the configured largest k (export.top_k); when given, the retrieval width must match it.
    """
    start = time.perf_counter()
    unknown_names = sorted(set(exported) - set(MODEL_NAMES))
    if not exported or unknown_names:
        raise ValueError(f"exported must map some of {MODEL_NAMES} to dirs, got {sorted(exported)}")
    # Absolute: the fresh process and saved_model_cli run from a scratch folder of their own.
    exported = {name: Path(path).resolve() for name, path in exported.items()}
    user_ids = sample_users(model, sample_user_ids)
    histories = sample_histories(model, len(user_ids))
    item_requests = samples.sample_items(model)
    ks = samples.sample_ks(max_k or len(model.items), len(user_ids))
    calls = _calls(exported, user_ids, histories, item_requests, ks)
    child, outputs, cli_notes = _run_fresh_process_checks(exported, calls)
    # CPU on both sides: GPUs default to TF32 matmuls (~1e-3 relative error), which would
    # swamp a 1e-5 tolerance; the artifact's correctness is not a property of the hardware.
    with tf.device("/CPU:0"):
        queries = model.user_embeddings(user_ids, histories)
        items = model.item_embeddings()
        candidates = model.candidate_embeddings(item_requests.ids, item_requests.features())
    report: dict[str, Any] = {
        "tolerance": tolerance,
        "sample_users": len(user_ids),
        "unknown_sample_users": len(set(user_ids) - set(model.users)),
        "sample_items": len(item_requests.ids),
        "fresh_process": {key: child[key] for key in ("tensorflow", "project_modules_loaded")},
        "models": {},
    }
    problems = []
    if child["project_modules_loaded"]:
        problems.append(f"fresh process imported project modules {child['project_modules_loaded']}")
    specs = signature_specs(model)
    for name, path in exported.items():
        loaded = child["models"][name]
        found = _signature_problems(loaded["signatures"], specs[name])
        if name == RETRIEVAL:
            result, more = _check_retrieval(model, queries, items, outputs, ks, tolerance, max_k)
        else:
            expected = queries if name == QUERY else candidates
            result, more = _check_embeddings(name, expected, outputs, tolerance)
        found += more
        warmup = loaded["warmup"]
        if expect_warmup and not warmup["requests"]:
            found.append("no TF Serving warmup requests (assets.extra/tf_serving_warmup_requests)")
        cli_note, cli_problem = cli_notes[name]
        found += [cli_problem] if cli_problem else []
        report["models"][name] = {
            "dir": str(path),
            "signatures": loaded["signatures"],
            **result,
            "warmup_requests_replayed": warmup["requests"],
            "saved_model_cli": cli_note,
        }
        if found:
            problems.append(f"{name} SavedModel at {path}: " + ", ".join(found))
    if problems:
        raise ExportVerificationError(
            f"export does not reproduce the in-memory model (tolerance {tolerance:g}): "
            + "; ".join(problems)
        )
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def _calls(
    exported: dict[str, Path],
    user_ids: list[str],
    histories: list[list[str]],
    items: samples.ItemRequests,
    ks: list[int],
) -> list[dict[str, Any]]:
    """Every signature of every model on the samples; retrieval with all-max and mixed k."""
    calls = []
    for name in exported:
        for signature in SIGNATURES:
            variants = {"all": [_ALL_K] * len(user_ids), "mixed": ks} if name == RETRIEVAL else {}
            for variant, k in (variants or {"all": []}).items():
                inputs = samples.request_inputs(name, signature, user_ids, histories, items, k)
                calls.append(
                    {
                        "id": f"{name}.{signature}.{variant}",
                        "model": name,
                        "signature": signature,
                        "inputs": {key: _encode(value) for key, value in inputs.items()},
                    }
                )
    return calls


def _encode(value: np.ndarray) -> dict[str, Any]:
    """An input array for the child's JSON request (strings base64: tf.Examples are bytes)."""
    if value.dtype == object:
        values = [base64.b64encode(v).decode("ascii") for v in value.reshape(-1)]
        return {"dtype": "string", "shape": list(value.shape), "values": values}
    return {"dtype": value.dtype.name, "shape": list(value.shape), "values": value.ravel().tolist()}


def _run_fresh_process_checks(
    exported: dict[str, Path], calls: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, tuple[str, str | None]]]:
    """The reload child's report and outputs, and saved_model_cli's verdict per model.

    saved_model_cli runs beside the child, one model at a time (_CliChecks).
    """
    # Scratch next to the exports (the staging folder), never in the system temp folder: a
    # killed run leaves it where the next run removes it (recsys.core.layout.clean_temporaries).
    beside = Path(os.path.commonpath([str(path.parent) for path in exported.values()]))
    with tempfile.TemporaryDirectory(prefix=temp_prefix("tmp", "recsys-verify"), dir=beside) as tmp:
        cli = _CliChecks(exported, Path(tmp))
        try:
            child, outputs = _reload_in_fresh_process(exported, calls, Path(tmp))
        except BaseException:
            cli.stop()
            raise
        return child, outputs, cli.wait()


class _CliChecks:
    """`saved_model_cli show --all` for each model in turn, in a background thread.

    One process at a time: each is mostly a TensorFlow import (~0.6 GB), and three at once
    beside the reload child put ~2 GB on the export's peak at 30M interactions, for no gain in
    time (the child takes about as long as the three in a row). The thread starts and waits
    for each child itself: the kernel ties die_with_parent's signal to the forking thread.
    """

    def __init__(self, exported: dict[str, Path], tmp: Path) -> None:
        self.results: dict[str, tuple[str, str | None]] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._current: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, args=(exported, tmp), daemon=True)
        self._thread.start()

    def _run(self, exported: dict[str, Path], tmp: Path) -> None:
        try:
            for name, path in exported.items():
                if self._stop.is_set():
                    return
                handle = _start_cli(path, tmp / f"{name}.cli.txt")
                self._current = handle[0] if handle else None
                self.results[name] = _finish_cli(handle)
        except BaseException as exc:  # re-raised in the caller's thread by wait()
            self._error = exc

    def wait(self) -> dict[str, tuple[str, str | None]]:
        """Each model's (note, problem or None), once every check has finished."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.results

    def stop(self) -> None:
        """Kill the running check and start no other (the caller failed already)."""
        self._stop.set()
        if self._current is not None:
            self._current.kill()
        self._thread.join()


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


def _signature_problems(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Differences between a model's signatures as loaded and as `signature_specs` says."""
    if sorted(got) != sorted(expected):
        return [f"signatures {sorted(got)}, expected {sorted(expected)}"]
    return [
        f"{sig} is {got[sig]}, expected {expected[sig]}"
        for sig in sorted(expected)
        if got[sig] != expected[sig]
    ]


def _check_embeddings(
    name: str, expected: np.ndarray, outputs: dict[str, np.ndarray], tolerance: float
) -> tuple[dict[str, Any], list[str]]:
    """Every signature's `embedding` of a query or candidate model against `expected`."""
    problems, diffs = [], {}
    for signature in SIGNATURES:
        got = outputs[f"{name}.{signature}.all.{EMBEDDING}"]
        if got.shape != expected.shape:
            problems.append(f"{signature} embedding shape {got.shape}, expected {expected.shape}")
            continue
        diffs[signature] = float(np.abs(got - expected).max(initial=0.0))
        if not diffs[signature] <= tolerance:
            problems.append(f"{signature}: max abs embedding diff {diffs[signature]:.3g}")
    worst = max(diffs.values(), default=float("nan"))
    return {"max_abs_diff_embedding": worst, "per_signature": diffs}, problems


def _check_retrieval(
    model: TrainedModel,
    queries: np.ndarray,
    items: np.ndarray,
    outputs: dict[str, np.ndarray],
    ks: list[int],
    tolerance: float,
    max_k: int | None,
) -> tuple[dict[str, Any], list[str]]:
    """Both signatures' top-K against brute force, and mixed k against the full answer."""
    full = queries @ items.T
    problems: list[str] = []
    per_signature: dict[str, Any] = {}
    widths = set()
    for signature in SIGNATURES:
        prefix = f"{RETRIEVAL}.{signature}"
        got_ids, got_scores = outputs[f"{prefix}.all.{ITEM_IDS}"], outputs[f"{prefix}.all.{SCORES}"]
        k = got_scores.shape[1] if got_scores.ndim == 2 else -1
        widths.add(k)
        expected_k = min(max_k, len(model.items)) if max_k else None
        if not 1 <= k <= len(model.items) or got_ids.shape != (len(queries), k):
            problems.append(f"{signature}: K={k} outside [1, {len(model.items)}]")
            continue
        if expected_k is not None and k != expected_k:
            problems.append(f"{signature}: K={k} for a huge k, expected max_k {expected_k}")
        stats = compare_topk(full, model.items, got_ids, got_scores, tolerance)
        diff = max(stats["max_abs_diff_scores"], stats["max_abs_diff_id_scores"])
        if not diff <= tolerance:
            problems.append(f"{signature}: max abs score diff {diff:.3g}")
        counted = ("unknown_item_ids", "rows_with_duplicate_ids", "topk_id_mismatches")
        problems += [
            f"{signature}: {stats[key]} {key.replace('_', ' ')}" for key in counted if stats[key]
        ]
        mixed = mixed_k_problems(
            got_ids,
            got_scores,
            outputs[f"{prefix}.mixed.{ITEM_IDS}"],
            outputs[f"{prefix}.mixed.{SCORES}"],
            ks,
            pad_score(model),
        )
        problems += [f"{signature}: {p}" for p in mixed[:3]]
        per_signature[signature] = {**stats, "mixed_k_problems": len(mixed)}
    keys = ("max_abs_diff_scores", "max_abs_diff_id_scores")
    summary: dict[str, Any] = {
        "k": max(widths),
        **{key: max(s[key] for s in per_signature.values()) for key in keys if per_signature},
        "topk_id_mismatches": sum(s["topk_id_mismatches"] for s in per_signature.values()),
        "per_signature": per_signature,
    }
    return summary, problems


def mixed_k_problems(
    full_ids: np.ndarray,
    full_scores: np.ndarray,
    ids: np.ndarray,
    scores: np.ndarray,
    ks: Sequence[int],
    padding_score: float = PAD_SCORE,
) -> list[str]:
    """How a mixed-k answer departs from the all-max one: rows must be clipped prefixes.

    Row r asked for ks[r]; it must hold the first clip(ks[r], 1, K) items of the full answer
    (K its width), then padding (PAD_ITEM_ID, `padding_score`) up to the batch's widest row.
    """
    width = full_scores.shape[1]
    clipped = np.clip(np.asarray(ks), 1, width)
    expected_width = int(clipped.max(initial=1))
    if scores.shape != (len(ks), expected_width) or ids.shape != scores.shape:
        return [f"mixed k: shape {scores.shape}, expected {(len(ks), expected_width)}"]
    problems = []
    for row, k in enumerate(clipped):
        if list(ids[row, :k]) != list(full_ids[row, :k]) or not np.array_equal(
            scores[row, :k], full_scores[row, :k]
        ):
            problems.append(f"mixed k: row {row} (k={ks[row]}) is not the full answer's prefix")
        elif (ids[row, k:] != PAD_ITEM_ID).any() or (scores[row, k:] != padding_score).any():
            problems.append(f"mixed k: row {row} (k={ks[row]}) is not padded after {k}")
    return problems


def _reload_in_fresh_process(
    exported: dict[str, Path], calls: list[dict[str, Any]], tmp: Path
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run reload_check.py in a new interpreter; return its report and output arrays."""
    request: dict[str, Any] = {
        "models": {name: str(path) for name, path in exported.items()},
        "calls": calls,
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
            preexec_fn=die_with_parent(),
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
            preexec_fn=die_with_parent(),
        )
    return proc, log


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
    missing = [sig for sig in SIGNATURES if f"signature_def['{sig}']" not in text]
    if missing:
        return f"missing {missing}", f"saved_model_cli does not list {missing}"
    return f"{', '.join(SIGNATURES)} listed", None
