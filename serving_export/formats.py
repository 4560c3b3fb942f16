"""`recsys embeddings export`: a version's embeddings in the format another consumer reads.

Every format is written from files that passed `load_embeddings` (checksums, dimension,
vocabulary hashes against the manifest), into a temporary folder renamed onto the output:

- parquet: the validated items.parquet / users.parquet and manifest.json, copied;
- npy: `<kind>.npy` float32 [n, d] and `<kind>_ids.npy` (unicode ids, no pickle needed);
- tfrecord: `<kind>.tfrecord`, one tf.train.Example per row: the id, `embedding` (float
  list), `model_version` and the extra columns (times as int64 Unix seconds).

The manifest.json is copied beside every format, so the output still says which model
version, dimension and similarity its vectors belong to.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from recsys.core.errors import DataError
from recsys.core.layout import atomic_dir
from serving_export.manifest import KINDS, MANIFEST, Embeddings, load_embeddings, read_manifest

FORMATS = ("parquet", "npy", "tfrecord")


def export_embeddings(directory: Path, fmt: str, output: Path) -> list[Path]:
    """Write the embeddings version in `directory` as `fmt` into `output`; the files written."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    directory, output = Path(directory), Path(output)
    if not (directory / MANIFEST).is_file():
        have = sorted((p.name for p in directory.parent.glob("*") if p.name.isdigit()), key=int)
        raise DataError(
            f"no exported embeddings version at {directory} "
            f"(versions present: {', '.join(have) or 'none'}); run `recsys export` first"
        )
    kinds = [k for k in KINDS if k in read_manifest(directory)["files"]]
    with atomic_dir(output) as tmp:
        for kind in kinds:
            loaded = load_embeddings(directory, kind)
            if fmt == "parquet":
                shutil.copy2(directory / loaded.manifest["files"][kind]["file"], tmp)
            elif fmt == "npy":
                np.save(tmp / f"{kind}.npy", loaded.vectors)
                np.save(tmp / f"{kind}_ids.npy", np.array(loaded.ids, dtype=str))
            else:
                _write_tfrecord(tmp / f"{kind}.tfrecord", KINDS[kind], loaded)
        shutil.copy2(directory / MANIFEST, tmp / MANIFEST)
    return sorted(output.iterdir())


def _write_tfrecord(path: Path, id_column: str, loaded: Embeddings) -> None:
    import tensorflow as tf
    from tensorflow.core.example import example_pb2

    with tf.io.TFRecordWriter(str(path)) as writer:
        for row, (uid, vector) in enumerate(zip(loaded.ids, loaded.vectors, strict=True)):
            example = example_pb2.Example()
            features = example.features.feature
            features[id_column].bytes_list.value.append(uid.encode("utf-8"))
            features["embedding"].float_list.value.extend(vector.tolist())
            features["model_version"].int64_list.value.append(loaded.version)
            for name, values in loaded.columns.items():
                _set(features[name], values[row])
            writer.write(example.SerializeToString(deterministic=True))


def _set(feature: Any, value: Any) -> None:
    """One extra column value into a tf.train.Feature (a null leaves the feature empty)."""
    if value is None:
        return
    if isinstance(value, dt.datetime):
        feature.int64_list.value.append(int(value.timestamp()))
    elif isinstance(value, bool | int | np.integer):
        feature.int64_list.value.append(int(value))
    elif isinstance(value, float | np.floating):
        feature.float_list.value.append(float(value))
    else:
        feature.bytes_list.value.append(str(value).encode("utf-8"))
