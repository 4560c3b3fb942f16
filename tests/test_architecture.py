"""The package graph: no import cycle anywhere in our code (the layers are `lint-imports`').

And the one environment setting TensorFlow reads at its first import reaches every entry point.
"""

import graphlib
import os
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from recsys.core import layout

PACKAGES = ("conductor", "beam_jobs", "serving_export", "recsys")


def import_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One cycle a -> b -> ... -> a of module imports, or None when the graph has none."""
    order = graphlib.TopologicalSorter(
        {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    )
    try:
        order.prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


@pytest.fixture
def graph() -> grimp.ImportGraph:
    """Our four packages' import graph, top-level and function-local imports alike."""
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    """A cycle hides the data flow and the layer a module belongs to."""
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_finds_a_cycle(graph: grimp.ImportGraph) -> None:
    """The check is not vacuous: one import back up the layers is reported as a cycle."""
    graph.add_import(importer="recsys.core.layout", imported="conductor.stages")
    cycle = import_cycle(graph)
    assert cycle is not None and "conductor.stages" in cycle


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter whose environment has no TF_USE_LEGACY_KERAS."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_selects_keras_2_before_any_module_runs(package: str) -> None:
    """Each package's __init__ sets TF_USE_LEGACY_KERAS (recsys.core.tf_env): any entry works."""
    code = f"import os, {package}; print(os.environ.get('TF_USE_LEGACY_KERAS'))"
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1"


def test_tensorflow_imported_by_the_model_uses_tf_keras() -> None:
    """The model module imports TensorFlow at its top: Keras is still Keras 2 (tf_keras)."""
    done = _fresh_python("import recsys.model, tensorflow as tf; print(tf.keras.__name__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("tf_keras"), done.stdout


# File names of the working directory's folders: declared once, in recsys/core/layout.py.
LAYOUT_FILE_NAMES = (
    "stats.json",
    "item_features.parquet",
    "metrics.json",
    "export.json",
    "per_user_eval.parquet",
    "model.json",
    "history.json",
    "train.json",
    "nightly.json",
    "export_version.json",
    "summary.md",
    "config.yaml",
    "resolved_config.yaml",
    "champion.json",
    "manifest.json",
    "items.parquet",
    "users.parquet",
    "models.config",
    "mlflow_pending.json",
)
_ROOT = Path(__file__).resolve().parents[1]


def layout_literals(root: Path) -> list[str]:
    """`file:line: name` for each quoted layout file name in our packages outside layout.py."""
    pattern = re.compile("[\"'](" + "|".join(map(re.escape, LAYOUT_FILE_NAMES)) + ")[\"']")
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root).as_posix() == "recsys/core/layout.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if match := pattern.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {match.group(1)}")
    return found


def test_no_layout_file_name_outside_the_layout_module() -> None:
    """Stages name their files through recsys.core.layout (DataFile, RunFile, ...), not text."""
    assert layout_literals(_ROOT) == []


def test_the_literal_check_finds_a_literal(tmp_path: Path) -> None:
    """The check is not vacuous: a quoted file name in a package module is reported."""
    (tmp_path / "recsys").mkdir()
    (tmp_path / "recsys" / "stage.py").write_text('METRICS = run_dir / "metrics.json"\n')
    assert layout_literals(tmp_path) == ["recsys/stage.py:1: metrics.json"]


def test_every_stage_output_is_declared_and_completeness_follows_it(tmp_path: Path) -> None:
    """A folder holding a stage's declared outputs is complete; removing one makes it not."""
    for name in layout.STAGE_SPECS["evaluate"].writes:
        (tmp_path / name).write_text("{}")
    assert layout.missing_outputs("evaluate", tmp_path) == []
    (tmp_path / layout.RunFile.METRICS).unlink()
    assert layout.missing_outputs("evaluate", tmp_path) == ["metrics.json"]
    assert set(layout.STAGE_SPECS) == set(layout.STAGES)
    for spec in layout.STAGE_SPECS.values():
        earlier = layout.STAGES[: layout.STAGES.index(spec.name)]
        made = {
            n
            for s in earlier
            for n in (*layout.STAGE_SPECS[s].writes, *layout.STAGE_SPECS[s].optional)
        }
        assert set(spec.reads) <= made, f"{spec.name} reads what no earlier stage writes"
