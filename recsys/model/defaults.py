"""`auto` model settings, resolved at train time from the data's size (stats.json).

The rule (chosen on validation results of MovieLens 100K and Amazon Beauty; the figures are in
docs/TRAINING.md) reads two numbers the Beam job writes: the catalog size and the mean number
of events per user. `resolve` returns the config with every `auto` replaced, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsys.config import ModelConfig

FULL_SOFTMAX_MAX_ITEMS = 50_000
"""Up to this many items the softmax runs over the whole catalog (a [batch x items] matrix:
1024 x 50K float32 = 200 MiB per step); above, a shared sampled pool plus the batch."""


@dataclass(frozen=True)
class DataShape:
    """What the rule looks at: catalog size and mean events per user (all splits)."""

    items: int
    events_per_user: float

    @classmethod
    def from_stats(cls, stats: dict[str, object]) -> DataShape:
        """From the Beam job's stats.json (`items`, `users`, `splits`)."""
        splits = stats["splits"]
        events = sum(int(v) for v in splits.values())  # type: ignore[union-attr]
        users = max(int(stats["users"]), 1)  # type: ignore[arg-type]
        return cls(int(stats["items"]), events / users)  # type: ignore[arg-type]


def resolve(config: ModelConfig, shape: DataShape) -> tuple[ModelConfig, list[str]]:
    """`config` with `query_encoder` and `negatives` `auto` resolved; one reason per choice."""
    changes: dict[str, object] = {}
    reasons = []
    if config.query_encoder == "auto":
        changes["query_encoder"] = "transformer" if config.history_length else "mean"
        reasons.append(
            f"query_encoder={changes['query_encoder']} (history_length {config.history_length})"
        )
    if config.negatives == "auto":
        full = shape.items <= FULL_SOFTMAX_MAX_ITEMS
        changes["negatives"] = "full" if full else "mixed"
        reasons.append(
            f"negatives={changes['negatives']} ({shape.items} items "
            f"{'<=' if full else '>'} {FULL_SOFTMAX_MAX_ITEMS})"
        )
    return config.model_copy(update=changes), reasons
