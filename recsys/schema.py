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

SPLITS = ("train", "validation", "test")
"""Leave-last-out: a user's last interaction is `test`, the one before it `validation`."""

Kind = Literal["bytes", "int64", "float"]


@dataclass(frozen=True)
class Feature:
    """One scalar feature of an interaction example."""

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
)
FEATURE_NAMES = tuple(f.name for f in FEATURES)


def feature_spec() -> dict[str, tf.io.FixedLenFeature]:
    """The tf.io.parse_example spec for one interaction example."""
    import tensorflow as tf

    dtypes = {"bytes": tf.string, "int64": tf.int64, "float": tf.float32}
    return {f.name: tf.io.FixedLenFeature([], dtypes[f.kind], f.default) for f in FEATURES}


def encode_example(record: dict[str, Any]) -> bytes:
    """Serialise one interaction (a dict with every schema field) as a tf.train.Example."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example()
    fmap = example.features.feature
    for f in FEATURES:
        value = record[f.name]
        if f.kind == "bytes":
            fmap[f.name].bytes_list.value.append(
                value.encode("utf-8") if isinstance(value, str) else value
            )
        elif f.kind == "int64":
            fmap[f.name].int64_list.value.append(int(value))
        else:
            fmap[f.name].float_list.value.append(float(value))
    return example.SerializeToString()


def decode_example(data: bytes) -> dict[str, Any]:
    """Parse one serialised example back into Python values (tests and tools)."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(data)
    out: dict[str, Any] = {}
    for f in FEATURES:
        feat = example.features.feature[f.name]
        if f.kind == "bytes":
            out[f.name] = feat.bytes_list.value[0].decode("utf-8")
        elif f.kind == "int64":
            out[f.name] = int(feat.int64_list.value[0])
        else:
            out[f.name] = float(feat.float_list.value[0])
    return out
