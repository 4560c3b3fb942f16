"""Write the splits as gzip TFRecords of tf.train.Example, and the rejected rows as JSON lines.

The TFRecord writing is deterministic: a row's shard is a stable hash of its user id and each
shard's rows are written in sorted order (beam_jobs.split), so the same input gives
byte-identical files whatever the runner's bundling (Beam's WriteToTFRecord keeps arrival
order, which is not stable).
"""

import gzip
import io
import json
import zlib
from pathlib import Path

import apache_beam as beam
from apache_beam.io.tfrecordio import _TFRecordUtil

from beam_jobs.records import Interaction, Rejection
from recsys.schema import HISTORY, ITEM_ID, TIMESTAMP, USER_ID, WEIGHT, encode_example

TFRECORD_SUFFIX = ".tfrecord.gz"
REJECTED_DIR = "rejected"
REJECTED_PREFIX = "rejected"
REJECTED_SUFFIX = ".jsonl"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"
WRITE_CHUNK_BYTES = 1 << 20


def to_example(interaction: Interaction) -> bytes:
    """One split row as a serialised tf.train.Example (recsys.schema is the only encoder)."""
    user, item, timestamp, weight, history = interaction
    return encode_example(
        {USER_ID: user, ITEM_ID: item, TIMESTAMP: timestamp, WEIGHT: weight, HISTORY: history}
    )


def shard_of(user_id: str, num_shards: int) -> int:
    """The shard of a user's rows: crc32 of the id, stable across processes (unlike hash())."""
    return zlib.crc32(user_id.encode("utf-8")) % num_shards


def shard_path(prefix: str, shard: int, num_shards: int) -> str:
    """`<prefix>-SSSSS-of-NNNNN.tfrecord.gz`."""
    return f"{prefix}-{shard:05d}-of-{num_shards:05d}{TFRECORD_SUFFIX}"


def write_shard(rows: list[Interaction], path: str) -> str:
    """Write rows, in the order given, as one gzip TFRecord file of tf.train.Example."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 and no file name in the gzip header: the bytes depend on the content only.
    # Records are framed into a buffer and compressed a chunk at a time: compressing each
    # record on its own costs more than encoding it. Level 6 is zlib's (and TensorFlow's) default.
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as fh,
    ):
        buffer = io.BytesIO()
        for row in rows:
            _TFRecordUtil.write_record(buffer, to_example(row))
            if buffer.tell() >= WRITE_CHUNK_BYTES:
                fh.write(buffer.getbuffer())
                buffer = io.BytesIO()
        fh.write(buffer.getbuffer())
    return path


def to_json_line(record: Rejection) -> str:
    """One rejection as a JSON line; non-ASCII ids stay readable."""
    return json.dumps(record, ensure_ascii=False)


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
