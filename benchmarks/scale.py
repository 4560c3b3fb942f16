"""The whole nightly at 1M / 10M / 30M interactions: cost per stage against size.

For each size a `sessions`-shaped log (recsys/synthetic.py: power-law items, ordered
sessions; 30 interactions per user on average, users = rows / 30, items = users / 5, so the
top size is 1M users x 200K items) is generated, then `recsys nightly` runs on it in a
child process: preprocess (Beam) -> train (LazyAdam, one causal pass per window of each
user's sequence record: one epoch over every training position unless `--steps` caps it)
-> evaluate (exact top-K over the whole catalog for a sample of test users, with
95% intervals) -> export (SavedModels verified in a fresh process, user/item embeddings) ->
publish (MLflow run, registry, champion/challenger gate). A monitor samples the child's
process tree every 0.25 s (/proc: resident memory summed over the tree, bytes written to
storage), and the stage boundaries come from the nightly's own log lines.

Per stage it reports wall seconds, throughput (preprocess: input rows per second of Beam's
own time; train: examples/s; evaluate: test users ranked per second; export: embeddings
written per second), peak RSS of the process tree and bytes written. Results go to a JSON
file and a PNG plot (cost vs size, log-log).

Usage (each size appends to the JSON; run the large sizes in the background):
    nice .venv/bin/python benchmarks/scale.py --sizes 1M,10M --root /tmp/scale \\
        --out benchmarks/results/scale.json --plot docs/scale.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
STAGES = ("preprocess", "train", "evaluate", "export", "publish")
DATE = "2026-01-14"  # the synthetic log's last day (start 2026-01-01, 14 days)
ROWS_PER_USER = 30
_STAGE_LINE = re.compile(r"stage (\d)/5 (\w+): (running|done in ([\d.]+) s)")


def parse_size(text: str) -> int:
    """'1M' -> 1_000_000, '300K' -> 300_000, '2500000' -> 2_500_000."""
    scale = {"K": 1_000, "M": 1_000_000, "B": 1_000_000_000}
    text = text.strip().upper()
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def synthetic_config(rows: int, vocab_rows: int | None = None) -> dict[str, Any]:
    """The generator settings for a log of about `rows` interactions.

    `vocab_rows`: users and items as for a log of that many rows, so a larger log has more
    events per user instead of more users and items (rows grow, the vocabulary does not).
    """
    users = max((vocab_rows or rows) // ROWS_PER_USER, 100)
    return {
        "shape": "sessions",
        "num_users": users,
        "num_items": max(users // 5, 20),
        "mean_interactions_per_user": max(rows // users, 1),
        "start_date": "2026-01-01",
        "days": 14,
    }


def nightly_config(log: Path, items: Path, rows: int, args: argparse.Namespace) -> dict:
    """The run configuration: the generated CSV; one epoch over every training position
    (one causal pass per sequence window) unless `--steps` sets a budget."""
    return {
        "model_name": "scale",
        "data": {
            "source": "csv",
            "path": str(log),
            "columns": {"weight": "weight"},
            "items": {"path": str(items)},
        },
        "preprocess": {"num_shards": max(1, rows // 5_000_000)},
        "training": {
            "epochs": 1,
            "max_steps_per_epoch": args.steps,
            "optimizer": "lazy_adam",
            "batch_size": args.batch_size,
            "input": "sequences",
            # The fits the published figures measured, pinned: the code's defaults are the
            # benchmarked model's (early stopping, a refit on every split).
            "learning_rate_schedule": "constant",
            "early_stopping_patience": 0,
            "refit": "off",
            "candidates": [],  # one fit: the candidates' extra first fits are not measured
            **args.training,
        },
        # The measured model: the transformer with in-batch negatives and a per-user table.
        "model": {
            "query_encoder": "transformer",
            "negatives": "in_batch",
            "user_embedding": True,
            **args.model,
        },
        "evaluation": {"ks": [10, 50, 100], "sample_users": args.eval_users},
        "export": {"top_k": 100},
    }


class TreeMonitor:
    """Samples a process tree's summed RSS and write_bytes from /proc every `period` s."""

    def __init__(self, pid: int, period: float = 0.25) -> None:
        self.pid, self.period = pid, period
        self.stage: str | None = None
        self.peak: dict[str, int] = {}
        self.written: dict[str, int] = {}
        # The machine is shared: the 1-minute load average's range while each stage ran says
        # whether a figure measured the stage or the neighbours.
        self.load: dict[str, tuple[float, float]] = {}
        self._last_written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Begin sampling in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (after one last sample)."""
        self._stop.set()
        self._thread.join()

    def enter(self, stage: str) -> None:
        """Attribute the following samples to `stage`."""
        self._sample()
        self.stage = stage

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> None:
        rss, written = 0, 0
        for pid in _tree(self.pid):
            rss += _status_kb(pid, "VmRSS") * 1024
            written += _io(pid, "write_bytes")
        stage = self.stage or "start"
        self.peak[stage] = max(self.peak.get(stage, 0), rss)
        # Children that exit take their counts with them: only increases are attributed.
        self.written[stage] = self.written.get(stage, 0) + max(written - self._last_written, 0)
        self._last_written = written
        now = os.getloadavg()[0]
        low, high = self.load.get(stage, (now, now))
        self.load[stage] = (min(low, now), max(high, now))


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _io(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def generate(rows: int, raw: Path, vocab_rows: int | None = None) -> dict[str, Any]:
    """Write the log and its item file in a child process; wall time and peak RSS."""
    raw.mkdir(parents=True, exist_ok=True)
    code = (
        "import json,sys,resource;from pathlib import Path;"
        "from recsys.core.config import SyntheticConfig;from recsys import synthetic as s;"
        "c=SyntheticConfig(**json.loads(sys.argv[1]));p=Path(sys.argv[2]);"
        "s.write_csv(c,p);s.write_items_csv(c,s.items_path(p));"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    log = raw / "log.csv"
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(synthetic_config(rows, vocab_rows)), str(log)],
        check=True,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    lines = sum(1 for _ in log.open("rb")) - 1
    return {
        "log": str(log),
        "items": str(raw / ".log.items.csv"),
        "rows": lines,
        "seconds": round(seconds, 1),
        "rows_per_second": round(lines / seconds),
        "peak_rss_mib": round(int(out.stdout.split()[-1]) / 1024),
        "bytes": log.stat().st_size,
    }


def run_nightly(config_path: Path, workdir: Path, log_path: Path) -> dict[str, Any]:
    """`recsys nightly` in a child process under the monitor; per-stage seconds, RSS, bytes."""
    cmd = [
        str(Path(sys.executable).parent / "recsys"),
        "nightly",
        "--config",
        str(config_path),
        "--workdir",
        str(workdir),
        "--date",
        DATE,
    ]
    start = time.perf_counter()
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        monitor = TreeMonitor(child.pid)
        monitor.start()
        seconds: dict[str, float] = {}
        assert child.stdout is not None
        for line in child.stdout:
            log_file.write(line)
            match = _STAGE_LINE.search(line)
            if match and match.group(3) == "running":
                monitor.enter(match.group(2))
            elif match:
                seconds[match.group(2)] = float(match.group(4))
        code = child.wait()
        monitor.stop()
    if code != 0:
        raise SystemExit(f"recsys nightly failed ({code}): see {log_path}")
    return {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "stage_seconds": seconds,
        "peak_rss": monitor.peak,
        "written": monitor.written,
        "load": monitor.load,
    }


def stage_throughput(workdir: Path) -> dict[str, dict[str, float]]:
    """Per stage the work done and its rate, from the run's own records."""
    data = workdir / "data" / DATE
    marker = json.loads((data / "_SUCCESS.preprocess").read_text())
    run = next(p for p in sorted((workdir / "runs" / DATE).iterdir()) if p.is_dir())
    train = json.loads((run / "train.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    stats = json.loads((data / "stats.json").read_text())
    users, items = stats.get("users", 0), stats.get("items", 0)
    return {
        "preprocess": {
            "rows": marker["input_rows"],
            "beam_seconds": marker["pipeline_seconds"],
            "rows_per_second": round(marker["input_rows"] / marker["pipeline_seconds"]),
        },
        "train": {
            "examples": round(train["examples_per_second"] * train["seconds"]),
            "examples_per_second": round(train["examples_per_second"]),
            "steady_examples_per_second": round(train["steady_examples_per_second"]),
        },
        "evaluate": {
            "test_users": metrics["sample"]["users"],
            "of": metrics["sample"]["of"],
            "catalog": items,
            "recall_at_10": round(metrics["model"]["recall_at_10"], 4),
            "recall_at_10_ci95": [
                round(x, 4) for x in metrics["intervals"]["model"]["recall_at_10"]
            ],
            "popularity_recall_at_10": round(metrics["baselines"]["popularity"]["recall_at_10"], 4),
        },
        "export": {
            "users": users,
            "items": items,
            **_export_steps(run),
        },
    }


def _export_steps(run: Path) -> dict[str, Any]:
    """The export stage's seconds per step (SavedModels, verify, activity, embeddings)."""
    steps = json.loads((run / "export.json").read_text()).get("seconds", {})
    out: dict[str, Any] = {"step_seconds": steps}
    per_user = steps.get("activity", 0) + steps.get("embeddings", 0)
    if per_user:
        # The steps whose cost grows with the data (the rest is per model, any size).
        out["data_steps_seconds"] = round(per_user, 1)
    return out


def _json_default(value: Any) -> Any:
    return str(value)


def run_size(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """Generate, run the nightly, collect the figures of one size."""
    root = Path(args.root) / f"{rows}"
    generated = generate(rows, root / "raw", args.vocab_rows)
    config = nightly_config(Path(generated["log"]), Path(generated["items"]), rows, args)
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    nightly = run_nightly(config_path, root / "work", root / "nightly.log")
    rates = stage_throughput(root / "work")
    stages = {}
    for stage in STAGES:
        wall = nightly["stage_seconds"].get(stage)
        entry = {
            "seconds": wall,
            "peak_rss_mib": round(nightly["peak_rss"].get(stage, 0) / 2**20),
            "written_mib": round(nightly["written"].get(stage, 0) / 2**20),
            "load_average_1min": [round(x, 2) for x in nightly["load"].get(stage, ())],
            **rates.get(stage, {}),
        }
        if stage == "evaluate" and wall:
            entry["users_per_second"] = round(entry["test_users"] / wall)
        if stage == "export" and wall:
            entry["embeddings_per_second"] = round((entry["users"] + entry["items"]) / wall)
            if entry.get("data_steps_seconds"):
                entry["embeddings_per_data_second"] = round(
                    (entry["users"] + entry["items"]) / entry["data_steps_seconds"]
                )
        stages[stage] = entry
    return {
        "target_rows": rows,
        "synthetic": synthetic_config(rows, args.vocab_rows),
        "generate": generated,
        "stages": stages,
        "nightly_wall_seconds": nightly["wall_seconds"],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "config": config,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Seconds and peak RSS per stage against rows (log-log), with a linear guide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: r["generate"]["rows"])
    rows = [r["generate"]["rows"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for stage in ("generate", *STAGES):
        if stage == "generate":
            secs = [r["generate"]["seconds"] for r in results]
            rss = [r["generate"]["peak_rss_mib"] for r in results]
        else:
            secs = [r["stages"][stage]["seconds"] for r in results]
            rss = [r["stages"][stage]["peak_rss_mib"] for r in results]
        left.plot(rows, secs, marker="o", label=stage)
        right.plot(rows, rss, marker="o", label=stage)
    if len(rows) > 1:
        first = results[0]["stages"]["preprocess"]["seconds"]
        left.plot(rows, [first * r / rows[0] for r in rows], "k:", label="linear (preprocess)")
    for ax, title, unit in ((left, "wall time", "seconds"), (right, "peak RSS", "MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("interactions in the log")
        ax.set_ylabel(unit)
        ax.set_title(f"nightly stage {title} vs size (2 shared CPU cores)")
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: list[dict[str, Any]]) -> str:
    """Per size and stage: seconds, throughput, peak RSS, MiB written."""
    lines = [
        "| rows | stage | seconds | throughput | peak RSS MiB | written MiB | load (1 min) |",
        "|---:|---|---:|---|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: r["generate"]["rows"]):
        g = r["generate"]
        lines.append(
            f"| {g['rows']:,} | generate | {g['seconds']} | {g['rows_per_second']:,} rows/s | "
            f"{g['peak_rss_mib']:,} | {g['bytes'] // 2**20:,} | |"
        )
        for stage, e in r["stages"].items():
            lines.append(
                f"| | {stage} | {e['seconds']} | {_rate(stage, e)} | {e['peak_rss_mib']:,} | "
                f"{e['written_mib']:,} | {_load(e)} |"
            )
    return "\n".join(lines)


def _load(e: dict[str, Any]) -> str:
    low_high = e.get("load_average_1min") or []
    return "-".join(f"{x:.1f}" for x in low_high)


def _rate(stage: str, e: dict[str, Any]) -> str:
    if stage == "preprocess":
        return f"{e['rows_per_second']:,} rows/s ({e['beam_seconds']:.0f} s of Beam)"
    if stage == "train":
        return f"{e['examples_per_second']:,} examples/s ({e['examples']:,} examples)"
    if stage == "evaluate":
        return f"{e['users_per_second']:,} users/s ({e['test_users']:,} x {e['catalog']:,} items)"
    if stage == "export":
        text = f"{e['embeddings_per_second']:,} embeddings/s ({e['users']:,} users)"
        if e.get("data_steps_seconds"):
            text += (
                f"; activity + embeddings {e['data_steps_seconds']} s = "
                f"{e['embeddings_per_data_second']:,}/s"
            )
        return text
    return ""


def main() -> int:
    """Run the sizes, append to the JSON, redraw the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,10M")
    parser.add_argument("--root", default="/tmp/recsys-scale", help="logs and workdirs")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/scale.json"))
    parser.add_argument("--plot", default=str(REPO / "docs/scale.png"))
    parser.add_argument(
        "--steps", type=int, default=0, help="training step budget (0: every position once)"
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="training.batch_size")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="model.key=value or training.key=value (YAML value) for the nightly's config",
    )
    parser.add_argument("--eval-users", type=int, default=100_000, help="test user sample")
    parser.add_argument(
        "--vocab-rows", type=parse_size, help="users/items as for this size (fixed vocabulary)"
    )
    parser.add_argument("--table", action="store_true", help="print --out as Markdown, run nothing")
    args = parser.parse_args()
    args.model, args.training = {}, {}
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        getattr(args, section)[name] = yaml.safe_load(value)
    out = Path(args.out)
    results = json.loads(out.read_text())["results"] if out.is_file() else []
    if args.table:
        print(markdown(results))
        return 0
    for size in args.sizes.split(","):
        rows = parse_size(size)
        result = run_size(rows, args)
        result["command"] = " ".join(sys.argv)
        results = [r for r in results if r["target_rows"] != rows] + [result]
        out.write_text(json.dumps({"results": results}, indent=2, default=_json_default) + "\n")
        print(json.dumps(result["stages"], indent=1), flush=True)
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
