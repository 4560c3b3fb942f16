"""The two-tower retrieval model (TensorFlow Recommenders), in small modules along its seams.

| module | what |
|---|---|
| `inputs` | index keys, id -> index lookups, PAD-padded histories |
| `layers` | masked mean, MLP, tower output, tables, baked side features |
| `features` | item / user side-feature token tables |
| `towers` | `QueryTower`, `CandidateTower` |
| `retrieval` | `TwoTowerModel`: the sampled-softmax task and train step |
| `trained` | `TrainedModel`: build, embed, save, load (the inference API) |
| `storage` | the saved format and its migrations |
| `warm_start` | initialising new towers from a previous model |
"""

from recsys.item_tokens import PAD
from recsys.model.features import (
    ITEM_FEATURE_COLUMNS,
    USER_FEATURE_BUCKETS,
    FeatureTables,
    ItemFeatures,
    UserFeatures,
)
from recsys.model.inputs import (
    HISTORY_INDEX,
    ITEM_INDEX,
    ITEM_LOG_PROB,
    TARGET_INDEX,
    USER_INDEX,
    feature_index,
    pad_histories,
    read_vocab,
    string_lookup,
)
from recsys.model.layers import Baked, masked_mean
from recsys.model.retrieval import TwoTowerModel, gather_global_candidates
from recsys.model.towers import CandidateTower, QueryTower
from recsys.model.trained import TrainedModel
from recsys.model.warm_start import warm_start

__all__ = [
    "HISTORY_INDEX",
    "ITEM_FEATURE_COLUMNS",
    "ITEM_INDEX",
    "ITEM_LOG_PROB",
    "PAD",
    "TARGET_INDEX",
    "USER_FEATURE_BUCKETS",
    "USER_INDEX",
    "Baked",
    "CandidateTower",
    "FeatureTables",
    "ItemFeatures",
    "QueryTower",
    "TrainedModel",
    "TwoTowerModel",
    "UserFeatures",
    "feature_index",
    "gather_global_candidates",
    "masked_mean",
    "pad_histories",
    "read_vocab",
    "string_lookup",
    "warm_start",
]
