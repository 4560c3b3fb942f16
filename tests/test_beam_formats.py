"""Input formats and presets: JSON Lines, headerless delimited text, MovieLens 1M/10M and
ml-latest, event-type filtering and day partitions."""

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from beam_jobs.inputs import list_input_files
from beam_jobs.items import read_items
from beam_jobs.pipeline import run_preprocess
from beam_jobs.readers import ReadSpec, read_delimited, read_jsonl, read_spec
from recsys.core.config import DataConfig, ItemsConfig, parse_config
from recsys.core.layout import SUCCESS, end_of_day_utc

RUN_DATE = dt.date(2026, 1, 5)
T = end_of_day_utc(RUN_DATE) - 86_400


def spec(**data: object) -> ReadSpec:
    """The ReadSpec of a DataConfig built from keyword settings."""
    return read_spec(DataConfig.model_validate({"path": "x", **data}))


def test_jsonl_rows_and_reasons(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(
        b'{"u": "a", "i": 1, "ts": "2026-01-04T10:00:00Z", "kind": "click"}\n'
        b"\n"
        b'{"u": "a", "i": 2, "ts": 1767520800000, "kind": "view"}\n'
        b"not json\n"
        b"[1, 2]\n"
        b'{"u": "a", "i": {"x": 1}, "ts": 1, "kind": "click"}\n'
        b'{"u": "\xff", "i": 3}\n'
    )
    columns = {"user_id": "u", "item_id": "i", "timestamp": "ts", "event_type": "kind"}
    s = spec(source="jsonl", timestamp_unit="ms", event_types=["click"], columns=columns)
    out = list(read_jsonl(str(path), s))
    rows = [o for o in out if not isinstance(o, dict)]
    reasons = [(o["row"], o["reason"]) for o in out if isinstance(o, dict)]
    assert [(r[1], r[2]) for r in rows] == [(1, ("a", 1, "2026-01-04T10:00:00Z", None))]
    assert reasons == [(3, "excluded_event_type"), (4, "malformed_row"), (5, "malformed_row"),
                       (6, "malformed_row"), (7, "undecodable")]  # fmt: skip


def test_headerless_columns_by_index_and_any_delimiter(tmp_path: Path) -> None:
    path = tmp_path / "log.psv"
    path.write_text(f"x|a|i1|{T}\nx|a|i2\n\nx|b|i3|{T + 1}\n")
    s = spec(source="csv", delimiter="|", header=False,
             columns={"user_id": 1, "item_id": 2, "timestamp": 3})  # fmt: skip
    out = list(read_delimited(str(path), s))
    assert out[0] == (str(path), 1, ("a", "i1", str(T), None), f"x|a|i1|{T}")
    assert out[1]["reason"] == "wrong_column_count" and out[1]["row"] == 2
    assert out[2][1] == 4


def test_movielens_1m_dat_preset_with_movies(tmp_path: Path) -> None:
    folder = tmp_path / "ml-1m"
    folder.mkdir()
    ratings = [f"{u}::{i}::{(i % 5) + 1}::{T + 60 * i}" for u in (1, 2) for i in range(1, 7)]
    (folder / "ratings.dat").write_text("\n".join(ratings) + "\n")
    movies = [f"{i}::Movie {i} (1999)::Comedy|Drama" for i in range(1, 7)]
    (folder / "movies.dat").write_bytes(("\n".join(movies) + "\n1::Caf\xe9::X\n").encode("latin-1"))
    config = parse_config({"data": {"source": "movielens-1m", "path": str(folder)}})
    out = tmp_path / "out"
    stats = run_preprocess(config, folder, out, RUN_DATE)
    assert stats["splits"] == {"train": 8, "validation": 2, "test": 2} and stats["rejected"] == 0
    features = pq.read_table(out / "item_features.parquet").to_pylist()
    assert {f["item_id"]: f["genres"] for f in features}["1"] == ["Comedy", "Drama"]
    assert (out / SUCCESS).is_file()


def test_movielens_latest_items_and_ratings_spec(tmp_path: Path) -> None:
    movies = tmp_path / "movies.csv"
    movies.write_text('movieId,title,genres\n1,"Toy Story (1995)",Adventure|Animation\n'
                      "2,Nothing,(no genres listed)\n")  # fmt: skip
    got = dict(read_items(ItemsConfig(path=str(movies), format="movielens-latest")))
    assert got == {"1": (("Adventure", "Animation"), "Toy Story (1995)"), "2": ((), "Nothing")}
    s = spec(source="movielens-latest")
    assert (s.user, s.item, s.timestamp, s.weight, s.delimiter) == (
        "userId", "movieId", "timestamp", "rating", ","
    )  # fmt: skip


def test_jsonl_item_file(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": "a", "name": "A", "tags": ["x", "y", "x"]}\nnot json\n{"id": ""}\n')
    cfg = ItemsConfig(path=str(path), format="jsonl", id_column="id", title_column="name",
                      genres_column="tags")  # fmt: skip
    assert list(read_items(cfg)) == [("a", (("x", "y"), "A"))]


def test_day_partitions_up_to_the_run_date(tmp_path: Path) -> None:
    events = tmp_path / "events"
    for day in range(1, 7):
        part = events / f"date=2026-01-0{day}"
        part.mkdir(parents=True)
        rows = [("u1", f"i{day}{k}", T - (5 - day) * 86_400 + k) for k in range(2)]
        table = pa.table({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                          "timestamp": [r[2] for r in rows]})  # fmt: skip
        pq.write_table(table, part / "part-0.parquet")
    (events / "date=2026-01-03" / "_SUCCESS").write_text("")
    files = list_input_files(events, "parquet", RUN_DATE)
    assert [Path(f.path).parent.name for f in files] == [f"date=2026-01-0{d}" for d in range(1, 6)]
    assert len(list_input_files(events, "parquet")) == 6
    config = parse_config({"data": {"source": "parquet", "path": str(events)}})
    stats = run_preprocess(config, events, tmp_path / "out", RUN_DATE)
    assert stats["input_rows"] == 10 and stats["rejected"] == 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["input_files"][0]["path"] == (
        files[0].path
    )
