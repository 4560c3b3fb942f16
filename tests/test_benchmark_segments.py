"""The segment view of the quality benchmark: bands by history length and item popularity."""

from __future__ import annotations

import numpy as np

from benchmarks import protocol, segments


def test_history_bands_are_user_terciles_with_edges_in_the_lower_band() -> None:
    band, labels = segments.history_bands(np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert band.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert labels == ["short (<= 3)", "medium (4-6)", "long (> 6)"]


def test_history_bands_name_an_empty_or_single_value_middle_band() -> None:
    _, labels = segments.history_bands(np.array([2, 2, 2, 2, 2, 9]))
    assert labels[1] == "medium (none)"
    _, labels = segments.history_bands(np.array([1, 1, 2, 2, 3, 3]))
    assert labels == ["short (<= 1)", "medium (2)", "long (> 2)"]


def test_popularity_bands_hold_a_third_of_the_interactions_each() -> None:
    # 12 interactions, items by count: 3 (5), 0 (3), 4 (2), ... Item 3 has none ranked before
    # it (head), item 0 has 5 (under 8: torso), item 4 has 8 (not under two thirds: tail).
    counts = np.array([3, 1, 1, 5, 2, 0])
    band, labels = segments.popularity_bands(counts, np.array([3, 0, 4, 1, 2, 5, -1]))
    assert band.tolist() == [0, 1, 2, 2, 2, 2, 2]  # -1: outside the catalog, tail
    assert labels == ["head (1 items)", "torso (1 items)", "tail (4 items)"]


def test_segments_follow_the_protocol_split() -> None:
    # u1 has 6 events, u2 and u3 have 5: each user's last is test, the one before validation.
    users = ["u1"] * 6 + ["u2"] * 5 + ["u3"] * 5
    items = [*"123451", *"12362", *"13459"]
    log = protocol.Log(
        np.array(users), np.array(items), np.arange(len(users), dtype=np.int64), True, "test"
    )
    split = protocol.leave_last_out(log)
    found = segments.segments_of_test_users(split)
    history, _ = found["history"]
    assert history.tolist() == [2, 0, 0]  # known items at test time: 5, 4, 4
    popularity, _ = found["popularity"]
    # Known interactions: item 1 x3, 2 x2, 3 x3, 4 x2, 5 x2, 6 x1 (13). Test items: 1, 2, and
    # 9 (outside the catalog).
    assert popularity.tolist()[2] == 2
    assert popularity.tolist()[0] == 0  # item 1 ranks first (ties: catalog order)
    assert popularity.tolist()[1] == 1  # item 2: 6 interactions ranked before it (< 2/3 of 13)


def test_segment_table_reports_each_band_and_the_relative_difference() -> None:
    per_user = {
        "ref": {"ndcg_at_10": np.array([0.5, 0.5, 0.2, 0.0]),
                "recall_at_10": np.array([1.0, 1.0, 1.0, 0.0])},
        "ours": {"ndcg_at_10": np.array([1.0, 0.5, 0.1, 0.0]),
                 "recall_at_10": np.array([1.0, 1.0, 1.0, 1.0])},
    }  # fmt: skip
    table = segments.segment_table(
        per_user, np.array([0, 0, 1, 1]), ["a", "b", "c"], "ours", "ref", resamples=200
    )
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| a | 2 | 0.5000 / 1.0000 | 0.7500 / 1.0000 | +50.0% (")
    assert "| +0.0% (+0.0%, +0.0%) |" in rows[0]  # recall equal on every user: no spread
    assert rows[1].startswith("| b | 2 | 0.1000 / 0.5000 | 0.0500 / 1.0000 | -50.0% (")
    assert rows[2] == "| c | 0 | n/a | n/a | n/a | n/a |"
