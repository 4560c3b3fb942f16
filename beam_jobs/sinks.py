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
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import apache_beam as beam
from apache_beam.typehints import no_annotations

from beam_jobs.records import Rejection
from recsys.core.layout import TFRECORD_SUFFIX

REJECTED_DIR = "rejected"
REJECTED_PREFIX = "rejected"
REJECTED_SUFFIX = ".jsonl"


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


def rejection_shard(record: Rejection, num_shards: int) -> int:
    """The rejected-rows file of a record: crc32 of its file and row (stable across processes)."""
    return zlib.crc32(f"{record['file']}\0{record['row']}".encode()) % num_shards


def _write_rejected(element: tuple[int, Iterable[str | None]], prefix: str, num_shards: int) -> str:
    """One file of JSON lines sorted as text: the same records give the same bytes."""
    shard, lines = element
    path = f"{prefix}-{shard:05d}-of-{num_shards:05d}{REJECTED_SUFFIX}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(f"{line}\n" for line in sorted(line for line in lines if line is not None))
    return path


class WriteRejected(beam.PTransform):
    """Rejections -> `rejected/rejected-SSSSS-of-NNNNN.jsonl`, N files (empty when nothing was).

    Each record goes to the file of its (file, row) hash, and each file's lines are sorted, so
    the bytes do not depend on the runner's bundling or arrival order (WriteToText keeps
    arrival order, and the Dask runner loses the outputs its file sink emits at bundle end).
    """

    def __init__(self, out_dir: str, num_shards: int = 1) -> None:
        super().__init__()
        self._prefix = f"{out_dir}/{REJECTED_DIR}/{REJECTED_PREFIX}"
        self._shards = num_shards

    @no_annotations  # Beam only understands PCollection-typed expand hints
    def expand(self, rejected: beam.PCollection) -> beam.PCollection:
        n = self._shards
        keyed = rejected | "ToJson" >> beam.Map(
            lambda record: (rejection_shard(record, n), to_json_line(record))
        )
        # Every file exists, even without a record: one empty marker per shard.
        every = rejected.pipeline | "EveryShard" >> beam.Create([(i, None) for i in range(n)])
        return (
            (keyed, every)
            | "WithEveryShard" >> beam.Flatten()
            | "ByShard" >> beam.GroupByKey()
            | "Write" >> beam.Map(_write_rejected, self._prefix, n)
        )
