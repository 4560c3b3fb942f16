"""The one definition of every feature on disk and in the model.

The Beam writer encodes examples with `encode_example`, the tf.data reader parses them with
`feature_spec`, and the model and serving signatures take their input names from the
constants here. Adding a feature means adding it to `FEATURES` and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import tensorflow as tf

USER_ID = "user_id"
ITEM_ID = "item_id"
TIMESTAMP = "timestamp"
WEIGHT = "weight"
HISTORY = "history"
GENRES = "genres"
TITLE = "title"

SPLITS = ("train", "validation", "test")
"""Leave-last-out: a user's last interaction is `test`, the one before it `validation`."""

Kind = Literal["bytes", "int64", "float", "bytes_list"]


@dataclass(frozen=True)
class Feature:
    """One feature of an interaction example (a scalar, or a variable-length list)."""

    name: str
    kind: Kind
    default: Any
    tower: Literal["query", "candidate", "none"]
    doc: str


FEATURES: tuple[Feature, ...] = (
    Feature(USER_ID, "bytes", b"", "query", "user id as in the raw log"),
    Feature(ITEM_ID, "bytes", b"", "candidate", "item id as in the raw log"),
    Feature(TIMESTAMP, "int64", 0, "none", "event time, seconds since the Unix epoch (UTC)"),
    Feature(WEIGHT, "float", 1.0, "none", "interaction strength (rating or 1.0)"),
    Feature(
        HISTORY,
        "bytes_list",
        (),
        "query",
        "the user's previous item ids strictly before this interaction, oldest first, at most "
        "preprocess.history_length (empty when the writer does not produce it)",
    ),
)
FEATURE_NAMES = tuple(f.name for f in FEATURES)

ITEM_FEATURES: tuple[Feature, ...] = (
    Feature(
        GENRES,
        "bytes_list",
        (),
        "candidate",
        "the item's genres (or any categorical tags), matched exactly after stripping spaces",
    ),
    Feature(
        TITLE,
        "bytes",
        b"",
        "candidate",
        "the item's title (or any short text), lower-cased and split into word tokens",
    ),
)
"""Item side features: columns of item_features.parquet (one row per item, written by the Beam
job) and inputs of the candidate SavedModel, never fields of an interaction example."""


def feature_spec(
    features: tuple[Feature, ...] = FEATURES,
) -> dict[str, tf.io.FixedLenFeature | tf.io.RaggedFeature]:
    """The tf.io.parse_example spec: scalars as [batch] tensors, lists as ragged [batch, None]."""
    import tensorflow as tf

    dtypes = {"bytes": tf.string, "int64": tf.int64, "float": tf.float32}
    spec: dict[str, tf.io.FixedLenFeature | tf.io.RaggedFeature] = {}
    for f in features:
        if f.kind == "bytes_list":
            spec[f.name] = tf.io.RaggedFeature(tf.string)
        else:
            spec[f.name] = tf.io.FixedLenFeature([], dtypes[f.kind], f.default)
    return spec


def encode_example(record: dict[str, Any]) -> bytes:
    """Serialise one interaction (a dict with every schema field) as a tf.train.Example."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example()
    fmap = example.features.feature
    for f in FEATURES:
        if f.kind == "bytes_list":
            fmap[f.name].bytes_list.value.extend(
                v.encode("utf-8") if isinstance(v, str) else v for v in record.get(f.name, ())
            )
            continue
        value = record[f.name]
        if f.kind == "bytes":
            fmap[f.name].bytes_list.value.append(
                value.encode("utf-8") if isinstance(value, str) else value
            )
        elif f.kind == "int64":
            fmap[f.name].int64_list.value.append(int(value))
        else:
            fmap[f.name].float_list.value.append(float(value))
    # Feature-map entries are serialised in hash order unless asked otherwise, and that order
    # differs between processes: deterministic=True sorts them, so the bytes are reproducible.
    return example.SerializeToString(deterministic=True)


def decode_example(data: bytes) -> dict[str, Any]:
    """Parse one serialised example back into Python values (tests and tools)."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(data)
    out: dict[str, Any] = {}
    for f in FEATURES:
        feat = example.features.feature[f.name]
        if f.kind == "bytes_list":
            out[f.name] = [v.decode("utf-8") for v in feat.bytes_list.value]
        elif f.kind == "bytes":
            out[f.name] = feat.bytes_list.value[0].decode("utf-8")
        elif f.kind == "int64":
            out[f.name] = int(feat.int64_list.value[0])
        else:
            out[f.name] = float(feat.float_list.value[0])
    return out
