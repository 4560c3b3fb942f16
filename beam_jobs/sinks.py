"""Write the splits as gzip TFRecords of tf.train.Example, and the rejected rows as JSON lines."""

import json

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes

from beam_jobs.records import Interaction, Rejection
from recsys.schema import ITEM_ID, TIMESTAMP, USER_ID, WEIGHT, encode_example

TFRECORD_SUFFIX = ".tfrecord.gz"
REJECTED_DIR = "rejected"
REJECTED_PREFIX = "rejected"
REJECTED_SUFFIX = ".jsonl"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"


def to_example(interaction: Interaction) -> bytes:
    """One split row as a serialised tf.train.Example (recsys.schema is the only encoder)."""
    user, item, timestamp, weight = interaction
    return encode_example({USER_ID: user, ITEM_ID: item, TIMESTAMP: timestamp, WEIGHT: weight})


def to_json_line(record: Rejection) -> str:
    """One rejection as a JSON line; non-ASCII ids stay readable."""
    return json.dumps(record, ensure_ascii=False)


class WriteExamples(beam.PTransform):
    """Interactions -> `<prefix>-SSSSS-of-NNNNN.tfrecord.gz`, exactly `num_shards` files."""

    def __init__(self, file_prefix: str, num_shards: int) -> None:
        super().__init__()
        self._prefix = file_prefix
        self._shards = num_shards

    def expand(self, interactions: beam.PCollection) -> beam.PCollection:
        return (
            interactions
            | "Encode" >> beam.Map(to_example)
            | "Write"
            >> beam.io.WriteToTFRecord(
                self._prefix,
                file_name_suffix=TFRECORD_SUFFIX,
                num_shards=self._shards,
                shard_name_template=SHARD_TEMPLATE,
                compression_type=CompressionTypes.GZIP,
            )
        )


class WriteRejected(beam.PTransform):
    """Rejections -> `rejected/rejected-SSSSS-of-NNNNN.jsonl` (at least one file, maybe empty)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self._prefix = f"{out_dir}/{REJECTED_DIR}/{REJECTED_PREFIX}"

    def expand(self, rejected: beam.PCollection) -> beam.PCollection:
        return (
            rejected
            | "ToJson" >> beam.Map(to_json_line)
            | "Write"
            >> beam.io.WriteToText(
                self._prefix, file_name_suffix=REJECTED_SUFFIX, shard_name_template=SHARD_TEMPLATE
            )
        )
