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
ITEM_IDS = "item_ids"
TIMESTAMPS = "timestamps"
SPLIT_CODES = "splits"

SPLITS = ("train", "validation", "test")
"""Leave-last-out: a user's last interaction is `test`, the one before it `validation`."""

Kind = Literal["bytes", "int64", "float", "bytes_list", "int64_list"]


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

SEQUENCE_FEATURES: tuple[Feature, ...] = (
    Feature(USER_ID, "bytes", b"", "query", "user id as in the raw log"),
    Feature(
        ITEM_IDS,
        "bytes_list",
        (),
        "none",
        "every kept interaction's item id in protocol order (timestamp, then item id)",
    ),
    Feature(TIMESTAMPS, "int64_list", (), "none", "each position's event time, Unix seconds"),
    Feature(
        SPLIT_CODES,
        "int64_list",
        (),
        "none",
        "each position's split, as an index into SPLITS (0 train, 1 validation, 2 test)",
    ),
)
"""One record per user (`sequences-*.tfrecord.gz`): the whole ordered sequence, each position
marked with its split, so one causal pass trains every position and evaluation and export
read a user's history without re-reading every interaction."""
SEQUENCE_FEATURE_NAMES = tuple(f.name for f in SEQUENCE_FEATURES)

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
        elif f.kind == "int64_list":
            spec[f.name] = tf.io.RaggedFeature(tf.int64)
        else:
            spec[f.name] = tf.io.FixedLenFeature([], dtypes[f.kind], f.default)
    return spec


def encode_example(record: dict[str, Any], features: tuple[Feature, ...] = FEATURES) -> bytes:
    """Serialise one record (a dict with every field of `features`) as a tf.train.Example."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example()
    fmap = example.features.feature
    for f in features:
        if f.kind == "bytes_list":
            fmap[f.name].bytes_list.value.extend(
                v.encode("utf-8") if isinstance(v, str) else v for v in record.get(f.name, ())
            )
            continue
        if f.kind == "int64_list":
            fmap[f.name].int64_list.value.extend(int(v) for v in record.get(f.name, ()))
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
    serialized: bytes = example.SerializeToString(deterministic=True)
    return serialized


def decode_example(data: bytes, features: tuple[Feature, ...] = FEATURES) -> dict[str, Any]:
    """Parse one serialised example back into Python values (tests and tools)."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(data)
    out: dict[str, Any] = {}
    for f in features:
        feat = example.features.feature[f.name]
        if f.kind == "bytes_list":
            out[f.name] = [v.decode("utf-8") for v in feat.bytes_list.value]
        elif f.kind == "int64_list":
            out[f.name] = [int(v) for v in feat.int64_list.value]
        elif f.kind == "bytes":
            out[f.name] = feat.bytes_list.value[0].decode("utf-8")
        elif f.kind == "int64":
            out[f.name] = int(feat.int64_list.value[0])
        else:
            out[f.name] = float(feat.float_list.value[0])
    return out
