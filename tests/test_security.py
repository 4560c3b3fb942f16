"""Security checks (docs/OPERATIONS.md, Security), against a real `mlflow server`.

- the tracking server listens on loopback only unless configured;
- no credential reaches MLflow params, tags, artifacts, the registry or the CLI's output;
- config values that become paths cannot leave the working directory;
- nothing in our source unpickles data (pickle, np.load, joblib, torch, yaml, pyfunc models).
"""

from __future__ import annotations

import ast
import datetime as dt
import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conductor.cli import main as cli_main
from conductor.promotion import PENDING, publish_run
from recsys.core.config import RecsysConfig, parse_config
from recsys.core.errors import ConfigError
from recsys.core.layout import Workdir
from recsys.core.redact import (
    REDACTED,
    RedactingFilter,
    is_secret_name,
    redact_text,
    redact_tree,
)
from recsys.tracking.runs import redacted_text_file
from tests.mlflow_server import (
    MlflowServer,
    _wait_healthy,
    free_port,
    stop_group,
)
from tests.test_tracking_registry import PER_USER, fake_run

REPO = Path(__file__).resolve().parent.parent
DATE = dt.date(2026, 1, 5)
# Distinct secrets, so a failure says which route leaked.
URI_SECRET = "uri-s3cr3t-Zq7"
ENV_PASSWORD = "env-pa55w0rd-Xk4"
ENV_TOKEN = "env-t0ken-Wm9"
FLAG_SECRET = "flag-s3cr3t-Hb2"
SECRETS = (URI_SECRET, ENV_PASSWORD, ENV_TOKEN, FLAG_SECRET)


# --- the tracking server binds to loopback -------------------------------------------------


def _listening(inodes: set[str] | None = None, port: int | None = None) -> list[str]:
    """Addresses of listening TCP sockets (IPv4 and IPv6), by socket inode or by port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            address, port_hex = local.split(":")
            if state != "0A":  # TCP_LISTEN
                continue
            if (inodes is not None and inode not in inodes) or (
                port is not None and int(port_hex, 16) != port
            ):
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(str(ipaddress.ip_address(words)))
    return found


def _socket_inodes_of_group(pgid: int) -> set[str]:
    """Inodes of every socket held open by a process of the process group."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # Field 5 of /proc/<pid>/stat is the process group; the name before it may hold spaces.
            pgrp = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if pgrp != pgid:
                continue
            targets = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
        inodes |= {m[1] for t in targets if (m := re.fullmatch(r"socket:\[(\d+)\]", t))}
    return inodes


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


@pytest.mark.timeout(180)
def test_start_server_script_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_HOST"}
    env.update(
        MLFLOW_PORT=str(port),
        MLFLOW_STORE_DIR=str(tmp_path / "store"),
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            ["bash", str(REPO / "mlflow" / "start-server.sh")],
            stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout_s=150)
        addresses = _listening(inodes=_socket_inodes_of_group(proc.pid))
    finally:
        stop_group(proc)
    # Non-empty first: the check must have found the server's socket to mean anything.
    assert addresses, f"no listening socket found for the server's process group: {log}"
    assert all(_is_loopback(a) for a in addresses), addresses


def test_start_server_script_host_is_configurable_and_loopback_by_default() -> None:
    script = (REPO / "mlflow" / "start-server.sh").read_text()
    assert re.search(r'^host="\$\{MLFLOW_HOST:-127\.0\.0\.1\}"$', script, flags=re.MULTILINE)
    assert re.findall(r"--host \S+", script) == ['--host "$host"']
    assert "0.0.0.0" not in script.split("set -euo pipefail", 1)[1]


def test_test_server_listens_on_loopback_only(server: MlflowServer) -> None:
    port = int(server.uri.rsplit(":", 1)[1])
    addresses = _listening(port=port)
    assert addresses and all(_is_loopback(a) for a in addresses), addresses


# --- redaction units -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://u:p@host:5000/x", "http://host:5000/x"),
        ("postgresql://user:pw@db/mlflow", "postgresql://db/mlflow"),
        ("--aws_secret_access_key=abc --runner=DataflowRunner",
         "--aws_secret_access_key=*** --runner=DataflowRunner"),
        ("gs://b/o?sv=1&sig=abc%2F&se=2", "gs://b/o?sv=1&sig=***&se=2"),
        ("--temp_location=gs://b/t?sig=abc&x=1", "--temp_location=gs://b/t?sig=***&x=1"),
        ("{'password': 'hunter2', 'user': 'bob'}", "{'password': '***', 'user': 'bob'}"),
        ("MLFLOW_TRACKING_TOKEN=abc", "MLFLOW_TRACKING_TOKEN=***"),
        ("model.max_title_tokens=16 key=value", "model.max_title_tokens=16 key=value"),
        ("mail bob@example.com at 12:30", "mail bob@example.com at 12:30"),
    ],
)  # fmt: skip
def test_redact_text(text: str, expected: str) -> None:
    assert redact_text(text, environ={}) == expected


def test_environment_secrets_are_redacted_wherever_they_appear() -> None:
    env = {"MLFLOW_TRACKING_PASSWORD": "pw12", "AWS_SECRET_ACCESS_KEY": "AKIAxyz123", "FLAG": "1"}
    text = "connect with pw12, key AKIAxyz123, retries 1"
    assert redact_text(text, environ=env) == "connect with ***, key ***, retries 1"


def test_the_working_directory_is_not_a_secret() -> None:
    env = {"PWD": "/srv/recsys", "OLDPWD": "/home/ops"}
    text = "train: /srv/recsys/recsys-work/data/2026-01-05 (from /home/ops)"
    assert redact_text(text, environ=env) == text


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("MLFLOW_TRACKING_PASSWORD", True), ("mlflow_tracking_token", True), ("apiKey", True),
        ("aws_secret_access_key", True), ("storage.account_key", True), ("sig", True),
        ("model.max_title_tokens", False), ("key", False), ("primary_key", False),
        ("tracking.uri", False), ("SSH_AUTH_SOCK", False), ("PWD", False), ("OLDPWD", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_tree_by_key_and_value() -> None:
    tree = {"db": {"password": "a b c", "uri": "http://u:p@h/"}, "args": ["--token=t", 3]}
    assert redact_tree(tree, environ={}) == {
        "db": {"password": REDACTED, "uri": "http://h/"},
        "args": ["--token=***", 3],
    }


def test_text_artifacts_are_redacted_by_key_and_value(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("db:\n  password: two words\n  uri: http://u:p@h/\n")
    (tmp_path / "t.json").write_text(json.dumps({"data_dir": "/w/data", "token": 7}))
    (tmp_path / "clean.json").write_text(json.dumps({"data_dir": "/w/data"}))
    (tmp_path / "w.bin").write_bytes(b"password=abc")  # not a text artifact: logged as is
    assert yaml.safe_load(redacted_text_file(tmp_path / "c.yaml") or "") == {
        "db": {"password": REDACTED, "uri": "http://h/"}
    }
    assert json.loads(redacted_text_file(tmp_path / "t.json") or "") == {
        "data_dir": "/w/data",
        "token": REDACTED,
    }
    assert redacted_text_file(tmp_path / "clean.json") is None
    assert redacted_text_file(tmp_path / "w.bin") is None


def test_log_filter_redacts_messages_and_tracebacks() -> None:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Collect()
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("recsys.test_security")
    logger.addHandler(handler)
    try:
        logger.warning("server %s down", f"http://u:{URI_SECRET}@h:1")
        try:
            raise RuntimeError(f"cannot reach https://u:{URI_SECRET}@h:2/api")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert records[0] == "server http://h:1 down"
    assert "RuntimeError: cannot reach https://h:2/api" in records[1]
    assert URI_SECRET not in "\n".join(records)


# --- no secret reaches MLflow or the output, against a real server -------------------------


def _secret_config(small_config: RecsysConfig, uri: str, model_name: str) -> RecsysConfig:
    """A config whose tracking URI, data path and Beam flags all carry credentials."""
    raw = small_config.model_dump(mode="json")
    raw["model_name"] = model_name
    raw["tracking"] = {
        "uri": uri.replace("http://", f"http://alice:{URI_SECRET}@"),
        "retries": 2,
        "backoff_seconds": 0.1,
    }
    raw["data"]["source"] = "csv"
    raw["data"]["path"] = f"https://bob:{URI_SECRET}@data.example/log.csv"
    raw["preprocess"]["beam_args"] = [
        f"--aws_secret_access_key={FLAG_SECRET}",
        f"--temp_location=gs://bucket/tmp?sig={FLAG_SECRET}",
    ]
    return parse_config(raw)


def _secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server without auth ignores these; MLflow's client still sends them with each request.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ENV_PASSWORD)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", ENV_TOKEN)


def _assert_nothing_recorded_leaks(
    server: MlflowServer, run_id: str, model_name: str, tmp: Path
) -> None:
    """Params, tags, artifacts (every byte), dataset inputs and registry entries of the run."""
    client = MlflowClient(server.uri)
    run = client.get_run(run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    registered = client.get_registered_model(model_name)
    versions = client.search_model_versions(f"name = '{model_name}'")
    recorded = json.dumps(
        {
            "params": run.data.params,
            "tags": run.data.tags,
            "run_name": run.info.run_name,
            "inputs": [d.dataset.source for d in run.inputs.dataset_inputs],
            "experiment": [experiment.name, experiment.tags, experiment.artifact_location],
            "model": [registered.description, registered.tags],
            "versions": [[v.source, v.description, v.tags, v.run_link] for v in versions],
        }
    )
    downloaded = Path(client.download_artifacts(run_id, "", str(tmp / "artifacts")))
    files = [p for p in downloaded.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files), files
    for secret in SECRETS:
        assert secret not in recorded, f"{secret} recorded in MLflow metadata"
        for file in files:
            assert secret.encode() not in file.read_bytes(), f"{secret} in artifact {file}"
    # Credentials are stripped, the rest is kept: params stay useful.
    assert run.data.params["tracking.uri"] == server.uri
    assert run.data.params["data.path"] == "https://data.example/log.csv"
    assert FLAG_SECRET not in run.data.params["preprocess.beam_args"]
    assert "--aws_secret_access_key=***" in run.data.params["preprocess.beam_args"]
    # The logged config is still a valid config of the same run (the digest ignores secrets).
    logged = next(p for p in files if p.name == "config.yaml")
    config = parse_config(yaml.safe_load(logged.read_text()))
    assert config.digest() == run.data.tags["config_digest"]


def test_publish_records_no_secret(
    server: MlflowServer,
    small_config: RecsysConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _secret_env(monkeypatch)
    config = _secret_config(small_config, server.uri, "sec-publish")
    workdir = Workdir(tmp_path / "work")
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    assert URI_SECRET in (run_dir / "config.yaml").read_text()  # the test is not vacuous

    with caplog.at_level(logging.DEBUG):
        result = publish_run(config, workdir, DATE, run_dir)

    _assert_nothing_recorded_leaks(server, result.mlflow_run_id, "sec-publish", tmp_path)
    out, err = capfd.readouterr()
    # MLflow prints "View run ... at <uri>" on its own unless told not to: nothing may leak there.
    for secret in SECRETS:
        assert secret not in out + err
        assert all(secret not in record.getMessage() for record in caplog.records)


@pytest.mark.timeout(300)
def test_cli_sync_records_and_prints_no_secret(
    server: MlflowServer, small_config: RecsysConfig, tmp_path: Path
) -> None:
    config = _secret_config(small_config, server.uri, "sec-cli")
    config_file = tmp_path / "secret.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    workdir = Workdir(tmp_path / "work")
    run_dir = fake_run(workdir, config, DATE, PER_USER)
    (run_dir / PENDING).write_text("{}")  # as a nightly whose MLflow step failed leaves it
    env = {
        **os.environ,
        "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": ENV_PASSWORD,
        "MLFLOW_TRACKING_TOKEN": ENV_TOKEN,
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "conductor.cli", "sync", "-v", "--config", str(config_file),
         "--workdir", str(workdir.root), "--date", DATE.isoformat()],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run_id = re.search(r"mlflow run:\s+(\w+)", proc.stdout)
    assert run_id, proc.stdout
    for secret in SECRETS:
        assert secret not in proc.stdout and secret not in proc.stderr
    _assert_nothing_recorded_leaks(server, run_id[1], "sec-cli", tmp_path)


@pytest.mark.timeout(120)
def test_unreachable_server_error_and_pending_marker_hold_no_secret(
    small_config: RecsysConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _secret_env(monkeypatch)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        config = _secret_config(small_config, dead, "sec-dead")
        config_file = tmp_path / "secret.yaml"
        config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        workdir = Workdir(tmp_path / "work")
        run_dir = fake_run(workdir, config, DATE, PER_USER)
        (run_dir / PENDING).write_text("{}")
        code = cli_main(
            ["sync", "--config", str(config_file), "--workdir", str(workdir.root),
             "--date", DATE.isoformat()]
        )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 6, err
    assert dead in err  # the message still says where it tried
    marker = (run_dir / PENDING).read_text()
    assert "last_error" in marker
    for secret in SECRETS:
        assert secret not in err and secret not in marker


# --- config values that become paths -------------------------------------------------------


@pytest.fixture(autouse=True)
def _undo_cli_logging_setup() -> Iterator[None]:
    """conductor.cli.main routes warnings through logging; in-process calls must not leak that."""
    yield
    logging.captureWarnings(False)


@pytest.mark.parametrize(
    ("raw", "key", "problem"),
    [
        ({"model_name": "../evil"}, "model_name", "path separator"),
        ({"model_name": "/etc/cron.d"}, "model_name", "path separator"),
        ({"model_name": "a\\..\\b"}, "model_name", "path separator"),
        ({"model_name": ".."}, "model_name", "'..'"),
        ({"model_name": "x..y"}, "model_name", "'..'"),
        ({"model_name": ".hidden"}, "model_name", "must start with a letter or digit"),
        ({"model_name": "a\0b"}, "model_name", "NUL"),
        ({"model_name": ""}, "model_name", "must start with a letter or digit"),
        ({"tracking": {"experiment": "../../runs"}}, "tracking.experiment", "path separator"),
        ({"data": {"synthetic": {"start_date": "../2026-01-01"}}},
         "data.synthetic.start_date", "YYYY-MM-DD"),
        ({"data": {"source": "csv", "path": "in\0.csv"}}, "data.path", "NUL"),
        ({"training": {"warm_start_from": "m\0"}}, "training.warm_start_from", "NUL"),
    ],
)  # fmt: skip
def test_path_values_cannot_escape_the_workdir(raw: dict, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    message = str(caught.value)
    assert f"{key}: " in message and problem in message, message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["recsys-default", "ml_100k.v2", "A1"])
def test_plain_names_are_accepted(name: str) -> None:
    assert parse_config({"model_name": name, "tracking": {"experiment": name}}).model_name == name


def test_cli_rejects_an_escaping_model_name_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "evil.yaml"
    config_file.write_text("model_name: ../../etc\n")
    code = cli_main(["train", "--config", str(config_file), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("recsys: error:")]
    assert code == 2, err
    assert len(lines) == 1 and "model_name: '../../etc' contains a path separator" in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "etc").exists()


# --- no unpickling of outside data ---------------------------------------------------------

SCANNED = ("conductor", "recsys", "beam_jobs", "serving_export", "benchmarks")
# Calls that unpickle (or run code from) their input, whatever the arguments.
_FORBIDDEN = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
    "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
    "cloudpickle.loads", "joblib.load", "shelve.open", "marshal.load", "marshal.loads",
    "pandas.read_pickle", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
    "yaml.full_load_all", "numpy.lib.format.read_array",
}  # fmt: skip
# Calls that are safe only with this keyword argument set to a constant in the allowed set.
_SAFE_ONLY_WITH = {
    "numpy.load": ("allow_pickle", {False}),
    "torch.load": ("weights_only", {True}),
    "yaml.load": ("Loader", {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}),
    "yaml.load_all": ("Loader", {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}),
    # Keras' safe_mode refuses Lambda layers (marshalled Python bytecode).
    "keras.models.load_model": ("safe_mode", {True}),
    "keras.saving.load_model": ("safe_mode", {True}),
    "tf_keras.models.load_model": ("safe_mode", {True}),
    "tensorflow.keras.models.load_model": ("safe_mode", {True}),
}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin, from every import of the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _constant(node: ast.AST, aliases: dict[str, str]) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    dotted = _dotted(node, aliases)
    return dotted.rsplit(".", 1)[-1] if dotted else None


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """`file:line call` for every call in `source` that may unpickle or run loaded code."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name is None:
            continue
        if name.startswith("mlflow.") and name.endswith(".load_model"):
            found.append(f"{filename}:{node.lineno} {name} (MLflow flavors unpickle)")
        elif name in _FORBIDDEN:
            found.append(f"{filename}:{node.lineno} {name}")
        elif name in _SAFE_ONLY_WITH:
            keyword, allowed = _SAFE_ONLY_WITH[name]
            values = [_constant(k.value, aliases) for k in node.keywords if k.arg == keyword]
            if not values or values[0] not in allowed:
                found.append(f"{filename}:{node.lineno} {name} without {keyword}={allowed}")
    return found


def _our_sources() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*.py"))


def test_source_never_unpickles() -> None:
    files = _our_sources()
    assert REPO / "recsys" / "model" / "storage.py" in files and len(files) > 20, files
    findings = [f for p in files for f in unsafe_loads(p.read_text(), str(p.relative_to(REPO)))]
    assert findings == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.loads(b'')",
        "from pickle import load as l\nl(open('x', 'rb'))",
        "import numpy as np\nnp.load('x.npy')",
        "import numpy\nnumpy.load('x.npz', allow_pickle=True)",
        "from numpy import load\nload('x.npy')",
        "import joblib\njoblib.load('m.pkl')",
        "import yaml\nyaml.load(open('c.yaml'))",
        "import yaml\nyaml.load(open('c.yaml'), Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load('a: 1')",
        "import torch\ntorch.load('w.pt')",
        "import mlflow\nmlflow.pyfunc.load_model('models:/m@champion')",
        "from mlflow import pyfunc\npyfunc.load_model('runs:/x/model')",
        "import pandas as pd\npd.read_pickle('f')",
        "import tensorflow as tf\ntf.keras.models.load_model('m.h5')",
        "import cloudpickle\ncloudpickle.loads(b'')",
    ],
)
def test_scanner_flags_unsafe_loads(source: str) -> None:
    assert len(unsafe_loads(source)) == 1, source


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np\nnp.load('x.npz', allow_pickle=False)",
        "import yaml\nyaml.safe_load('a: 1')",
        "import yaml\nyaml.load('a: 1', Loader=yaml.SafeLoader)",
        "import pickle\npickle.dumps(1)",
        "import json\njson.load(open('x'))",
        "import tensorflow as tf\ntf.saved_model.load('export/query/1')",
        "import torch\ntorch.load('w.pt', weights_only=True)",
    ],
)
def test_scanner_accepts_safe_loads(source: str) -> None:
    assert unsafe_loads(source) == [], source
