"""recsys.api: one namespace of the documented entry points, loaded on first use."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from recsys import api

API_SOURCE = Path(api.__file__)


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """Public name -> (module, name) of the `if TYPE_CHECKING:` imports (what mypy sees)."""
    tree = ast.parse(API_SOURCE.read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    found = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            found[alias.asname or alias.name] = (node.module, alias.name)
    return found


def test_all_lists_every_source_and_the_type_checker_sees_the_same_objects() -> None:
    """`__all__`, the lazy table and the typed imports agree name for name."""
    assert sorted(api.__all__) == sorted(api._SOURCES)
    assert _type_checking_imports() == api._SOURCES
    assert len(set(api.__all__)) == len(api.__all__)


@pytest.mark.parametrize("name", api.__all__)
def test_each_public_name_is_its_modules_own_object(name: str) -> None:
    """No wrapper or copy: `api.X` is the object its module defines (one definition)."""
    module, attribute = api._SOURCES[name]
    assert getattr(api, name) is getattr(importlib.import_module(module), attribute)


def test_an_unknown_name_is_an_attribute_error() -> None:
    """A typo fails like any module attribute (and `from recsys.api import typo` too)."""
    with pytest.raises(AttributeError, match="no attribute 'run_nightlyy'"):
        api.run_nightlyy  # noqa: B018
    assert "run_nightly" in dir(api)


def test_importing_the_api_and_loading_a_config_import_no_tensorflow_or_beam() -> None:
    """Names load on first use: a config needs neither TensorFlow, Beam nor MLflow."""
    code = (
        "import sys\n"
        "from recsys import api\n"
        "config = api.load_config('configs/default.yaml')\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'tensorflow', 'apache_beam', 'mlflow', 'conductor'})\n"
        "print(config.model_name, heavy)\n"
    )
    root = API_SOURCE.parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[]"), done.stdout
