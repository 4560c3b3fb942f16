"""What each `auto` setting becomes: rules over the data's shape and the training devices.

The rules are pure functions of a few facts (stats.json's counts, the GPUs and replicas the
trainer found), so `recsys config show`, the trainer and docs/CONFIG.md read the same ones.
`recsys.core.resolve` applies them and records why.

`model.negatives`: the exact softmax over the catalog (`full`) was best on the validation
splits of MovieLens 100K (1.7K items, 106 events/user) and Amazon Beauty (12K items, 9
events/user), figures in docs/TRAINING.md; its per-step cost grows with the catalog, so above
`FULL_SOFTMAX_MAX_ITEMS` the rule falls back to the batch plus a shared sampled pool (`mixed`).
Events per user did not change that choice on these two data sets.

`model.user_embedding`: a per-user table is on when users have more events on average than
the query tower's history window (`history_length`), off otherwise. Where the window holds a
user's whole history, the table only repeats it with a few gradient updates per row, and
overfits; where it does not, the table carries the older taste. Measured on validation: off,
Amazon Beauty (9 events/user, window 20) gains ~20% Recall@10, MovieLens 100K (106
events/user) loses 6% (docs/TRAINING.md).

`training.learning_rate_schedule`: a cosine decay to 0 over the configured epochs on dense
logs (more events per user than `history_length`, the boundary `user_embedding` uses), a
constant rate otherwise. Measured on validation with the whole pipeline (refit included):
MovieLens 100K +6.1% NDCG@10 over 3 seeds (95% interval over users +1.8% to +10.7%), Amazon
Beauty -1.7% NDCG@10 and -2.8% Recall@10 (docs/TRAINING.md).

`dense_log` (a config rule, not a setting): on a log whose users average at least
`dense_log.min_events_per_user` events, its settings replace the config's before any `auto`
is resolved. The shipped configs carry none (docs/TRAINING.md, "Dense logs").

Device rules: `training.precision` is mixed_float16 only on GPUs of compute capability >= 7.0
(bf16 brought no speed on CPU and fp16 is emulated there); `training.jit_compile` compiles
the step with XLA on one GPU and per-row input only (on CPU the blocked in-batch softmax of
recsys/losses.py, which XLA cannot compile, is 1.6-2x faster per step; under several replicas
the all_gather stays outside XLA; sequence windows pick their positions at run time);
`training.strategy` is multi_worker when TF_CONFIG names several workers, mirrored on several
GPUs, else one_device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FULL_SOFTMAX_MAX_ITEMS = 50_000
"""Up to this many items the softmax runs over the whole catalog (a [batch x items] matrix:
1024 x 50K float32 = 200 MiB per step); above, a shared sampled pool plus the batch."""

MIXED_FLOAT16_MIN_CAPABILITY = (7, 0)
"""GPUs from this compute capability on (Volta) have float16 tensor cores."""

AUTO_CACHE_BYTES = 1 << 30
"""`training.cache: auto` keeps splits in memory up to this size (estimated per fit)."""


@dataclass(frozen=True)
class DataShape:
    """What the data rules look at: catalog size and mean events per user (all splits)."""

    items: int
    events_per_user: float

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> DataShape:
        """From the Beam job's stats.json (`items`, `users`, `splits`: parsed JSON)."""
        events = sum(int(v) for v in stats["splits"].values())
        users = max(int(stats["users"]), 1)
        return cls(int(stats["items"]), events / users)


@dataclass(frozen=True)
class DeviceFacts:
    """What the device rules look at, as the trainer found them."""

    strategy: str = "one_device"
    replicas: int = 1
    # One (major, minor) compute capability per visible GPU.
    gpu_capabilities: tuple[tuple[int, int], ...] = ()
    tf_config_workers: int = 0


Choice = tuple[Any, str]
"""A rule's value and the inputs that decided it, e.g. ("full", "1682 items <= 50000")."""


def negatives(shape: DataShape) -> Choice:
    """`model.negatives: auto`: full up to FULL_SOFTMAX_MAX_ITEMS items, else mixed."""
    full = shape.items <= FULL_SOFTMAX_MAX_ITEMS
    sign = "<=" if full else ">"
    return ("full" if full else "mixed"), f"{shape.items} items {sign} {FULL_SOFTMAX_MAX_ITEMS}"


def user_embedding(shape: DataShape, history_length: int) -> Choice:
    """`model.user_embedding: auto`: on when users average more events than the window."""
    return _dense(shape, history_length)


def learning_rate_schedule(shape: DataShape, history_length: int) -> Choice:
    """`training.learning_rate_schedule: auto`: cosine on dense logs, else constant."""
    dense, why = _dense(shape, history_length)
    return ("cosine" if dense else "constant"), why


def _dense(shape: DataShape, history_length: int) -> Choice:
    dense = shape.events_per_user > history_length
    sign = ">" if dense else "<="
    return dense, f"{shape.events_per_user:.1f} events/user {sign} history_length {history_length}"


def dense_log_applies(shape: DataShape, min_events_per_user: float) -> Choice:
    """Whether the `dense_log` rule applies to a log of this shape."""
    dense = shape.events_per_user >= min_events_per_user
    sign = ">=" if dense else "<"
    return dense, f"{shape.events_per_user:.1f} events/user {sign} {min_events_per_user:g}"


def precision(device: DeviceFacts) -> Choice:
    """`training.precision: auto`: mixed_float16 when every GPU has float16 tensor cores."""
    gpus = device.gpu_capabilities
    if not gpus:
        return "float32", "no GPU"
    major, minor = MIXED_FLOAT16_MIN_CAPABILITY
    if all(tuple(c) >= MIXED_FLOAT16_MIN_CAPABILITY for c in gpus):
        return "mixed_float16", f"{len(gpus)} GPU(s) of compute capability >= {major}.{minor}"
    return "float32", f"a GPU below compute capability {major}.{minor}"


def jit_compile(device: DeviceFacts, training_input: str) -> Choice:
    """`training.jit_compile: auto`: on with one replica on a GPU and per-row input, else off.

    Sequence windows gather their trained positions (a shape known only at run time), which
    XLA cannot compile.
    """
    gpus = len(device.gpu_capabilities)
    if not gpus:
        return "off", "no GPU"
    if device.replicas > 1:
        return "off", f"{device.replicas} replicas"
    if training_input != "rows":
        return "off", f"training.input {training_input}"
    return "on", "one replica on a GPU, training.input rows"


def strategy(device: DeviceFacts) -> Choice:
    """`training.strategy: auto`: the layout the trainer chose from TF_CONFIG and the GPUs."""
    gpus = len(device.gpu_capabilities)
    return device.strategy, f"{device.tf_config_workers} TF_CONFIG workers, {gpus} GPU(s)"


DATA = "from the data (stats.json; `recsys config show --data`)"
DEVICE = "on the training machine (its GPUs, replicas and TF_CONFIG)"


@dataclass(frozen=True)
class AutoRule:
    """How one `auto` setting is decided, in words (docs/CONFIG.md, `recsys config show`)."""

    key: str
    when: str  # what it is decided from, e.g. "from the data (stats.json)"
    rule: str


RULES: tuple[AutoRule, ...] = (
    AutoRule(
        "model.negatives",
        DATA,
        f"full when the catalog has at most {FULL_SOFTMAX_MAX_ITEMS:,} items, else mixed",
    ),
    AutoRule(
        "model.user_embedding",
        DATA,
        "true when users average more events (all splits) than model.history_length, else false",
    ),
    AutoRule(
        "training.learning_rate_schedule",
        DATA,
        "cosine when users average more events (all splits) than model.history_length, "
        "else constant",
    ),
    AutoRule(
        "training.precision",
        DEVICE,
        "mixed_float16 when every GPU has compute capability >= "
        f"{'.'.join(map(str, MIXED_FLOAT16_MIN_CAPABILITY))}, else float32 (always on CPU)",
    ),
    AutoRule(
        "training.jit_compile",
        DEVICE,
        "on with one replica on a GPU and training.input rows, else off",
    ),
    AutoRule(
        "training.strategy",
        DEVICE,
        "multi_worker when TF_CONFIG names several workers, mirrored on several GPUs, "
        "else one_device",
    ),
    AutoRule(
        "training.cache",
        "per fit (train.json records `cached`)",
        f"memory when the split is estimated at most {AUTO_CACHE_BYTES >> 30} GiB in memory "
        "and one worker trains, else none",
    ),
)
"""Every `auto` rule; `dense_log` is described with its own settings."""

RULE_OF = {rule.key: rule for rule in RULES}
