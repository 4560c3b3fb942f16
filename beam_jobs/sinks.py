"""Write the splits as gzip TFRecords of tf.train.Example, and the rejected rows as JSON lines.

The TFRecord writing is deterministic: a row's shard is a stable hash of its user id and each
shard's rows are written in sorted order (beam_jobs.split), encoded by beam_jobs.examples in
fixed-size chunks, so the same input gives byte-identical files whatever the runner's
bundling (Beam's WriteToTFRecord keeps arrival order, which is not stable).
"""

import gzip
import json
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import apache_beam as beam

from beam_jobs.records import Rejection

TFRECORD_SUFFIX = ".tfrecord.gz"
REJECTED_DIR = "rejected"
REJECTED_PREFIX = "rejected"
REJECTED_SUFFIX = ".jsonl"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"


def shard_of(user_id: str, num_shards: int) -> int:
    """The shard of a user's rows: crc32 of the id, stable across processes (unlike hash())."""
    return zlib.crc32(user_id.encode("utf-8")) % num_shards


def shard_path(prefix: str, shard: int, num_shards: int) -> str:
    """`<prefix>-SSSSS-of-NNNNN.tfrecord.gz`."""
    return f"{prefix}-{shard:05d}-of-{num_shards:05d}{TFRECORD_SUFFIX}"


class TFRecordFile:
    """A gzip TFRecord file written from framed chunks, compressed in a helper thread.

    zlib releases the GIL while it compresses, so the next chunk is encoded while the last
    one is compressed (deflate at level 6 is about as costly as the encoding). At most
    `MAX_PENDING` chunks wait, so memory stays bounded. The gzip header carries no time and no
    file name: the bytes depend on the content only.
    """

    MAX_PENDING = 2

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._raw = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._gzip = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0,
                                   compresslevel=6)  # fmt: skip
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: deque[Future[int]] = deque()

    def write(self, chunk: memoryview | bytes) -> None:
        """Queue framed records for compression, in order."""
        self._pending.append(self._pool.submit(self._gzip.write, chunk))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft().result()

    def close(self) -> None:
        """Finish every pending chunk and close the file."""
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown()
            self._gzip.close()
            self._raw.close()

    def __enter__(self) -> "TFRecordFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
