"""The one definition of the run configuration (YAML, validated with pydantic)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from recsys.core.errors import ConfigError
from recsys.core.redact import redact_tree

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# One folder/file name (or an MLflow name that tools may turn into one): no separators, no
# leading dot (hidden files, '.', '..'), nothing a shell or a URL would treat specially.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def safe_name(value: str) -> str:
    """`value` if it is a plain name that cannot leave a folder it is joined to; else ValueError.

    For every config value that becomes (part of) a path under the working directory; the
    message does not name the key because parse_config prefixes each problem with it.
    """
    if "\0" in value:
        problem = "contains a NUL byte"
    elif "/" in value or "\\" in value:
        problem = "contains a path separator"
    elif ".." in value:
        problem = "contains '..'"
    elif not _SAFE_NAME.match(value):
        problem = (
            "must start with a letter or digit and use only letters, digits, '.', '_' and '-' "
            "(at most 100 characters)"
        )
    else:
        return value
    raise ValueError(
        f"{value!r} {problem}; it becomes a file or folder name and must stay inside the "
        "working directory"
    )


def no_nul(value: str | None) -> str | None:
    """`value` unless it holds a NUL byte (which the OS would reject deep inside a stage)."""
    if value is not None and "\0" in value:
        # The value itself is not repeated: a path may carry credentials.
        raise ValueError("contains a NUL byte, which no file path can hold")
    return value


class _Strict(BaseModel):
    """Unknown keys are errors: a typo in a config must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ColumnMap(_Strict):
    """Which input column holds each schema field."""

    user_id: str = "user_id"
    item_id: str = "item_id"
    timestamp: str = "timestamp"
    weight: str | None = None
    event_type: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        # Headerless files name their columns "0", "1", ...: YAML `user_id: 0` means column 0.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class ItemsConfig(_Strict):
    """An optional item side file (genres, title) joined into item_features.parquet."""

    path: str | None = None
    format: Literal["csv", "jsonl", "movielens-100k", "movielens-dat", "movielens-latest"] = "csv"
    delimiter: str = ","
    header: bool = True
    encoding: str = "utf-8"
    id_column: str = "item_id"

    @field_validator("path")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    title_column: str | None = "title"
    genres_column: str | None = "genres"
    genres_separator: str = "|"

    @field_validator("id_column", "title_column", "genres_column", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class UsersConfig(_Strict):
    """An optional user side file (e.g. age, gender, occupation) -> user_features.parquet."""

    path: str | None = None
    format: Literal["csv", "jsonl", "movielens-100k", "movielens-dat"] = "csv"
    delimiter: str = ","
    header: bool = True
    encoding: str = "utf-8"
    id_column: str = "user_id"
    # Feature columns to keep, as text; None: every column but the id (header or JSON keys).
    columns: list[str] | None = None

    @field_validator("path")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("id_column", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class SyntheticConfig(_Strict):
    """The embedded default data: a deterministic log with latent tastes and power-law items."""

    num_users: int = Field(2000, ge=10)
    num_items: int = Field(1000, ge=10)
    latent_dim: int = Field(8, ge=1)
    mean_interactions_per_user: float = Field(20.0, gt=1)
    popularity_exponent: float = Field(1.0, ge=0)
    taste_strength: float = Field(3.0, ge=0)
    start_date: str = "2026-01-01"
    days: int = Field(14, ge=1)
    seed: int = 7
    item_features: bool = True

    @field_validator("start_date")
    @classmethod
    def _iso_date(cls, value: str) -> str:
        # Parsed as recsys.synthetic parses it, so anything accepted here also works there.
        try:
            dt.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"must be a date YYYY-MM-DD, got {value!r}") from None
        return value


class DataConfig(_Strict):
    """Where the raw interaction log comes from and how to read it."""

    source: Literal[
        "synthetic",
        "csv",
        "jsonl",
        "parquet",
        "movielens-100k",
        "movielens-1m",
        "movielens-10m",
        "movielens-latest",
    ] = "synthetic"
    path: str | None = None
    delimiter: str = ","
    header: bool = True
    columns: ColumnMap = ColumnMap()
    timestamp_unit: Literal["s", "ms"] = "s"
    event_types: list[str] | None = None
    items: ItemsConfig | None = None
    users: UsersConfig | None = None
    synthetic: SyntheticConfig = SyntheticConfig()

    @field_validator("path")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    @model_validator(mode="after")
    def _path_given(self) -> DataConfig:
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"data.path is required when data.source is '{self.source}'")
        return self


class PreprocessConfig(_Strict):
    """Beam job settings: split protocol, sharding, runner options."""

    min_user_interactions: int = Field(5, ge=3)
    num_shards: int = Field(1, ge=1)
    max_rejected_fraction: float = Field(0.01, ge=0, le=1)
    beam_args: list[str] = []
    history_length: int = Field(20, ge=0)
    split: Literal["leave_last_out", "time_window"] = "leave_last_out"
    eval_days: int = Field(1, ge=1)
    min_user_count: int = Field(0, ge=0)
    min_item_count: int = Field(0, ge=0)
    vocab_min_count: int = Field(1, ge=1)
    # Lower timestamp bound: older rows are rejected `before_min_timestamp`. An ISO date/time
    # (naive = UTC) or epoch seconds; max_age_days counts back from the end of the run date.
    min_timestamp: int | str | None = None
    max_age_days: int | None = Field(None, ge=1)
    # How the shard batches reach the split: "files" spills them (compressed Arrow) under the
    # output's temporary folder and shuffles only their paths, so memory stays flat with the
    # in-process runner; "beam" sends the batches through the runner's own shuffle.
    shuffle: Literal["files", "beam"] = "files"


class ModelConfig(_Strict):
    """Two-tower model hyper-parameters."""

    embedding_dim: int = Field(64, ge=2)
    hidden_dims: list[int] = []
    temperature: float = Field(0.1, gt=0)
    # L2-normalise both towers' outputs (scores are cosines in [-1, 1], scaled by 1/temperature).
    # false: raw dot products, as in the TFRS tutorial (benchmarks' equal-model comparison).
    normalize: bool = True
    logq_correction: bool = True
    remove_accidental_hits: bool = True
    l2_regularization: float = Field(0.0, ge=0)
    oov_buckets: int = Field(1, ge=1)
    # Query tower: the last `history_length` items of the user's history, mean-pooled over item
    # embeddings (0 turns history off). Shared: the candidate tower's item table is reused.
    # Same default as preprocess.history_length: serving then pools what training saw.
    history_length: int = Field(20, ge=0)
    share_item_embeddings: bool = True
    # Candidate tower: genres / title tokens from item_features.parquet when it has them.
    item_features: bool = True
    # Query tower: one token per user side feature (user_features.parquet: age bucket, gender,
    # occupation, ...) when the data has a user side file.
    user_features: bool = False
    max_title_tokens: int = Field(16, ge=1)
    # Extra hard negatives (TFRS HardNegativeMining): keep only the top-N negatives per query.
    num_hard_negatives: int | None = Field(None, ge=1)
    # How the history becomes a vector: mean pooling (order ignored) or causal self-attention
    # over the ordered history (SASRec-style; docs/TRAINING.md).
    query_encoder: Literal["mean", "transformer"] = "mean"
    encoder_layers: int = Field(2, ge=1)
    encoder_heads: int = Field(1, ge=1)
    encoder_dropout: float = Field(0.2, ge=0, lt=1)
    # Softmax negatives: the global batch's other items (in_batch), those plus a shared pool of
    # `sampled_negatives` items drawn per batch (mixed), or the whole catalog (full). Sampled
    # columns are logQ-corrected by the mixture of both samplers. `auto`: full up to
    # recsys.model.defaults.FULL_SOFTMAX_MAX_ITEMS catalog items, else mixed (logged).
    negatives: Literal["auto", "in_batch", "mixed", "full"] = "in_batch"
    sampled_negatives: int = Field(4096, ge=1)
    negative_sampler: Literal["uniform", "popularity"] = "uniform"


class TrainingConfig(_Strict):
    """Optimisation settings."""

    batch_size: int = Field(1024, ge=1)
    epochs: int = Field(10, ge=1)
    optimizer: Literal["adagrad", "adam"] = "adam"
    learning_rate: float = Field(0.01, gt=0)
    shuffle_buffer: int = Field(100_000, ge=1)
    # Keep the parsed, id-looked-up split in memory after one read and reshuffle it whole every
    # epoch (no gzip re-read, no shuffle-buffer refill). auto: when it is estimated under
    # 1 GiB and one worker trains; memory: always; none: stream the TFRecords every epoch.
    cache: Literal["auto", "memory", "none"] = "auto"
    # XLA-compile the train step. auto: on with one GPU (numeric towers, ids looked up in
    # tf.data); off on CPU, where the blocked in-batch softmax (recsys/losses.py) is faster,
    # and under several replicas, where the all_gather runs outside XLA.
    jit_compile: Literal["auto", "on", "off"] = "auto"
    # Train steps per tf.function call (fewer Python round trips; callbacks see every Nth).
    steps_per_execution: int = Field(1, ge=1)
    seed: int = 42
    # Same seed, same data order and weights (tf.data determinism + op determinism; slower).
    deterministic: bool = False
    # auto: multi_worker when TF_CONFIG names several workers, mirrored on several GPUs,
    # else one_device (docs/TRAINING.md).
    strategy: Literal["auto", "one_device", "mirrored", "multi_worker"] = "auto"
    # auto: mixed_float16 on GPUs with compute capability >= 7.0, else float32.
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = "auto"
    gpu_memory_growth: bool = True
    # Checkpoints for resuming a killed run: every N steps (0: only at epoch end).
    checkpoint_every_steps: int = Field(0, ge=0)
    # Early stopping on exact validation metrics (0: off); the best epoch's weights are kept.
    early_stopping_patience: int = Field(0, ge=0)
    early_stopping_metric: str = Field("recall_at_50", pattern=r"^(recall|ndcg|mrr)_at_\d+$")
    # A previous run's model dir (e.g. the champion's): initialise from its weights, rows
    # mapped by id when the vocabularies changed.
    warm_start_from: str | None = None

    @field_validator("warm_start_from")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)


class EvaluationConfig(_Strict):
    """Exact top-K evaluation over the whole catalog."""

    ks: list[int] = [10, 50, 100]
    ndcg_k: int = 10
    mrr_k: int = 100
    coverage_k: int = 10
    user_batch_size: int = Field(512, ge=1)

    @field_validator("ks")
    @classmethod
    def _positive_sorted(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 1 for k in ks):
            raise ValueError("evaluation.ks must be a non-empty list of positive integers")
        return sorted(set(ks))


class TrackingConfig(_Strict):
    """MLflow tracking; an empty uri means a SQLite store under the working directory."""

    uri: str | None = None
    experiment: str | None = None
    # Reachability probe of a tracking server before logging: attempts, first wait (doubles).
    retries: int = Field(4, ge=1)
    backoff_seconds: float = Field(1.0, ge=0)

    @field_validator("experiment")
    @classmethod
    def _plain_experiment(cls, value: str | None) -> str | None:
        return None if value is None else safe_name(value)


class GateConfig(_Strict):
    """Champion/challenger gate: promote only on a confident improvement without regressions."""

    primary_metric: str = "recall_at_50"
    # The challenger's mean per-user gain must be at least this AND its CI lower bound above 0.
    min_delta: float = Field(0.0, ge=0)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bootstrap_samples: int = Field(2000, ge=100)
    seed: int = 0
    # metric -> largest tolerated drop (absolute, challenger minus champion).
    guardrails: dict[str, float] = {"ndcg_at_10": 0.01, "coverage_at_10": 0.05}

    @field_validator("guardrails")
    @classmethod
    def _non_negative(cls, guardrails: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in guardrails.items() if not v >= 0}
        if bad:
            raise ValueError(f"gate.guardrails tolerances must be >= 0, got {bad}")
        return guardrails


class ExportConfig(_Strict):
    """SavedModel and embedding export (docs/SERVING.md)."""

    # The largest k a retrieval request may ask for (larger requests are clipped in the graph).
    top_k: int = Field(100, ge=1)
    verify: bool = True
    tolerance: float = Field(1e-5, gt=0)
    # TF Serving warmup requests in each SavedModel's assets.extra/.
    warmup: bool = True
    # Versions kept per model (and embeddings); the champion/challenger ones are never pruned.
    keep_versions: int = Field(5, ge=1)
    # models.config base_path prefix as TF Serving sees the export folder (e.g. "/models" in the
    # container); empty: this machine's absolute paths.
    serving_base_path: str | None = None
    # Optional approximate index over items.parquet (brute force stays the default and the
    # retrieval SavedModel is always exact): faiss IVF-Flat with inner product.
    ann: Literal["none", "faiss"] = "none"
    ann_nlist: int | None = Field(None, ge=1)
    ann_nprobe: int = Field(16, ge=1)
    ann_recall_k: int = Field(100, ge=1)


class NightlyConfig(_Strict):
    """Scheduling and retention of `recsys nightly` / `recsys backfill`."""

    # The default --date is yesterday in this IANA time zone (the business day that ended).
    timezone: str = "UTC"
    # Keep data/ and runs/ of the newest N dates (never the champion's); None keeps all.
    keep_days: int | None = Field(None, ge=1)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {value!r} (an IANA name, e.g. Europe/Paris)"
            ) from None
        return value


class RecsysConfig(_Strict):
    """The whole configuration of one nightly run."""

    model_name: str = "recsys-default"
    data: DataConfig = DataConfig()
    preprocess: PreprocessConfig = PreprocessConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    tracking: TrackingConfig = TrackingConfig()
    export: ExportConfig = ExportConfig()
    gate: GateConfig = GateConfig()
    nightly: NightlyConfig = NightlyConfig()

    @field_validator("model_name")
    @classmethod
    def _plain_model_name(cls, value: str) -> str:
        return safe_name(value)

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys (MLflow params)."""
        return _flatten(self.model_dump(mode="json"))

    def digest(self) -> str:
        """A stable hash of the config: same settings, same digest."""
        # Credentials are left out (environment-independent redaction): the digest is a public
        # tag, a guessable password must not be testable against it, and rotating a password
        # must not make a new run identity.
        dump = redact_tree(self.model_dump(mode="json"), environ={})
        canonical = json.dumps(dump, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def with_input(self, path: str | None) -> RecsysConfig:
        """A copy whose data source is the given path (the CLI's --input)."""
        if not path:
            return self
        source = self.data.source
        if source == "synthetic":
            source = "parquet" if Path(path).suffix == ".parquet" or Path(path).is_dir() else "csv"
        data = self.data.model_copy(update={"path": str(path), "source": source})
        return self.model_copy(update={"data": data})


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def load_config(path: str | Path | None = None) -> RecsysConfig:
    """Load and validate a YAML config; None means configs/default.yaml (or built-in defaults)."""
    if path is None:
        default = REPO_CONFIGS / "default.yaml"
        return load_config(default) if default.exists() else RecsysConfig()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "<config>") -> RecsysConfig:
    """Validate a config mapping, turning pydantic's report into one readable line per problem."""
    try:
        return RecsysConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<top level>"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            if err["type"] == "value_error" and "error" in err.get("ctx", {}):
                msg = str(err["ctx"]["error"])  # our validators' own words, without "Value error, "
            problems.append(f"{where}: {msg}")
        raise ConfigError(f"{source}: invalid config: " + "; ".join(problems)) from None
