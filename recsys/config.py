"""The one definition of the run configuration (YAML, validated with pydantic)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from recsys.errors import ConfigError

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


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
    title_column: str | None = "title"
    genres_column: str | None = "genres"
    genres_separator: str = "|"

    @field_validator("id_column", "title_column", "genres_column", mode="before")
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
    synthetic: SyntheticConfig = SyntheticConfig()

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


class ModelConfig(_Strict):
    """Two-tower model hyper-parameters."""

    embedding_dim: int = Field(64, ge=2)
    hidden_dims: list[int] = []
    temperature: float = Field(0.1, gt=0)
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
    max_title_tokens: int = Field(16, ge=1)
    # Extra hard negatives (TFRS HardNegativeMining): keep only the top-N negatives per query.
    num_hard_negatives: int | None = Field(None, ge=1)


class TrainingConfig(_Strict):
    """Optimisation settings."""

    batch_size: int = Field(1024, ge=1)
    epochs: int = Field(10, ge=1)
    optimizer: Literal["adagrad", "adam"] = "adam"
    learning_rate: float = Field(0.01, gt=0)
    shuffle_buffer: int = Field(100_000, ge=1)
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
    """SavedModel and embedding export."""

    top_k: int = Field(100, ge=1)
    verify: bool = True
    tolerance: float = Field(1e-5, gt=0)


class RecsysConfig(_Strict):
    """The whole configuration of one nightly run."""

    model_name: str = Field("recsys-default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    data: DataConfig = DataConfig()
    preprocess: PreprocessConfig = PreprocessConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    tracking: TrackingConfig = TrackingConfig()
    export: ExportConfig = ExportConfig()
    gate: GateConfig = GateConfig()

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys (MLflow params)."""
        return _flatten(self.model_dump(mode="json"))

    def digest(self) -> str:
        """A stable hash of the config: same settings, same digest."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
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
            problems.append(f"{where}: {msg}")
        raise ConfigError(f"{source}: invalid config: " + "; ".join(problems)) from None
