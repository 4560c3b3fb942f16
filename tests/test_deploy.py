"""The scheduling manifests parse and keep the properties the docs promise."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_cronjob_forbids_overlap_and_runs_non_root() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "cronjob.yaml").read_text()))
    cron = next(d for d in docs if d["kind"] == "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["args"][0] == "nightly"
    assert container["resources"]["requests"]["memory"]
    assert container["envFrom"][0]["secretRef"]["name"] == "recsys-mlflow"
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert any(
        d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim for d in docs
    )


def test_systemd_units_parse_and_point_at_each_other() -> None:
    service = configparser.ConfigParser(strict=False, interpolation=None)
    service.read(DEPLOY / "systemd" / "recsys-nightly.service")
    assert service["Service"]["Type"] == "oneshot"
    assert "recsys nightly" in service["Service"]["ExecStart"].replace("/bin/recsys", " recsys")
    timer = configparser.ConfigParser(strict=False, interpolation=None)
    timer.read(DEPLOY / "systemd" / "recsys-nightly.timer")
    assert timer["Timer"]["Persistent"] == "true"


def test_crontab_line_is_locked() -> None:
    jobs = [
        ln
        for ln in (DEPLOY / "crontab").read_text().splitlines()
        if ln and not ln.startswith("#") and "=" not in ln.split()[0]
    ]
    assert len(jobs) == 1
    fields = jobs[0].split()
    assert len(fields[:5]) == 5 and "flock" in jobs[0] and "nightly" in jobs[0]


def test_mlflow_server_manifest_is_the_documented_production_server() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "mlflow-server.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["command"] == ["mlflow"] and container["args"][0] == "server"
    flags = set(container["args"])
    assert {"--serve-artifacts", "--app-name=basic-auth"} <= flags
    # The database URI (a password) comes only from the Secret, never from the manifest.
    assert not any("postgresql" in arg for arg in container["args"])
    assert container["envFrom"][0]["secretRef"]["name"] == "mlflow-server"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert "--artifacts-destination=" + mounts["artifacts"] in flags
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_AUTH_CONFIG_PATH"].startswith(mounts["auth"] + "/")
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_basic_auth_example_is_read_by_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.server.auth.config import read_auth_config

    example = DEPLOY.parent / "mlflow" / "basic_auth.ini.example"
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(example))
    config = read_auth_config()
    assert config.default_permission == "READ"
    assert config.database_uri.startswith("postgresql+psycopg2://")
    assert config.authorization_function.endswith("authenticate_request_basic_auth")
