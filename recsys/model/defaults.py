"""The `auto` model settings, resolved at train time from the data's shape (stats.json).

`negatives`: the exact softmax over the catalog (`full`) was best on the validation splits of
MovieLens 100K (1.7K items, 106 events/user) and Amazon Beauty (12K items, 9 events/user),
figures in docs/TRAINING.md; its per-step cost grows with the catalog, so above
`FULL_SOFTMAX_MAX_ITEMS` the rule falls back to the batch plus a shared sampled pool (`mixed`).
Events per user did not change that choice on these two data sets; they are logged with it.

`user_embedding`: a per-user table is on when users have more events on average than the
query tower's history window (`history_length`), off otherwise. Where the window holds a
user's whole history, the table only repeats it with a few gradient updates per row, and
overfits; where it does not, the table carries the older taste. Measured on validation:
off, Amazon Beauty (9 events/user, window 20) gains ~20% Recall@10, MovieLens 100K (106
events/user) loses 6% (docs/TRAINING.md).

`training.learning_rate_schedule` (the one `auto` training setting): a cosine decay to 0 over
the configured epochs on dense logs (more events per user than `history_length`, the
boundary `user_embedding` uses), a constant rate otherwise. Measured on validation with the
whole pipeline (refit included): MovieLens 100K +6.1% NDCG@10 over 3 seeds (95% interval over
users +1.8% to +10.7%), Amazon Beauty -1.7% NDCG@10 and -2.8% Recall@10 (docs/TRAINING.md).

`dense_log` (a config rule, not a model setting): on a log whose users average at least
`dense_log.min_events_per_user` events, its settings replace the config's before any `auto`
is resolved. The shipped configs carry none (docs/TRAINING.md, "Dense logs").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recsys.core.config import ModelConfig, RecsysConfig, set_values

FULL_SOFTMAX_MAX_ITEMS = 50_000
"""Up to this many items the softmax runs over the whole catalog (a [batch x items] matrix:
1024 x 50K float32 = 200 MiB per step); above, a shared sampled pool plus the batch."""


@dataclass(frozen=True)
class DataShape:
    """What the rule looks at: catalog size and mean events per user (all splits)."""

    items: int
    events_per_user: float

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> DataShape:
        """From the Beam job's stats.json (`items`, `users`, `splits`: parsed JSON)."""
        events = sum(int(n) for n in stats["splits"].values())
        users = max(int(stats["users"]), 1)
        return cls(int(stats["items"]), events / users)


def resolve(config: ModelConfig, shape: DataShape) -> tuple[ModelConfig, list[str]]:
    """`config` with its `auto` settings resolved; one reason per choice made."""
    update: dict[str, object] = {}
    reasons: list[str] = []
    if config.negatives == "auto":
        full = shape.items <= FULL_SOFTMAX_MAX_ITEMS
        update["negatives"] = "full" if full else "mixed"
        reasons.append(
            f"negatives={update['negatives']} ({shape.items} items "
            f"{'<=' if full else '>'} {FULL_SOFTMAX_MAX_ITEMS}, "
            f"{shape.events_per_user:.1f} events/user)"
        )
    if config.user_embedding == "auto":
        window = config.history_length
        on = shape.events_per_user > window
        update["user_embedding"] = on
        reasons.append(
            f"user_embedding={str(on).lower()} ({shape.events_per_user:.1f} events/user "
            f"{'>' if on else '<='} history_length {window})"
        )
    return (config.model_copy(update=update) if update else config), reasons


def resolve_schedule(config: RecsysConfig, shape: DataShape) -> tuple[RecsysConfig, list[str]]:
    """`config` with `training.learning_rate_schedule: auto` resolved; the reason, if any."""
    training = config.training
    if training.learning_rate_schedule != "auto":
        return config, []
    window = config.model.history_length
    dense = shape.events_per_user > window
    schedule = "cosine" if dense else "constant"
    reason = (
        f"learning_rate_schedule={schedule} ({shape.events_per_user:.1f} events/user "
        f"{'>' if dense else '<='} history_length {window})"
    )
    update = {"training": training.model_copy(update={"learning_rate_schedule": schedule})}
    return config.model_copy(update=update), [reason]


def apply_dense_log(config: RecsysConfig, shape: DataShape) -> tuple[RecsysConfig, dict[str, Any]]:
    """`config` with its `dense_log` settings applied when `shape` is dense; the settings set."""
    rule = config.dense_log
    if rule is None or shape.events_per_user < rule.min_events_per_user:
        return config, {}
    return set_values(config, rule.settings), dict(rule.settings)
