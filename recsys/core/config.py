"""The one definition of the run configuration (YAML, validated with pydantic)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from recsys.core import storage
from recsys.core.errors import ConfigError
from recsys.core.redact import redact_tree

# Upper bounds of sizes and counts: far above any real run on one machine or cluster, low
# enough that a typo (an extra zero, `1e9`) is a config error and not a stage that allocates
# for minutes and dies. Training also checks its estimated memory (recsys.training.memory).
MAX_ROWS = 10**9  # users, items, interactions, shuffle buffers
MAX_DIM = 8192  # embedding and hidden layer widths
MAX_BATCH = 1 << 20
MAX_K = 10_000  # top-K cut-offs
MAX_COUNT = 100_000  # epochs, shards, patience, list lengths and similar counts
MAX_CANDIDATES = 4
MEAN_POOLING_CANDIDATE: dict[str, bool | int | float | str] = {
    "model.query_encoder": "mean",
    "model.history_mean": False,
    # An order-free mean gains from every item of the history: 50 beat 20 on validation of
    # both order-free benchmark logs (docs/TRAINING.md, "Candidate settings").
    "model.history_length": 50,
}
WIDE_MEAN_CANDIDATE: dict[str, bool | int | float | str] = {
    **MEAN_POOLING_CANDIDATE,
    "model.embedding_dim": 256,
}
DEFAULT_CANDIDATES = (MEAN_POOLING_CANDIDATE, WIDE_MEAN_CANDIDATE)
"""The default candidates: where a log's order carries little signal (shuffled, visits) the
order-free mean query tower over the last 50 items wins on validation; where it carries
signal, the transformer. The wide one wins on large sparse catalogs (12K items, 8 events a
user), the narrow one on small logs, where 256 dimensions score lower (docs/TRAINING.md)."""
FIXED_FOR_CANDIDATES = frozenset(
    {
        "model.oov_buckets",
        "training.candidates",
        "training.candidates_prune_after",
        "training.early_stopping_metric",
        "training.early_stopping_patience",
        "training.input",
        "training.mode",
        "training.refit",
        "training.refit_continue_epochs",
        "training.warm_start_from",
        "training.strategy",
        "training.precision",
        "training.jit_compile",
        "training.seed",
    }
)
"""What every candidate of `training.candidates` shares: the validation score they are compared
on, and the data, device and schedule of the run they belong to."""
MAX_SEED = 2**32 - 1
MAX_SECONDS = 30 * 24 * 3600  # time budgets: a month (a search or a wait longer is a typo)
MAX_WORKERS = 256  # parallel processes of one command
MAX_SYNTHETIC_ROWS = 100_000_000  # the embedded demo log is written as one CSV
MAX_CONFIG_DEPTH = 20  # nesting levels of the YAML; the schema itself needs 4

# One folder/file name (or an MLflow name that tools may turn into one): no separators, no
# leading dot (hidden files, '.', '..'), nothing a shell or a URL would treat specially.
_NUMBER_LIKE = re.compile(r"[0-9eE.+_-]{1,40}")
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


def _column_name(value: Any) -> Any:
    # Headerless files name their columns "0", "1", ...: YAML `user_id: 0` means column 0.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class ColumnMap(_Strict):
    """Which input column holds each schema field (a name, or an index for headerless files)."""

    user_id: str = Field("user_id", description="Column of the user id.")
    item_id: str = Field("item_id", description="Column of the item id.")
    timestamp: str = Field(
        "timestamp", description="Column of the event time (see data.timestamp_unit)."
    )
    weight: str | None = Field(
        None, description="Column of a per-event weight (e.g. a rating); null: every event 1."
    )
    event_type: str | None = Field(
        None, description="Column of the event type (click, purchase, ...); null: none."
    )

    @field_validator("*", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        return _column_name(value)


class ItemsConfig(_Strict):
    """An optional item side file (genres, title) joined into item_features.parquet."""

    path: str | None = Field(None, description="The item file (local path or URI).")
    format: Literal["csv", "jsonl", "movielens-100k", "movielens-dat", "movielens-latest"] = Field(
        "csv", description="Its layout; the MovieLens ones need no further settings."
    )
    delimiter: str = Field(",", description="Field separator of a CSV file.")
    header: bool = Field(True, description="Whether a CSV file's first line names its columns.")
    encoding: str = Field("utf-8", description="Text encoding of the file.")
    id_column: str = Field("item_id", description="Column of the item id.")
    title_column: str | None = Field("title", description="Column of the title; null: none.")
    genres_column: str | None = Field("genres", description="Column of the genres; null: none.")
    genres_separator: str = Field("|", description="Separator between genres in one field.")
    merge_rows: bool = Field(
        False,
        description="Rows that repeat an item id add their genres to the item's (a file with "
        "one row per item and attribute, e.g. item_id,attribute_id); false: the smallest row "
        "of a repeated id is kept.",
    )

    @field_validator("path")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("id_column", "title_column", "genres_column", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        return _column_name(value)


class UsersConfig(_Strict):
    """An optional user side file (e.g. age, gender, occupation) -> user_features.parquet."""

    path: str | None = Field(None, description="The user file (local path or URI).")
    format: Literal["csv", "jsonl", "movielens-100k", "movielens-dat"] = Field(
        "csv", description="Its layout; the MovieLens ones need no further settings."
    )
    delimiter: str = Field(",", description="Field separator of a CSV file.")
    header: bool = Field(True, description="Whether a CSV file's first line names its columns.")
    encoding: str = Field("utf-8", description="Text encoding of the file.")
    id_column: str = Field("user_id", description="Column of the user id.")
    columns: list[str] | None = Field(
        None,
        description="Feature columns to keep, as text; null: every column but the id (the "
        "header's or the JSON keys).",
    )

    @field_validator("path")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("id_column", mode="before")
    @classmethod
    def _index_as_name(cls, value: Any) -> Any:
        return _column_name(value)


class SyntheticConfig(_Strict):
    """The embedded default data: a deterministic log with latent tastes and power-law items."""

    num_users: int = Field(2000, ge=10, le=100_000_000, description="Users in the log.")
    num_items: int = Field(1000, ge=10, le=100_000_000, description="Items in the catalog.")
    latent_dim: int = Field(8, ge=1, le=1024, description="Dimensions of the latent tastes.")
    mean_interactions_per_user: float = Field(
        20.0, gt=1, le=100_000, description="Mean events per user."
    )
    popularity_exponent: float = Field(
        1.0, ge=0, le=10, description="Power-law exponent of item popularity (0: uniform)."
    )
    taste_strength: float = Field(
        3.0, ge=0, le=1000, description="How strongly a user's taste outweighs popularity."
    )
    start_date: str = Field("2026-01-01", description="First day of the log (YYYY-MM-DD).")
    days: int = Field(14, ge=1, le=36_500, description="Days the log spans.")
    seed: int = Field(7, ge=0, le=MAX_SEED, description="Random seed: same seed, same log.")
    item_features: bool = Field(
        True,
        description="Also write an item file (title, 1-3 genres) next to the log and join it.",
    )
    shape: Literal["taste", "sessions"] = Field(
        "taste",
        description="taste: every user scores the whole catalog (users x items work, "
        "vectorised in blocks of users for large logs; the default data). sessions: for logs "
        "of millions of rows without that work: sessions on one topic each, whose items "
        "follow one another in a fixed order (recsys/synthetic.py).",
    )
    topics: int = Field(32, ge=1, description="sessions: number of topics.")
    mean_session_length: float = Field(5.0, ge=1, description="sessions: mean events a session.")
    sequential_probability: float = Field(
        0.6,
        ge=0,
        le=1,
        description="sessions: probability that the next event is the topic's next item.",
    )

    @field_validator("start_date")
    @classmethod
    def _iso_date(cls, value: str) -> str:
        # Parsed as recsys.synthetic parses it, so anything accepted here also works there.
        try:
            dt.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"must be a date YYYY-MM-DD, got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _writable_size(self) -> SyntheticConfig:
        rows = self.num_users * self.mean_interactions_per_user
        if rows > MAX_SYNTHETIC_ROWS:
            raise ValueError(
                f"num_users {self.num_users} x mean_interactions_per_user "
                f"{self.mean_interactions_per_user:g} = {rows:,.0f} interactions, above the "
                f"{MAX_SYNTHETIC_ROWS:,} the synthetic generator writes; lower num_users"
            )
        return self


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
    ] = Field(
        "synthetic",
        description="The log's format; synthetic: generated by recsys itself (data.synthetic).",
    )
    path: str | None = Field(
        None, description="The log (file, folder or URI); required unless source is synthetic."
    )
    delimiter: str = Field(",", description="Field separator of a CSV log.")
    header: bool = Field(True, description="Whether a CSV log's first line names its columns.")
    columns: ColumnMap = Field(ColumnMap(), description="Which column holds each field.")
    timestamp_unit: Literal["s", "ms"] = Field(
        "s", description="Unit of numeric timestamps (epoch seconds or milliseconds)."
    )
    multiline_fields: bool = Field(
        False,
        description="Let a quoted field span lines. Off, as interaction logs are line-oriented: "
        "one stray quote then spoils one row, not every line up to the next quote.",
    )
    event_types: list[str] | None = Field(
        None, description="Event types kept (needs data.columns.event_type); null: all."
    )
    items: ItemsConfig | None = Field(None, description="An item side file; null: none.")
    users: UsersConfig | None = Field(None, description="A user side file; null: none.")
    synthetic: SyntheticConfig = Field(
        SyntheticConfig(), description="The generated log (source synthetic)."
    )

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

    min_user_interactions: int = Field(
        5,
        ge=3,
        le=MAX_COUNT,
        description="Users with fewer events are train-only (no validation or test item).",
    )
    num_shards: int = Field(1, ge=1, le=4096, description="TFRecord files per split.")
    max_rejected_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        description="The job fails when more than this share of rows is bad (rejected/ keeps "
        "them).",
    )
    max_duplicate_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Exact repeats of a valid event (at-least-once delivery) are not bad rows: "
        "they are dropped and held to this limit of their own.",
    )
    beam_args: list[str] = Field([], description="Extra Beam pipeline options.")
    history_length: int = Field(
        20,
        ge=0,
        le=MAX_K,
        description="Events of history written with each example (at least model.history_length).",
    )
    split: Literal["leave_last_out", "time_window"] = Field(
        "leave_last_out",
        description="leave_last_out: each user's last event is test, the one before "
        "validation; time_window: the last eval_days days before the run date's end are test, "
        "the eval_days before them validation.",
    )
    eval_days: int = Field(1, ge=1, le=36_500, description="time_window: days of the test split.")
    min_user_count: int = Field(
        0, ge=0, le=MAX_ROWS, description="Reject users with fewer events (0: keep all)."
    )
    min_item_count: int = Field(
        0, ge=0, le=MAX_ROWS, description="Reject events of items with fewer events (0: keep all)."
    )
    vocab_min_count: int = Field(
        1,
        ge=1,
        le=MAX_ROWS,
        description="Ids seen fewer times stay out of the vocabulary (they share the OOV rows).",
    )
    min_timestamp: int | str | None = Field(
        None,
        description="Lower timestamp bound: older rows are rejected `before_min_timestamp`. An "
        "ISO date/time (naive = UTC) or epoch seconds.",
    )
    max_age_days: int | None = Field(
        None,
        ge=1,
        le=36_500,
        description="Reject rows older than this many days before the end of the run date.",
    )
    shuffle: Literal["files", "beam"] = Field(
        "files",
        description="How the shard batches reach the split: files spills them (compressed "
        "Arrow) under the output's temporary folder and shuffles only their paths, so memory "
        "stays flat with the in-process runner; beam sends them through the runner's shuffle.",
    )
    runner: Literal["direct", "dask", "dataflow", "flink", "spark"] = Field(
        "direct",
        description="Where the job runs (docs/PREPROCESSING.md, Runners): direct in this "
        "process; dask on a dask.distributed cluster at runner_address (none: a local one, a "
        "worker per core); dataflow, flink, spark on Beam's runners, configured further "
        "through beam_args.",
    )
    runner_address: str | None = Field(
        None,
        description="The cluster: a Dask scheduler (tcp://host:8786), a Flink master "
        "(host:8081), a Spark master URL (spark://host:7077). Not used by direct and dataflow.",
    )

    @model_validator(mode="after")
    def _one_runner(self) -> PreprocessConfig:
        if self.runner_address and self.runner in ("direct", "dataflow"):
            raise ValueError(
                f"preprocess.runner_address is for dask, flink or spark, not {self.runner!r}"
                " (Dataflow takes --project and --region in beam_args)"
            )
        if self.runner != "direct" and any(a.startswith("--runner") for a in self.beam_args):
            raise ValueError(
                f"preprocess.beam_args names a --runner while preprocess.runner is "
                f"{self.runner!r}: set the runner in one place"
            )
        return self


class ModelConfig(_Strict):
    """Two-tower model hyper-parameters."""

    embedding_dim: int = Field(
        64, ge=2, le=MAX_DIM, description="Width of the embeddings and of both towers' output."
    )
    hidden_dims: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] = Field(
        [], max_length=16, description="Hidden layer widths of each tower's MLP (none: no MLP)."
    )
    temperature: float = Field(
        0.1, gt=0, le=1000, description="Scores are divided by it before the softmax."
    )
    normalize: bool = Field(
        True,
        description="L2-normalise both towers' outputs (scores are cosines scaled by "
        "1/temperature); false: raw dot products, as in the TFRS tutorial.",
    )
    logq_correction: bool = Field(
        True, description="Subtract each sampled negative's log sampling probability."
    )
    remove_accidental_hits: bool = Field(
        True, description="Mask negatives that are the query's own positive item."
    )
    l2_regularization: float = Field(
        0.0, ge=0, le=1000, description="L2 penalty on the embedding tables."
    )
    oov_buckets: int = Field(
        1, ge=1, le=1_000_000, description="Embedding rows shared by ids outside the vocabulary."
    )
    history_length: int = Field(
        20,
        ge=0,
        le=MAX_K,
        description="Query tower: the user's last N items, encoded by query_encoder (0: no "
        "history). Same default as preprocess.history_length, so serving encodes what "
        "training saw.",
    )
    share_item_embeddings: bool = Field(
        True, description="The history is embedded with the candidate tower's item table."
    )
    user_embedding: bool | Literal["auto"] = Field(
        "auto",
        description="Query tower: a learned vector per user id, added to the history's "
        "encoding. Off, the query is a function of the history (and user features) alone, as "
        "in SASRec: no per-user table to overfit on logs with few events per user, and a new "
        "user's history is enough to serve. auto: decided by the data (see the auto rules).",
    )
    item_features: bool = Field(
        True,
        description="Candidate tower: genre and title tokens, when item_features.parquet has them.",
    )
    user_features: bool = Field(
        False,
        description="Query tower: one token per user side feature (user_features.parquet: age "
        "bucket, gender, occupation, ...) when the data has a user side file.",
    )
    max_title_tokens: int = Field(16, ge=1, le=1024, description="Title tokens kept per item.")
    num_hard_negatives: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="Keep only the top-N negatives per query (TFRS HardNegativeMining); null: all.",
    )
    query_encoder: Literal["mean", "transformer", "gru"] = Field(
        "transformer",
        description="How the history becomes a vector: mean pooling (order ignored), causal "
        "self-attention over the ordered history (SASRec-style) or a GRU over it "
        "(GRU4Rec-style); docs/TRAINING.md.",
    )
    encoder_layers: int = Field(
        2, ge=1, le=64, description="Transformer layers (the GRU is one layer)."
    )
    encoder_heads: int = Field(1, ge=1, le=64, description="Transformer attention heads.")
    encoder_dropout: float = Field(
        0.2, ge=0, lt=1, description="Dropout of the transformer, and of the GRU's inputs."
    )
    history_mean: bool = Field(
        True,
        description="transformer / gru: also add the mean of the history's item vectors to "
        "the encoder's output, an order-free summary of the user's taste beside the ordered "
        "one (for logs whose order carries little signal; docs/TRAINING.md).",
    )
    encoder_positions: Literal["absolute", "relative"] = Field(
        "relative",
        description=(
            "transformer: how attention knows order. absolute: a learned vector per window "
            "slot added to the items; relative: a learned bias per head and distance t - s "
            "added to the attention scores, so a position's output depends on how far back "
            "each item is, the same inside a training window as at the end of a served "
            "history (recsys/model/attention.py)."
        ),
    )
    negatives: Literal["auto", "in_batch", "mixed", "full", "sampled"] = Field(
        "auto",
        description="Softmax negatives: the global batch's other items (in_batch), those plus "
        "a shared pool of sampled_negatives items drawn per batch (mixed), or the whole "
        "catalog (full). Sampled columns are logQ-corrected by the mixture of both samplers. "
        "sampled: each position against its own item and the shared pool only (sampled "
        "softmax; cost independent of the catalog and the batch; recsys/model/negatives.py). "
        "auto: decided by the catalog size (see the auto rules).",
    )
    sampled_negatives: int = Field(
        4096, ge=1, le=MAX_BATCH, description="mixed: size of the shared sampled pool."
    )
    negative_sampler: Literal["uniform", "popularity"] = Field(
        "uniform", description="mixed: how the pool is drawn from the catalog."
    )


REFIT_SPLITS: dict[str, tuple[str, ...]] = {
    "off": (),
    "validation": ("train", "validation"),
    "all": ("train", "validation", "test"),
    "continue": ("train", "validation", "test"),
}
"""`training.refit` -> the splits the served model is refitted on."""


class TrainingConfig(_Strict):
    """Optimisation settings."""

    input: Literal["sequences", "rows"] = Field(
        "sequences",
        description=(
            "What one training step reads. sequences: windows of each user's sequence "
            "records, every position trained in one causal pass of the query tower "
            "(recsys/training/windows.py). rows: one example per interaction row with its "
            "stored history (preprocess.history_length must cover model.history_length, "
            "candidates' included), "
            "each history encoded on its own: the per-prefix path, kept as a reference."
        ),
    )
    window_stride: int = Field(
        0,
        ge=0,
        le=MAX_K,
        description=(
            "sequences: targets between consecutive windows of model.history_length "
            "positions (0: the window length, non-overlapping windows). Smaller strides "
            "give each trained position more history for more encoder work."
        ),
    )
    windows: Literal["all", "last"] = Field(
        "all",
        description=(
            "sequences: train every position (all), or only each user's newest window "
            "(last: the SASRec recipe; older positions are never trained)."
        ),
    )
    mode: Literal["full", "incremental"] = Field(
        "full",
        description=(
            "full: train on every position of the data. incremental (training.input "
            "sequences): start from the champion's weights and train only the positions "
            "newer than the champion's data, plus a replay sample of older ones "
            "(replay_fraction); the first night, with no champion, trains in full."
        ),
    )
    replay_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description=(
            "incremental: the share of older positions trained again beside the new ones "
            "(a fresh uniform sample each night), against forgetting."
        ),
    )
    batch_size: int = Field(1024, ge=1, le=MAX_BATCH, description="Examples per step.")
    epochs: int = Field(
        10,
        ge=1,
        le=MAX_COUNT,
        description="Passes over the train split (early stopping may end sooner).",
    )
    max_steps_per_epoch: int = Field(
        0,
        ge=0,
        le=MAX_ROWS,
        description="A step budget: at most this many batches per epoch (and per validation "
        "pass); 0: the whole split. For logs too large to pass over nightly.",
    )
    optimizer: Literal["adagrad", "adam", "lazy_adam"] = Field(
        "lazy_adam",
        description="lazy_adam: Adam whose embedding-table steps touch only the batch's rows "
        "(per-step cost independent of the vocabulary); adam: tf_keras Adam, which updates "
        "every row of every table each step.",
    )
    learning_rate: float = Field(0.01, gt=0, le=100, description="The optimizer's step size.")
    learning_rate_schedule: Literal["auto", "constant", "cosine"] = Field(
        "auto",
        description="constant: learning_rate throughout. cosine: decays from learning_rate to "
        "0 along a half cosine over `epochs` epochs of each fit (a refit that stops earlier "
        "keeps its first epochs' rates). auto: decided by the data (see the auto rules).",
    )
    shuffle_buffer: int = Field(
        100_000, ge=1, le=MAX_ROWS, description="Examples shuffled at once when streaming."
    )
    cache: Literal["auto", "memory", "none"] = Field(
        "auto",
        description="Keep the parsed, id-looked-up split in memory after one read and reshuffle "
        "it whole every epoch (memory), or stream the TFRecords every epoch (none). auto: see "
        "the auto rules.",
    )
    jit_compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="XLA-compile the train step. auto: decided by the devices (see the auto "
        "rules).",
    )
    steps_per_execution: int = Field(
        1,
        ge=1,
        le=MAX_COUNT,
        description="Train steps per tf.function call (fewer Python round trips; callbacks see "
        "every Nth).",
    )
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seed of weights and data order.")
    deterministic: bool = Field(
        False,
        description="Same seed, same data order and weights (tf.data and op determinism; slower).",
    )
    strategy: Literal["auto", "one_device", "mirrored", "multi_worker", "parameter_server"] = Field(
        "auto",
        description="The device layout (docs/TRAINING.md). parameter_server: TF_CONFIG "
        "names a chief, workers and ps tasks; variables of at least ps_min_shard_bytes are "
        "split over the ps tasks. auto: see the auto rules.",
    )
    ps_min_shard_bytes: int = Field(
        256 << 10, ge=1, description="parameter_server: variables this large are split."
    )
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = Field(
        "auto", description="Floating-point policy of the towers. auto: see the auto rules."
    )
    gpu_memory_growth: bool = Field(
        True, description="Allocate GPU memory as needed, not the whole card at start."
    )
    checkpoint_every_steps: int = Field(
        0,
        ge=0,
        le=MAX_ROWS,
        description="Checkpoints for resuming a killed run: every N steps (0: at each epoch's "
        "end only).",
    )
    early_stopping_patience: int = Field(
        2,
        ge=0,
        le=MAX_COUNT,
        description="Stop after this many epochs without a gain in early_stopping_metric on "
        "the validation split and keep the best epoch's weights (0: off).",
    )
    refit: Literal["off", "validation", "all", "continue"] = Field(
        "all",
        description="After the first fit chose its epoch count on the validation split, train "
        "a fresh model (same seed) that many epochs on more of the data and serve it, so each "
        "user's newest events reach the model. validation (or true): on train + validation; "
        "that model is also the one evaluated. all: on train + validation + test; the first "
        "fit is then the evaluation model (<run>/eval_model), scored by the evaluate stage "
        "and the gate. continue (training.input sequences): the first fit itself trains on for "
        "refit_continue_epochs more epochs (at a tenth of the learning rate) on the "
        "validation and test positions only (each with the history before it), from its own "
        "weights; the first fit is the evaluation model, as for all. off (or false): the "
        "first fit is served. A refit (all, validation) costs about a second fit.",
    )
    refit_continue_epochs: int = Field(
        1, ge=1, le=MAX_COUNT, description="refit continue: the epochs of the continued fit."
    )
    early_stopping_metric: str = Field(
        "recall_at_50",
        pattern=r"^(recall|ndcg|mrr)_at_\d+$",
        description="Exact validation metric that early stopping watches.",
    )
    warm_start_from: str | None = Field(
        None,
        description="A previous run's model folder (e.g. the champion's): start from its "
        "weights, rows mapped by id when the vocabularies changed.",
    )
    candidates: list[dict[str, bool | int | float | str]] = Field(
        default_factory=lambda: [dict(c) for c in DEFAULT_CANDIDATES],
        max_length=MAX_CANDIDATES,
        description="Other settings to try beside the config's own: each (dotted model.* / "
        "training.* keys and values, as in dense_log.settings) trains a first fit on the train "
        "split, the config itself first; the best by early_stopping_metric on the validation "
        "split is kept (and refitted under refit), the others are logged and dropped. Costs "
        "one first fit per candidate. Skipped (logged) where a run continues one model: an "
        "incremental night from the champion, warm_start_from. Default: mean pooling (the "
        "order-free query tower) over the last 50 items, at the run's width and at 256 "
        "dimensions; [] to train the config alone.",
    )
    candidates_prune_after: int = Field(
        2,
        ge=0,
        le=MAX_COUNT,
        description="From this epoch on, a candidate whose best validation score so far is "
        "below the best an earlier candidate had reached by the same epoch stops there "
        "(logged as pruned; it cannot be kept, as it trails). The config's own settings always "
        "train their whole first fit. 0: every candidate trains its whole first fit.",
    )

    @field_validator("warm_start_from")
    @classmethod
    def _path_without_nul(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("refit", mode="before")
    @classmethod
    def _refit_from_bool(cls, value: object) -> object:
        # Configs written before `all` existed say true / false.
        if value is True:
            return "validation"
        return "off" if value is False else value

    @property
    def refit_splits(self) -> tuple[str, ...]:
        """The splits a refit trains on (empty: no refit)."""
        return REFIT_SPLITS[self.refit]


class ClassicBaselineConfig(_Strict):
    """Implicit ALS (Hu, Koren and Volinsky 2008) fitted and scored beside the model in every
    evaluate stage: each setting of the grid (factors x regularization x alpha) fitted on the
    train positions and scored on the validation positions by gate.primary_metric, the best
    refitted on train + validation and scored on the model's test users (docs/TRACKING.md,
    "The classic baseline")."""

    enabled: bool = Field(
        True, description="Fit and score ALS; false: no ALS, metrics.json has no `als` key."
    )
    factors: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        [64, 128], min_length=1, max_length=10, description="Grid: latent factors."
    )
    regularization: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] = Field(
        [0.1, 1.0, 10.0], min_length=1, max_length=10, description="Grid: L2 regularization."
    )
    alpha: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] = Field(
        [1.0, 10.0],
        min_length=1,
        max_length=10,
        description="Grid: confidence weight of an interaction (confidence 1 + alpha).",
    )
    iterations: int = Field(15, ge=1, le=100, description="ALS sweeps per fit.")
    max_seconds: float = Field(
        300.0,
        gt=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="Time budget of the search: a setting starts only while the time spent "
        "plus one more fit and the final refit (each as long as the slowest fit so far) fit "
        "in it; the first setting always runs. When it cuts the grid, the best setting so far "
        "is used and metrics.json says so.",
    )
    policy: Literal["warn", "refuse"] = Field(
        "warn",
        description="When the model scores below ALS on gate.primary_metric (point "
        "estimate): warn (a warning and the summary line; the gate decides as before) or "
        "refuse (the gate also refuses to promote it; with no champion yet nothing is "
        "promoted).",
    )


class EvaluationConfig(_Strict):
    """Exact top-K evaluation over the whole catalog."""

    ks: list[Annotated[int, Field(le=MAX_K)]] = Field(
        [10, 50, 100], max_length=100, description="Cut-offs of recall@K (sorted, unique)."
    )
    ndcg_k: int = Field(10, ge=1, le=MAX_K, description="Cut-off of NDCG.")
    mrr_k: int = Field(100, ge=1, le=MAX_K, description="Cut-off of MRR.")
    coverage_k: int = Field(
        10, ge=0, le=MAX_K, description="Catalog coverage of the top-K lists (0: not computed)."
    )
    user_batch_size: int = Field(
        512, ge=1, le=MAX_BATCH, description="Users scored against the catalog at once."
    )
    sample_users: int = Field(
        0,
        ge=0,
        le=MAX_ROWS,
        description="Evaluate a uniform sample of this many test users (0: all; exact ranking "
        "either way); metrics.json then reports each metric's 95% interval for the whole test "
        "population.",
    )
    sample_seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the user sample.")
    classic_baseline: ClassicBaselineConfig = Field(
        ClassicBaselineConfig(), description="Implicit ALS beside the model, every night."
    )

    @field_validator("ks")
    @classmethod
    def _positive_sorted(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 1 for k in ks):
            raise ValueError("evaluation.ks must be a non-empty list of positive integers")
        return sorted(set(ks))


class TrackingConfig(_Strict):
    """MLflow tracking; an empty uri means a SQLite store under the working directory."""

    uri: str | None = Field(
        None,
        description="Tracking server or store; null: MLFLOW_TRACKING_URI, else a SQLite store "
        "under the working directory.",
    )
    experiment: str | None = Field(None, description="MLflow experiment; null: the model_name.")
    retries: int = Field(
        4, ge=1, le=100, description="Attempts to reach a tracking server before logging."
    )
    backoff_seconds: float = Field(
        1.0, ge=0, le=3600, description="First wait between attempts (doubles each time)."
    )

    @field_validator("experiment")
    @classmethod
    def _plain_experiment(cls, value: str | None) -> str | None:
        return None if value is None else safe_name(value)


class GateConfig(_Strict):
    """Champion/challenger gate: promote only on a confident improvement without regressions."""

    primary_metric: str = Field(
        "recall_at_50", description="The per-user test metric the challenger must improve."
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The challenger's mean per-user gain must be at least this AND its "
        "confidence interval's lower bound above 0.",
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="Confidence level of the bootstrap interval."
    )
    bootstrap_samples: int = Field(
        2000, ge=100, le=1_000_000, description="Bootstrap resamples of the users."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the bootstrap.")
    guardrails: dict[str, float] = Field(
        {"ndcg_at_10": 0.01, "coverage_at_10": 0.05},
        description="Metric -> largest tolerated drop (absolute, challenger minus champion).",
    )

    @field_validator("guardrails")
    @classmethod
    def _non_negative(cls, guardrails: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in guardrails.items() if not v >= 0}
        if bad:
            raise ValueError(f"gate.guardrails tolerances must be >= 0, got {bad}")
        return guardrails


class ExportConfig(_Strict):
    """SavedModel and embedding export (docs/SERVING.md)."""

    top_k: int = Field(
        100,
        ge=1,
        le=MAX_K,
        description="The largest k a retrieval request may ask for (larger requests are "
        "clipped in the graph).",
    )
    verify: bool = Field(
        True, description="Reload the exports in a fresh process and compare their outputs."
    )
    tolerance: float = Field(
        1e-5, gt=0, le=1, description="verify: largest tolerated score difference."
    )
    warmup: bool = Field(
        True, description="Write TF Serving warmup requests in each SavedModel's assets.extra/."
    )
    keep_versions: int = Field(
        5,
        ge=1,
        le=MAX_COUNT,
        description="Versions kept per model (and embeddings); the champion's and the "
        "challenger's are never pruned.",
    )
    serving_base_path: str | None = Field(
        None,
        description="models.config base_path prefix as TF Serving sees the export folder (e.g. "
        "/models in the container); null: this machine's absolute paths.",
    )
    ann: Literal["none", "faiss"] = Field(
        "none",
        description="An optional approximate index over items.parquet: faiss IVF-Flat with "
        "inner product (brute force stays the default; the retrieval SavedModel is exact).",
    )
    ann_nlist: int | None = Field(
        None, ge=1, le=MAX_ROWS, description="faiss: inverted lists; null: from the catalog size."
    )
    ann_nprobe: int = Field(16, ge=1, le=MAX_ROWS, description="faiss: lists probed per query.")
    ann_recall_k: int = Field(
        100, ge=1, le=MAX_K, description="faiss: k of the recall recorded in the manifest."
    )


class NightlyConfig(_Strict):
    """Scheduling and retention of `recsys nightly` / `recsys backfill`."""

    timezone: str = Field(
        "UTC",
        description="The default --date is yesterday in this IANA time zone (the business day "
        "that ended).",
    )
    keep_days: int | None = Field(
        None,
        ge=1,
        le=36_500,
        description="Keep data/ and runs/ of the newest N dates (never the champion's); null: "
        "keep all.",
    )

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


class StorageConfig(_Strict):
    """Object storage (s3:// and gs:// paths): overrides of the standard environment.

    Endpoints and regions come from the environment every AWS and Google client reads
    (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, STORAGE_EMULATOR_HOST); set these only to override
    it. Credentials are never read from the config: use the environment, a profile or a role.
    """

    s3_endpoint_url: str | None = Field(
        None,
        description="An S3-compatible server's URL; null: AWS_ENDPOINT_URL_S3, "
        "AWS_ENDPOINT_URL, else AWS itself.",
    )
    s3_region: str | None = Field(
        None, description="The S3 region; null: AWS_DEFAULT_REGION or AWS_REGION."
    )
    gcs_endpoint: str | None = Field(
        None,
        description="A GCS emulator's host:port, as STORAGE_EMULATOR_HOST; null: that "
        "variable, else Google Cloud Storage itself.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where the local copy of a working directory in a bucket lives (stages "
        "run on it, finished versions are published to the bucket); null: $RECSYS_CACHE_DIR, "
        "else ~/.cache/recsys.",
    )


# What `recsys tune` searches when the config names no `tune.space` (docs/TRAINING.md, Tuning).
DEFAULT_TUNE_SPACE: dict[str, dict[str, Any]] = {
    "model.embedding_dim": {"choices": [32, 64, 128]},
    "model.temperature": {"low": 0.03, "high": 0.3, "log": True},
    "model.history_length": {"choices": [10, 20, 50]},
    # The sequence encoder's capacity and regularisation: sparse logs (a few events per user)
    # want more dropout than dense ones (SASRec: .5 vs .2).
    "model.encoder_layers": {"choices": [1, 2, 3]},
    "model.encoder_dropout": {"low": 0.1, "high": 0.6},
    # A per-user table helps dense logs and overfits sparse ones (recsys.core.auto).
    "model.user_embedding": {"choices": [True, False]},
    "training.learning_rate": {"low": 0.001, "high": 0.03, "log": True},
    "training.batch_size": {"choices": [256, 512, 1024, 2048]},
}
# Settings a trial may change: the model and its training (the data and the protocol stay).
TUNABLE_SECTIONS = ("model", "training")


class SearchDimension(_Strict):
    """One searched setting: a list of `choices`, or a `low`..`high` range.

    A range of two integers is searched as integers (optionally every `step`), else as
    floats; `log: true` samples uniformly in log space (learning rates, temperatures).
    """

    choices: list[bool | int | float | str] | None = Field(
        None, description="The values to try (instead of low and high)."
    )
    low: int | float | None = Field(None, description="Lower end of a range.")
    high: int | float | None = Field(None, description="Upper end of a range.")
    log: bool = Field(False, description="Sample the range uniformly in log space.")
    step: int | float | None = Field(None, description="Grid step of a range (not with log).")

    @model_validator(mode="after")
    def _one_kind(self) -> SearchDimension:
        if self.choices is not None:
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError("give either a non-empty `choices` list or `low` and `high`")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give either a non-empty `choices` list or `low` and `high`")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("a log-scale range needs low > 0")
        if self.log and self.step is not None:
            raise ValueError("`step` cannot be combined with `log`")
        return self

    @property
    def is_int(self) -> bool:
        """Whether a range is searched over integers (both bounds are ints)."""
        return isinstance(self.low, int) and isinstance(self.high, int)

    @property
    def bounds(self) -> tuple[int | float, int | float]:
        """(low, high) of a range; a `choices` dimension has none."""
        if self.low is None or self.high is None:
            raise ValueError("a `choices` dimension has no low..high bounds")
        return self.low, self.high

    def values_to_check(self) -> list[Any]:
        """The values whose validity stands for all: every choice, or both bounds."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]

    def contains(self, value: Any) -> bool:
        """Whether the search could propose `value` (one of the choices, or on the range)."""
        if self.choices is not None:
            # Typed: True must not match a choice of 1, nor 64 a choice of 64.0.
            return any(type(c) is type(value) and c == value for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.is_int and not isinstance(value, int):
            return False
        low, high = self.bounds
        if not low <= value <= high:
            return False
        steps = 0.0 if self.step is None else (value - low) / self.step
        return math.isclose(steps, round(steps), abs_tol=1e-9)


class TuneConfig(_Strict):
    """`recsys tune`: hyper-parameter search on the validation split (never the test split)."""

    metric: str = Field(
        "ndcg_at_10",
        pattern=r"^(recall|ndcg|mrr)_at_\d+$",
        description="Validation metric maximised; also the early-stopping metric of the trials "
        "and of the written config, so the nightly keeps the epoch the search judged by.",
    )
    trials: int = Field(
        20,
        ge=1,
        le=MAX_COUNT,
        description="The study's trial budget: trials that ended (complete, pruned, failed) "
        "over every run of the same search, so a resumed search runs only what is left.",
    )
    timeout_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="The study's time budget, counted over every run of the same search (the "
        "time its ended trials ran): no trial starts after it, and the running one stops "
        "after its epoch; null: none.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=MAX_WORKERS,
        description="Trials run in this many processes at once on the one study "
        "(`recsys tune --workers`).",
    )
    storage: str | None = Field(
        None,
        description="Where the Optuna study lives (an SQLAlchemy URL: sqlite:///... or "
        "postgresql://...); unset: OPTUNA_STORAGE, else the tracking store's PostgreSQL "
        "database when tracking.uri is one, else <workdir>/tune/optuna.db. Credentials belong "
        "in OPTUNA_STORAGE, not here.",
    )
    pruner: Literal["median", "none"] = Field(
        "median",
        description="median: stop a trial whose validation metric after an epoch is below the "
        "median of the earlier trials at that epoch (Optuna MedianPruner); none: every trial "
        "runs to the end.",
    )
    startup_trials: int = Field(
        3, ge=0, le=MAX_COUNT, description="Trials never pruned (the median needs some)."
    )
    warmup_epochs: int = Field(
        1, ge=0, le=MAX_COUNT, description="Epochs of a trial before it may be pruned."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the sampler.")
    baseline: bool = Field(
        True,
        description="Trial 0 trains the base config's own settings, so the winner is measured "
        "against them on the same validation items; skipped (logged) when one of them is not "
        "in space.",
    )
    space: dict[str, SearchDimension] = Field(
        default_factory=lambda: {
            k: SearchDimension.model_validate(v) for k, v in DEFAULT_TUNE_SPACE.items()
        },
        description="Dotted key (model.* or training.*) -> its search range; a new setting of "
        "the model becomes searchable by adding an entry.",
    )

    @field_validator("storage")
    @classmethod
    def _known_storage(cls, value: str | None) -> str | None:
        return None if value is None else check_study_storage(value)


# The Optuna storages `recsys tune` is tested with (SQLAlchemy URL schemes, driver optional).
STUDY_STORAGE_SCHEMES = ("sqlite", "postgresql")


def check_study_storage(url: str) -> str:
    """`url` if it names a supported Optuna RDB storage; else ValueError saying which are."""
    scheme = url.split("://", 1)[0].split("+", 1)[0] if "://" in url else ""
    if scheme not in STUDY_STORAGE_SCHEMES or len(url) > 2000:
        shown = url.split("://", 1)[0] + "://..." if "://" in url else "a URL without a scheme"
        raise ValueError(
            f"tune.storage {shown} is not supported: give sqlite:///<path> or "
            "postgresql://<user>@<host>/<database> (password in OPTUNA_STORAGE, not the config)"
        )
    return url


class DataShapeRule(_Strict):
    """Settings that apply only to logs whose users average at least `min_events_per_user`.

    The log's shape is known once the Beam job has written stats.json, so the rule is applied
    at train time, before the `auto` settings are decided (recsys.core.resolve; logged and
    recorded in the run's resolved_config.yaml and train.json).
    """

    min_events_per_user: float = Field(
        gt=0, le=MAX_ROWS, description="Mean events per user (all splits) from which it applies."
    )
    settings: dict[str, bool | int | float | str] = Field(
        min_length=1,
        max_length=64,
        description="Dotted model.* / training.* keys and their values, as in tune.space.",
    )


class RecsysConfig(_Strict):
    """The whole configuration of one nightly run."""

    model_name: str = Field(
        "recsys-default",
        description="Name of the model: its MLflow registered model, experiment (unless "
        "tracking.experiment) and export folder.",
    )
    data: DataConfig = Field(DataConfig(), description="The raw log.")
    preprocess: PreprocessConfig = Field(PreprocessConfig(), description="The Beam job.")
    model: ModelConfig = Field(ModelConfig(), description="The two-tower model.")
    training: TrainingConfig = Field(TrainingConfig(), description="Its training.")
    evaluation: EvaluationConfig = Field(EvaluationConfig(), description="Exact evaluation.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow.")
    export: ExportConfig = Field(ExportConfig(), description="SavedModels and embeddings.")
    gate: GateConfig = Field(GateConfig(), description="The champion/challenger gate.")
    nightly: NightlyConfig = Field(NightlyConfig(), description="Scheduling and retention.")
    tune: TuneConfig = Field(TuneConfig(), description="`recsys tune` (changes no nightly run).")
    storage: StorageConfig = Field(
        StorageConfig(), description="Object storage endpoints (changes no nightly run)."
    )
    dense_log: DataShapeRule | None = Field(
        None,
        description="Settings for dense logs (many events per user); null: one set of "
        "settings for every log.",
    )

    # Dotted keys set after loading (`--set`, a tuning trial): their source is `override`.
    _overrides: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @field_validator("model_name")
    @classmethod
    def _plain_model_name(cls, value: str) -> str:
        return safe_name(value)

    @model_validator(mode="after")
    def _tunable_space(self) -> RecsysConfig:
        for key, dimension in self.tune.space.items():
            for value in dimension.values_to_check():
                self._check_setting("tune.space", key, value)
        return self

    @model_validator(mode="after")
    def _dense_log_settings(self) -> RecsysConfig:
        if self.dense_log is None:
            return self
        for key, value in self.dense_log.settings.items():
            self._check_setting("dense_log.settings", key, value)
        history = self.dense_log.settings.get("model.history_length")
        if history is not None and int(history) > self.preprocess.history_length:
            raise ValueError(
                f"dense_log.settings model.history_length {history} is longer than the "
                f"histories the Beam job writes (preprocess.history_length "
                f"{self.preprocess.history_length}): raise preprocess.history_length"
            )
        return self

    @model_validator(mode="after")
    def _candidate_settings(self) -> RecsysConfig:
        for i, candidate in enumerate(self.training.candidates, start=1):
            where = f"training.candidates[{i}]"
            if not candidate:
                raise ValueError(f"{where} sets nothing: name at least one setting")
            for key, value in candidate.items():
                if key in FIXED_FOR_CANDIDATES:
                    raise ValueError(
                        f"{where} key {key!r} cannot differ between candidates (they share "
                        "the run's data, devices and validation score); set it for the run"
                    )
                self._check_setting(where, key, value)
        return self

    @model_validator(mode="after")
    def _stored_history_covers_the_models(self) -> RecsysConfig:
        # training.input rows encodes the history the Beam job stored with each row: a longer
        # model.history_length would silently see only the stored items.
        if self.training.input != "rows":
            return self
        stored = self.preprocess.history_length
        lengths = {"model.history_length": self.model.history_length}
        for i, candidate in enumerate(self.training.candidates, start=1):
            if "model.history_length" in candidate:
                where = f"training.candidates[{i}] model.history_length"
                lengths[where] = int(candidate["model.history_length"])
        for where, length in lengths.items():
            if length > stored:
                raise ValueError(
                    f"{where} {length} is longer than the histories the Beam job writes "
                    f"(preprocess.history_length {stored}), which training.input rows "
                    f"encodes: raise preprocess.history_length to {length}, or train from "
                    "sequences (training.input: sequences)"
                )
        return self

    def _check_setting(self, where: str, key: str, value: Any) -> None:
        """Raise unless `key` is model.<setting> or training.<setting> and `value` valid there."""
        section, _, name = key.partition(".")
        if section not in TUNABLE_SECTIONS or "." in name:
            raise ValueError(f"{where} key {key!r} must be model.<setting> or training.<setting>")
        current = getattr(self, section)
        if name not in type(current).model_fields:
            raise ValueError(f"{where} key {key!r}: {section} has no setting {name!r}")
        try:
            type(current).model_validate({**current.model_dump(), name: value})
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ValueError(f"{where} {key}: value {value!r} is invalid: {reason}") from None

    @property
    def overrides(self) -> frozenset[str]:
        """Dotted keys that set_values set after the config was loaded."""
        return self._overrides

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys (MLflow params), without `tune` and `storage` (they change
        no run)."""
        return _flatten(self.model_dump(mode="json", exclude={"tune", "storage"}))

    def digest(self) -> str:
        """A stable hash of the config: same settings, same digest."""
        # Credentials are left out (environment-independent redaction): the digest is a public
        # tag, a guessable password must not be testable against it, and rotating a password
        # must not make a new run identity.
        # The search space of `recsys tune` changes no nightly run: not part of its identity;
        # nor does where the files are kept.
        dump = redact_tree(self.model_dump(mode="json", exclude={"tune", "storage"}), environ={})
        canonical = json.dumps(dump, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def with_input(self, path: str | None) -> RecsysConfig:
        """A copy whose data source is the given path (the CLI's --input)."""
        if not path:
            return self
        source = self.data.source
        if source == "synthetic":
            folder = storage.is_dir(path)
            source = "parquet" if str(path).endswith(".parquet") or folder else "csv"
        data = self.data.model_copy(update={"path": str(path), "source": source})
        return self.model_copy(update={"data": data})


def _is_scalar(value: Any) -> bool:
    # Text may be a path, a URI or a secret: only numbers, and text that reads as one, are
    # repeated in the message.
    return isinstance(value, int | float | bool) or (
        isinstance(value, str) and _NUMBER_LIKE.fullmatch(value) is not None
    )


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
    """Load and validate a YAML config; None means the built-in defaults (docs/CONFIG.md)."""
    if path is None:
        return RecsysConfig()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = _parse_yaml(path, path.read_bytes())
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    return parse_config(raw, source=str(path))


def _parse_yaml(path: Path, data: bytes) -> Any:
    """The YAML document in `data`; ConfigError if it is not UTF-8, not YAML, or too deep."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the "
            "file as UTF-8"
        ) from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        # PyYAML's composer recurses once per level: thousands of levels exhaust the stack.
        raise ConfigError(
            f"{path}: nested deeper than Python's recursion limit; a config is a few levels "
            f"deep (at most {MAX_CONFIG_DEPTH})"
        ) from None
    if _depth(raw) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep")
    return raw


def _depth(value: Any, limit: int = MAX_CONFIG_DEPTH + 1) -> int:
    """Nesting depth of mappings and lists, counted no further than `limit`."""
    if limit <= 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


def set_values(
    config: RecsysConfig, values: Mapping[str, Any], override: bool = True
) -> RecsysConfig:
    """A validated copy of `config` with dotted keys set (e.g. {"model.embedding_dim": 32}).

    The keys are recorded as overrides (RecsysConfig.overrides) unless `override` is false;
    the settings the config had set stay set, so each value's origin is still known.
    """
    raw = config.model_dump(mode="json", exclude_unset=True)
    for key, value in values.items():
        set_dotted(raw, key, value)
    updated = parse_config(raw, source="settings " + ", ".join(sorted(values)))
    updated._overrides = config.overrides | (frozenset(values) if override else frozenset())
    return updated


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key ("model.embedding_dim") in a nested mapping, creating parents."""
    *parents, name = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[name] = value


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
            elif err["type"] != "extra_forbidden" and _is_scalar(err.get("input")):
                msg += f", got {err['input']!r}"
            problems.append(f"{where}: {msg}")
        raise ConfigError(f"{source}: invalid config: " + "; ".join(problems)) from None
