"""One set of defaults and one resolution: what a config trains, and where each value came from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conductor.cli import main
from recsys.core import auto
from recsys.core.auto import DataShape, DeviceFacts
from recsys.core.config import RecsysConfig, load_config, parse_config, set_values
from recsys.core.layout import Workdir
from recsys.core.resolve import mlflow_params, read_settings, resolve_config, write_settings
from tests.conftest import REPO, SMALL

# stats.json of the two data sets the defaults were chosen on (counts as the Beam job writes).
ML100K = {"users": 943, "items": 1682, "splits": {"train": 98114, "validation": 943, "test": 943}}
BEAUTY = {"users": 22363, "items": 12101, "splits": {"train": 153776, "validation": 22363,
                                                      "test": 22363}}  # fmt: skip
CPU = DeviceFacts()


def test_a_minimal_config_trains_the_benchmarked_model() -> None:
    """No setting given: the transformer tower, early stopping, the refit on every split."""
    for config in (RecsysConfig(), load_config(None), parse_config({"model_name": "m"})):
        m, t = config.model, config.training
        assert (m.query_encoder, m.negatives, m.user_embedding) == ("transformer", "auto", "auto")
        assert (t.optimizer, t.learning_rate_schedule) == ("lazy_adam", "auto")
        assert (t.early_stopping_patience, t.refit) == (2, "all")
    dense = resolve_config(RecsysConfig(), ML100K, CPU).config
    assert (dense.model.negatives, dense.model.user_embedding) == ("full", True)
    assert dense.training.learning_rate_schedule == "cosine"
    sparse = resolve_config(RecsysConfig(), BEAUTY, CPU).config
    assert (sparse.model.negatives, sparse.model.user_embedding) == ("full", False)
    assert sparse.training.learning_rate_schedule == "constant"
    assert (sparse.training.precision, sparse.training.jit_compile) == ("float32", "off")
    assert sparse.training.strategy == "one_device"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_set_only_what_differs_from_the_defaults(path: Path) -> None:
    """A shipped config names its data; the model and its training are the defaults."""
    config = load_config(path)
    assert set(config.model_fields_set) <= {"model_name", "data"}, config.model_fields_set
    assert config.model == RecsysConfig().model and config.training == RecsysConfig().training


def test_rules_decide_by_the_data_and_the_devices() -> None:
    assert auto.negatives(DataShape(12_101, 9.0)) == ("full", "12101 items <= 50000")
    assert auto.negatives(DataShape(5_000_000, 9.0))[0] == "mixed"
    assert auto.user_embedding(DataShape(12_101, 9.0), 20) == (
        False,
        "9.0 events/user <= history_length 20",
    )
    assert auto.user_embedding(DataShape(10, 1.0), 0)[0] is True  # no history: ids only
    assert auto.learning_rate_schedule(DataShape(1_682, 106.0), 20)[0] == "cosine"
    volta, kepler = DeviceFacts(gpu_capabilities=((7, 0),)), DeviceFacts(gpu_capabilities=((3, 5),))
    assert auto.precision(CPU)[0] == auto.precision(kepler)[0] == "float32"
    assert auto.precision(volta)[0] == "mixed_float16"
    # XLA on one GPU only: on CPU the blocked loss without XLA is faster; sequence windows
    # pick their trained positions at run time, which XLA cannot compile.
    assert auto.jit_compile(volta, "rows")[0] == "on"
    assert auto.jit_compile(CPU, "rows")[0] == auto.jit_compile(volta, "sequences")[0] == "off"
    two = DeviceFacts(strategy="mirrored", replicas=2, gpu_capabilities=((8, 0), (8, 0)))
    assert auto.jit_compile(two, "rows") == ("off", "2 replicas")
    assert resolve_config(RecsysConfig(), None, two).config.training.strategy == "mirrored"


def test_each_value_names_its_source() -> None:
    config = parse_config({"model": {"embedding_dim": 32, "negatives": "in_batch"}})
    config = set_values(config, {"training.epochs": 3})
    settings = resolve_config(config, ML100K, CPU).settings
    assert settings["model.embedding_dim"].source == "file"
    assert settings["model.negatives"].source == "file"  # a value given is kept
    assert settings["training.epochs"].source == "override"
    assert settings["model.temperature"].source == "default"
    negatives = resolve_config(RecsysConfig(), ML100K, CPU).settings["model.negatives"]
    assert (negatives.value, negatives.source, negatives.written) == ("full", "auto", "auto")
    assert negatives.why == "full: 1682 items <= 50000"


def test_undecided_auto_settings_carry_their_rule() -> None:
    """Without the data or the devices, an `auto` stays auto and says how it will be decided."""
    settings = resolve_config(RecsysConfig()).settings
    for rule in auto.RULES:
        assert settings[rule.key].value == "auto" and settings[rule.key].source == "default"
        assert rule.rule in settings[rule.key].why
    assert "50,000 items" in settings["model.negatives"].why
    data_only = resolve_config(RecsysConfig(), ML100K).settings
    assert data_only["model.negatives"].value == "full"
    assert data_only["training.precision"].value == "auto"


def test_dense_log_applies_before_the_auto_rules() -> None:
    config = parse_config(
        {"dense_log": {"min_events_per_user": 50, "settings": {"model.history_length": 10}}}
    )
    dense = resolve_config(config, ML100K, CPU)  # 106 events/user
    history = dense.settings["model.history_length"]
    assert (history.value, history.source, history.written) == (10, "dense_log", 20)
    assert history.why == "dense_log: 106.0 events/user >= 50"
    assert dense.dense_log_settings == {"model.history_length": 10}
    # The auto rules read the window dense_log set.
    assert "history_length 10" in dense.settings["model.user_embedding"].why
    sparse = resolve_config(config, BEAUTY, CPU)
    assert sparse.settings["model.history_length"].source == "default"
    assert sparse.notes[0] == "dense_log: 8.9 events/user < 50: not applied"


def test_resolution_is_pure_and_idempotent_in_values() -> None:
    first = resolve_config(RecsysConfig(), BEAUTY, CPU)
    assert first == resolve_config(RecsysConfig(), BEAUTY, CPU)
    again = resolve_config(first.config, BEAUTY, CPU)
    assert again.config.flat() == first.config.flat()


def test_recorded_settings_round_trip_and_become_mlflow_params(tmp_path: Path) -> None:
    config = parse_config({"tracking": {"uri": "https://user:s3cret@mlflow.example"}})
    resolved = resolve_config(config, ML100K, CPU)
    path = tmp_path / "resolved_config.yaml"
    write_settings(path, resolved.records())
    assert "s3cret" not in path.read_text()
    settings = read_settings(path)
    assert set(settings) == set(config.flat())
    assert settings["model.negatives"].written == "auto"
    params = mlflow_params(settings)
    assert params["model.negatives"] == "full" and params["written.model.negatives"] == "auto"
    assert params["training.epochs"] == 10 and "written.training.epochs" not in params
    assert yaml.safe_load(path.read_text())["training.refit"] == {"value": "all",
                                                                   "source": "default"}  # fmt: skip


def _show(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, tuple[str, str]]:
    """`recsys config show` run in-process: {key: (value, origin)}."""
    assert main(["config", "show", *args]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if not line.startswith("#"):
            key, _, rest = line.partition(" = ")
            value, _, origin = rest.partition("  # ")
            rows[key.strip()] = (value.strip(), origin)
    return rows


def test_config_show_names_each_source_for_a_data_folder(
    prepared: tuple[RecsysConfig, Workdir, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, _, data_dir = prepared
    raw = {**SMALL, "dense_log": {"min_events_per_user": 5, "settings": {"training.epochs": 4}}}
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(raw))
    stats = yaml.safe_load((data_dir / "stats.json").read_text())
    show = ["--config", str(config), "--set", "model.temperature=0.2", "--data", str(data_dir)]
    rows = _show(capsys, *show)
    assert rows["model.embedding_dim"] == ("16", "file")
    assert rows["model.temperature"] == ("0.2", "override")
    assert rows["model.query_encoder"] == ("transformer", "default")
    assert rows["training.epochs"][0] == "4"
    assert rows["training.epochs"][1].startswith("dense_log (written 2): ")
    assert rows["model.negatives"] == ("full", f"auto: full: {stats['items']} items <= 50000")
    assert rows["model.user_embedding"][1].startswith("auto: false: ")
    # Device rules are decided where the model trains: shown with their rule.
    precision = rows["training.precision"]
    assert precision[0] == "auto" and precision[1].startswith("default: auto, decided on the")
    undecided = _show(capsys, "--config", str(config))
    assert undecided["model.negatives"][0] == "auto"
    assert "full when the catalog has at most 50,000 items" in undecided["model.negatives"][1]


def test_config_show_without_a_configs_folder_gives_the_same_defaults(tmp_path: Path) -> None:
    """The Docker image installs the packages without configs/: the defaults must not move."""
    site = tmp_path / "site"
    for package in ("recsys", "conductor"):
        shutil.copytree(
            REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    code = "import recsys, conductor.cli as c, sys; print(recsys.__file__); c.main(sys.argv[1:])"

    def show(root: Path, *args: str) -> list[str]:
        env = {**os.environ, "PYTHONPATH": str(root)}
        proc = subprocess.run([sys.executable, "-c", code, "config", "show", *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
                              check=True)  # fmt: skip
        first, *rows = proc.stdout.splitlines()
        assert first.startswith(str(root)), first  # this copy of the package was imported
        return rows

    bare = show(site)
    assert bare == show(REPO)
    with_file = show(REPO, "--config", str(REPO / "configs" / "default.yaml"))
    strip = [row.partition("  # ")[0] for row in bare]
    assert strip == [row.partition("  # ")[0] for row in with_file]
