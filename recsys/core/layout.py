"""The one definition of the working-directory layout (see docs/ARCHITECTURE.md).

```
<workdir>/raw/                             generated input (embedded synthetic data)
<workdir>/data/<date>/                     Beam output: {train,validation,test}-*.tfrecord.gz,
                                           sequences-*.tfrecord.gz (one record per user),
                                           vocab/{users,items}.txt, item_features.parquet,
                                           stats.json, rejected/*.jsonl, _SUCCESS (last)
<workdir>/runs/<date>/<run_id>/            model/ (weights + model.json), config.yaml,
                                           resolved_config.yaml, train.json, metrics.json,
                                           per_user_eval.parquet, history.json, _SUCCESS
<workdir>/export/<name>/<version>/         TF Serving SavedModels: query/, candidate/, retrieval/
<workdir>/export/models.config             TF Serving model_config_list (champion/challenger)
<workdir>/embeddings/<version>/            items.parquet, users.parquet, manifest.json
<workdir>/mlflow/                          default local tracking store (SQLite + artifacts)
```
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from recsys.core.errors import ConfigError, StageNotReadyError

log = logging.getLogger(__name__)

SUCCESS = "_SUCCESS"
# Prefixes of the temporary siblings that atomic writers create; never visible as outputs.
TEMP_PREFIXES = (".tmp-", ".old-", ".staging-")
# The full form of such a name, `.<kind>-<what>-pid<pid>-<8 random>` (temp_prefix): the pid
# says which process made it, so cleanup removes only what a recsys process that is gone left.
_TEMP_NAME = re.compile(r"^\.(?:tmp|old|staging)-(?:.+-)?pid(\d+)-[a-z0-9_]{8}$")
_RUN_ID = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}-[0-9a-f]{4}$")


_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # fromisoformat alone also takes 20261129
FIRST_DATE = dt.date(1970, 1, 1)
LAST_DATE = dt.date(2199, 12, 31)


SEQUENCES = "sequences"
"""Shard prefix of the per-user sequence records in `data/<date>/`
(`sequences-SSSSS-of-NNNNN.tfrecord.gz`, recsys.core.schema.SEQUENCE_FEATURES)."""


TFRECORD_SUFFIX = ".tfrecord.gz"


def shard_pattern(prefix: str) -> str:
    """The glob of one split's (or the sequence records') shards: `<prefix>-*.tfrecord.gz`."""
    return f"{prefix}-*{TFRECORD_SUFFIX}"


class DataFile(StrEnum):
    """The files of one day's preprocessed data folder (`data/<date>/`), written by preprocess.

    Names with `*` are globs of shard files (`<split>-SSSSS-of-NNNNN.tfrecord.gz`).
    """

    STATS = "stats.json"
    ITEM_FEATURES = "item_features.parquet"
    # Only with data.users (a user side file): one row of side features per user.
    USER_FEATURES = "user_features.parquet"
    TRAIN_SHARDS = "train-*.tfrecord.gz"
    VALIDATION_SHARDS = "validation-*.tfrecord.gz"
    TEST_SHARDS = "test-*.tfrecord.gz"
    SEQUENCE_SHARDS = "sequences-*.tfrecord.gz"
    VOCAB = "vocab"
    USER_VOCAB = "vocab/users.txt"
    ITEM_VOCAB = "vocab/items.txt"
    REJECTED = "rejected"


class RunFile(StrEnum):
    """The files of one training run folder (`runs/<date>/<run_id>/`)."""

    MODEL = "model"
    # Only with training.refit all: the first fit (never trained on the test split), which the
    # evaluate stage and the gate score; `model` (trained on every split) is the one served.
    EVAL_MODEL = "eval_model"
    CONFIG = "config.yaml"  # the config as given (`auto` stays auto; its digest names the run)
    # Every setting as trained, with where its value came from (recsys.core.resolve).
    RESOLVED_CONFIG = "resolved_config.yaml"
    HISTORY = "history.json"
    TRAIN = "train.json"
    METRICS = "metrics.json"
    PER_USER_EVAL = "per_user_eval.parquet"
    EXPORT = "export.json"
    EXPORT_VERSION = "export_version.json"
    NIGHTLY = "nightly.json"
    SUMMARY = "summary.md"
    PENDING = "mlflow_pending.json"
    GATE = "gate.json"
    # Written at publish: the retrieval SavedModel as an MLflow Model, the registered version.
    MLFLOW_MODEL = "mlflow_model"


class ModelFile(StrEnum):
    """The files of a saved model folder (`<run>/model/`): weights, vocabularies, config."""

    CONFIG = "model.json"
    USER_VOCAB = "users.txt"
    ITEM_VOCAB = "items.txt"


class EmbeddingsFile(StrEnum):
    """The files of one embeddings version (`embeddings/<version>/`)."""

    ITEMS = "items.parquet"
    USERS = "users.parquet"
    MANIFEST = "manifest.json"
    ANN_INDEX = "items.faiss"


class WorkdirFile(StrEnum):
    """Files at fixed places of the working directory."""

    CHAMPION = "champion.json"
    LOCK = ".recsys.lock"
    MODELS_CONFIG = "models.config"  # under export/
    STUDY_STORE = "optuna.db"  # under tune/: `recsys tune`'s default study storage (SQLite)


# The folders and files recsys writes directly under the working directory (check_links).
TOP_LEVEL = (
    "raw", "data", "runs", "export", "embeddings", "mlflow", "ab", "comparisons", "tune",
    "embeddings-export", WorkdirFile.CHAMPION, WorkdirFile.LOCK,
)  # fmt: skip


@dataclass(frozen=True)
class DataDir:
    """Typed paths of one day's preprocessed data folder."""

    path: Path

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def stats(self) -> Path:
        return self.path / DataFile.STATS

    @property
    def item_features(self) -> Path:
        return self.path / DataFile.ITEM_FEATURES

    @property
    def vocab(self) -> Path:
        return self.path / DataFile.VOCAB

    @property
    def user_vocab(self) -> Path:
        return self.path / DataFile.USER_VOCAB

    @property
    def item_vocab(self) -> Path:
        return self.path / DataFile.ITEM_VOCAB

    @property
    def rejected(self) -> Path:
        return self.path / DataFile.REJECTED


@dataclass(frozen=True)
class RunDir:
    """Typed paths of one training run folder."""

    path: Path

    def file(self, name: RunFile) -> Path:
        """The path of one declared run file."""
        return self.path / name

    @property
    def model(self) -> Path:
        return self.path / RunFile.MODEL

    @property
    def model_json(self) -> Path:
        return self.model / ModelFile.CONFIG

    @property
    def evaluated_model(self) -> Path:
        """The model the evaluate stage and the gate score: `eval_model` if the run has one."""
        separate = self.path / RunFile.EVAL_MODEL
        return separate if separate.is_dir() else self.model

    @property
    def config(self) -> Path:
        return self.path / RunFile.CONFIG

    @property
    def history(self) -> Path:
        return self.path / RunFile.HISTORY

    @property
    def train(self) -> Path:
        return self.path / RunFile.TRAIN

    @property
    def metrics(self) -> Path:
        return self.path / RunFile.METRICS

    @property
    def per_user_eval(self) -> Path:
        return self.path / RunFile.PER_USER_EVAL

    @property
    def export(self) -> Path:
        return self.path / RunFile.EXPORT

    @property
    def export_version(self) -> Path:
        return self.path / RunFile.EXPORT_VERSION

    @property
    def nightly(self) -> Path:
        return self.path / RunFile.NIGHTLY

    @property
    def summary(self) -> Path:
        return self.path / RunFile.SUMMARY


@dataclass(frozen=True)
class StageSpec:
    """What a stage reads and writes, TFX-style: declared files, not re-listed by callers.

    `writes` are there whenever the stage finished (globs: at least one file); `optional`
    are written only under some settings (data.users, training.refit all) and not checked.
    Preprocess writes into `data/<date>/`, the other stages into the run folder.
    """

    name: str
    producer: str  # the command that makes the outputs, for "run X first" messages
    reads: tuple[DataFile | RunFile, ...]
    writes: tuple[DataFile | RunFile, ...]
    optional: tuple[DataFile | RunFile, ...] = ()


_DATA = (
    DataFile.STATS,
    DataFile.ITEM_FEATURES,
    DataFile.USER_VOCAB,
    DataFile.ITEM_VOCAB,
    DataFile.TRAIN_SHARDS,
    DataFile.VALIDATION_SHARDS,
    DataFile.TEST_SHARDS,
    DataFile.SEQUENCE_SHARDS,
)

STAGE_SPECS: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec(
            "preprocess",
            "recsys preprocess",
            reads=(),
            writes=_DATA,
            optional=(DataFile.USER_FEATURES,),
        ),
        StageSpec(
            "train",
            "recsys train",
            reads=(*_DATA, DataFile.USER_FEATURES),
            writes=(
                RunFile.MODEL,
                RunFile.CONFIG,
                RunFile.RESOLVED_CONFIG,
                RunFile.HISTORY,
                RunFile.TRAIN,
            ),
            optional=(RunFile.EVAL_MODEL,),
        ),
        StageSpec(
            "evaluate",
            "recsys evaluate",
            reads=(RunFile.MODEL, RunFile.TRAIN, DataFile.ITEM_FEATURES, DataFile.SEQUENCE_SHARDS),
            writes=(RunFile.METRICS, RunFile.PER_USER_EVAL),
        ),
        StageSpec(
            "export",
            "recsys export",
            reads=(RunFile.MODEL, RunFile.TRAIN, RunFile.CONFIG, DataFile.ITEM_FEATURES),
            writes=(RunFile.EXPORT, RunFile.EXPORT_VERSION),
        ),
        StageSpec(
            "publish",
            "recsys nightly",
            reads=(
                RunFile.TRAIN,
                RunFile.CONFIG,
                RunFile.HISTORY,
                RunFile.METRICS,
                RunFile.PER_USER_EVAL,
                RunFile.EXPORT,
                DataFile.STATS,
            ),
            writes=(),
        ),
    )
}

STAGES: tuple[str, ...] = tuple(STAGE_SPECS)
"""The nightly's stages in order; each one done marks its folder `_SUCCESS.<stage>`."""


def _present(folder: Path, name: str) -> bool:
    return any(folder.glob(str(name))) if "*" in name else (folder / name).exists()


def missing_inputs(stage: str, run_dir: Path) -> list[str]:
    """The run files a stage declares it reads that `run_dir` lacks (data files not checked)."""
    spec = STAGE_SPECS[stage]
    return [str(n) for n in spec.reads if isinstance(n, RunFile) and not _present(run_dir, n)]


def missing_outputs(stage: str, folder: Path) -> list[str]:
    """The files a stage declares it writes that its output `folder` lacks: done means none."""
    return [str(name) for name in STAGE_SPECS[stage].writes if not _present(folder, name)]


def parse_date(value: str | None, timezone: str = "UTC") -> dt.date:
    """The run date from YYYY-MM-DD; None means yesterday in `timezone` (an IANA name)."""
    if value is None:
        from zoneinfo import ZoneInfo

        return (dt.datetime.now(ZoneInfo(timezone)) - dt.timedelta(days=1)).date()
    try:
        if not _ISO_DATE.fullmatch(value):
            raise ValueError(value)
        date = dt.date.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--date must be YYYY-MM-DD, got {value!r}") from None
    if not FIRST_DATE <= date <= LAST_DATE:
        raise ConfigError(
            f"--date {value} is outside {FIRST_DATE}..{LAST_DATE}: interaction times are "
            "seconds since 1970, and the run date bounds them"
        )
    return date


def end_of_day_utc(date: dt.date) -> int:
    """The first second after `date` (UTC) as a Unix timestamp: data must be strictly before."""
    nxt = dt.datetime.combine(date + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)
    return int(nxt.timestamp())


def confine(root: Path, path: Path) -> Path:
    """`path`, checked to stay inside `root`: ConfigError naming a symbolic link that leaves it.

    Every folder recsys writes into or deletes from is under the working directory; a link
    in between (`export -> /mnt/other`) would make it write, prune and clean up elsewhere.
    """
    real_root = root.resolve()
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if not current.is_symlink():
            continue
        target = current.resolve()
        if target != real_root and real_root not in target.parents:
            raise ConfigError(
                f"{current} is a symbolic link to {target}, outside the working directory "
                f"{root}: recsys writes and deletes only inside --workdir. Replace the link "
                f"with a folder (or mount the other volume at {current}) and rerun"
            )
    return path


@dataclass(frozen=True)
class Workdir:
    """Paths of every stage's inputs and outputs under one working directory.

    Each path is confined to the working directory (`confine`): none leads outside it.
    `remote` is set for a working directory in object storage: `root` is then its local copy
    (recsys.core.mirror), and `public`/`local` translate between the two.
    """

    root: Path
    remote: str | None = None

    def public(self, path: Path | str) -> str:
        """Where `path` (under root) is for everyone else: its URI in the bucket, or itself."""
        path = Path(path)
        if self.remote is None or not path.is_relative_to(self.root):
            return str(path.resolve()) if self.remote is None else str(path)
        relative = path.relative_to(self.root).as_posix()
        return self.remote if relative == "." else f"{self.remote}/{relative}"

    def serving_base(self, configured: str | None) -> str | None:
        """models.config's base path: export.serving_base_path, else the bucket's export/."""
        return configured or (f"{self.remote}/export" if self.remote is not None else None)

    def local(self, ref: str) -> Path:
        """The local path of something `public` named (a URI inside this workdir, or a path)."""
        if self.remote is not None and (ref == self.remote or ref.startswith(self.remote + "/")):
            parts = [p for p in ref[len(self.remote) :].split("/") if p]
            if ".." in parts:
                raise ConfigError(f"{ref}: '..' has no meaning in an object storage path")
            return self.path(*parts)
        return Path(ref)

    def path(self, *parts: str) -> Path:
        """`root/parts...`, refused (ConfigError) if a symbolic link leads outside the root."""
        return confine(self.root, self.root.joinpath(*parts))

    def check_links(self) -> None:
        """Refuse a working directory whose own folders link outside it (before any write)."""
        for name in TOP_LEVEL:
            folder = self.path(name)
            if name in ("data", "runs", "export", "embeddings") and folder.is_dir():
                for child in folder.iterdir():
                    confine(self.root, child)

    def raw(self) -> Path:
        return self.path("raw")

    def data(self, date: dt.date) -> Path:
        return self.path("data", date.isoformat())

    def runs(self, date: dt.date) -> Path:
        return self.path("runs", date.isoformat())

    def run(self, date: dt.date, run_id: str) -> Path:
        if not _RUN_ID.match(run_id):
            raise ConfigError(
                f"not a run id: {run_id!r} (expected e.g. 20260101T000000Z-0a1b2c3d-9f8e)"
            )
        return self.path("runs", date.isoformat(), run_id)

    def latest_run(self, date: dt.date) -> Path:
        """The newest finished training run for a date."""
        runs = sorted(p for p in self.runs(date).glob("*") if is_complete(p))
        if not runs:
            raise StageNotReadyError(
                f"no finished training run under {self.runs(date)}: run `recsys train` first"
            )
        return runs[-1]

    def export_root(self) -> Path:
        """`export/`: the TF Serving model bases and models.config."""
        return self.path("export")

    def export(self, name: str) -> Path:
        return self.path("export", name)

    def embeddings_root(self) -> Path:
        """`embeddings/`: one folder per export version."""
        return self.path("embeddings")

    def embeddings(self, version: int) -> Path:
        return self.path("embeddings", str(version))

    def mlflow_store(self) -> Path:
        return self.path("mlflow")

    def tune(self, date: dt.date) -> Path:
        """`recsys tune`'s folder for a date: its data and the written winner."""
        return self.root / "tune" / date.isoformat()

    def study_store(self) -> Path:
        """The default Optuna storage (SQLite) of every search run in this working directory."""
        return self.root / "tune" / WorkdirFile.STUDY_STORE

    def champion_file(self) -> Path:
        return self.path(WorkdirFile.CHAMPION)

    def models_config(self) -> Path:
        return self.path("export", WorkdirFile.MODELS_CONFIG)


# The folders published whole (locally by one rename, in a bucket with a commit marker):
# top-level folder -> depth of its version folders, e.g. runs/<date>/<run_id> is 3.
VERSION_DEPTHS = {"data": 2, "runs": 3, "export": 3, "embeddings": 2, "tune": 3}


def version_folder(relative: str) -> str | None:
    """The version folder (relative, `/`-separated) a workdir file belongs to; None if none.

    `data/<date>`, `runs/<date>/<run_id>`, `export/<model>/<int>`, `embeddings/<int>` and
    `recsys tune`'s `tune/<date>/data-<digest>`; hidden names (checkpoints, temporaries,
    `export/.checksums`) are never part of one.
    """
    parts = relative.split("/")
    depth = VERSION_DEPTHS.get(parts[0])
    if depth is None or len(parts) <= depth or any(p.startswith(".") for p in parts[1:depth]):
        return None
    last = parts[depth - 1]
    if parts[0] in ("export", "embeddings") and not last.isdigit():
        return None
    if parts[0] == "tune" and not last.startswith("data-"):
        return None
    return "/".join(parts[:depth])


def new_run_id(config_digest: str) -> str:
    """A sortable, unique run id: UTC start time, the config digest's prefix, a random tag."""
    return f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{config_digest[:8]}-{uuid.uuid4().hex[:4]}"


def is_complete(stage_dir: Path) -> bool:
    """A stage's output is complete only when its _SUCCESS marker exists."""
    return (stage_dir / SUCCESS).is_file()


def require_complete(stage_dir: Path, producer: str) -> Path:
    """Return `stage_dir` or raise a StageNotReadyError naming the command that makes it."""
    if not is_complete(stage_dir):
        raise StageNotReadyError(
            f"{stage_dir} is not complete (no {SUCCESS}): run `{producer}` first"
        )
    return stage_dir


def mark_complete(stage_dir: Path) -> None:
    """Write the _SUCCESS marker; always the last file a stage writes."""
    (stage_dir / SUCCESS).write_text(dt.datetime.now(dt.UTC).isoformat() + "\n")


def stage_marker(folder: Path, stage: str) -> Path:
    """The marker a nightly stage writes into its output folder when it finished."""
    return folder / f"{SUCCESS}.{stage}"


def temp_prefix(kind: str, what: str) -> str:
    """The start of a temporary name this process makes: `.<kind>-<what>-pid<pid>-`.

    `kind` is tmp, old or staging; 8 random characters complete the name (temp_name, or
    tempfile's own). Only names of this form are ever cleaned up (clean_temporaries).
    """
    if f".{kind}-" not in TEMP_PREFIXES:
        raise ValueError(f"temporary kind {kind!r} is not one of {TEMP_PREFIXES}")
    return f".{kind}-{what}-pid{os.getpid()}-"


def temp_name(kind: str, what: str) -> str:
    """A fresh temporary name of this process (temp_prefix + 8 random hex digits)."""
    return temp_prefix(kind, what) + uuid.uuid4().hex[:8]


def left_by_dead_process(path: Path, files: bool = False) -> bool:
    """A temporary folder (with `files`, or file) of recsys's own naming whose process is
    gone (or is this one).

    Anything else (a look-alike name, a symbolic link, a live process's folder) is not ours
    to delete.
    """
    match = _TEMP_NAME.match(path.name)
    if match is None or path.is_symlink() or not (path.is_dir() or (files and path.is_file())):
        return False
    pid = int(match.group(1))
    return pid == os.getpid() or not process_alive(pid)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def clean_temporaries(root: Path) -> list[Path]:
    """Remove temporary folders that killed recsys processes left (callers hold the lock).

    Only recsys's own temporary names (temp_prefix) whose process is gone, one or two
    levels under data/, runs/, export/ and embeddings/, never through a symbolic link.
    """
    removed = []
    for name in ("data", "runs", "export", "embeddings"):
        parent = root / name
        if parent.is_symlink() or not parent.is_dir():
            continue
        children = [d for d in parent.iterdir() if d.is_dir() and not d.is_symlink()]
        for path in [*children, *(p for d in children for p in d.iterdir())]:
            if left_by_dead_process(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        log.info("removed %d temporary folders left by an interrupted run", len(removed))
    return removed


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder, renamed onto `target` only if the block succeeds.

    A reader never sees a half-written folder: either the old one (replaced whole) or the new.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name("tmp", target.name)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(source: Path, target: Path) -> Path:
    """Move the finished folder `source` onto `target` by rename; an existing one goes whole.

    The old folder is renamed away first, so a reader sees the old folder or the new one,
    and for one instant none: never a mix.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        trash = target.parent / temp_name("old", target.name)
        os.replace(target, trash)
        os.replace(source, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(source, target)
    return target


def next_version(base: Path) -> int:
    """The next integer version under a TF Serving model base (highest existing + 1)."""
    versions = [int(p.name) for p in base.glob("*") if p.name.isdigit()] if base.exists() else []
    return max(versions, default=0) + 1
