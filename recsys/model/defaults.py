"""`model.negatives: auto`, resolved at train time from the data's size (stats.json).

The exact softmax over the catalog (`full`) was best on the validation splits of MovieLens 100K
(1.7K items, 106 events/user) and Amazon Beauty (12K items, 9 events/user), figures in
docs/TRAINING.md; its per-step cost grows with the catalog, so above `FULL_SOFTMAX_MAX_ITEMS`
the rule falls back to the batch plus a shared sampled pool (`mixed`). Events per user did not
change the choice on these two data sets; they are logged with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsys.core.config import ModelConfig

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
    """`config` with `negatives: auto` resolved; one reason per choice made."""
    if config.negatives != "auto":
        return config, []
    full = shape.items <= FULL_SOFTMAX_MAX_ITEMS
    negatives = "full" if full else "mixed"
    reason = (
        f"negatives={negatives} ({shape.items} items {'<=' if full else '>'} "
        f"{FULL_SOFTMAX_MAX_ITEMS}, {shape.events_per_user:.1f} events/user)"
    )
    return config.model_copy(update={"negatives": negatives}), [reason]
