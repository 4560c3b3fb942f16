"""The scheduling manifests parse and keep the properties the docs promise."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_cronjob_forbids_overlap_and_runs_non_root() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "cronjob.yaml").read_text()))
    cron = next(
        d for d in docs if d["kind"] == "CronJob" and d["metadata"]["name"] == "recsys-nightly"
    )
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
    assert len(jobs) == 2
    nightly = next(j for j in jobs if " nightly " in j)
    tune = next(j for j in jobs if " tune " in j)
    for job in (nightly, tune):
        assert len(job.split()[:5]) == 5 and "flock -n" in job
    # Separate locks: a long weekly tune never stops a nightly from starting.
    locks = [j.split("flock -n ")[1].split()[0] for j in (nightly, tune)]
    assert locks[0] != locks[1]
    assert tune.split()[4] == "0"  # day of week: Sunday
    command = [j.split(" >> ")[0].split() for j in (nightly, tune)]
    _weekly_tune_feeds_the_nightly(command[0], command[1])


def _weekly_tune_feeds_the_nightly(nightly: list[str], tune: list[str]) -> None:
    """The nightly trains with the file the tune writes; the tune has its own working dir."""
    assert _option(nightly, "--config") == _option(tune, "--output")
    assert _option(tune, "--workdir") != _option(nightly, "--workdir")
    assert int(_option(tune, "--trials")) >= 1 and float(_option(tune, "--timeout")) > 0


def test_kubernetes_weekly_tune_writes_what_the_nightly_reads() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "cronjob.yaml").read_text()))
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CronJob"}
    tune, nightly = jobs["recsys-tune"], jobs["recsys-nightly"]
    assert tune["spec"]["concurrencyPolicy"] == "Forbid"
    assert tune["spec"]["schedule"].split()[2:] == ["*", "*", "0"]  # weekly, Sundays
    pods = [j["spec"]["jobTemplate"]["spec"]["template"]["spec"] for j in (tune, nightly)]
    assert pods[0]["securityContext"]["runAsNonRoot"] is True
    assert pods[0]["volumes"] == pods[1]["volumes"]  # the file is on the nightly's volume
    args = [p["containers"][0]["args"] for p in pods]
    assert args[0][0] == "tune" and args[1][0] == "nightly"
    _weekly_tune_feeds_the_nightly(args[1], args[0])
    mount = pods[1]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert _option(args[0], "--output").startswith(mount + "/")


def test_systemd_weekly_tune_writes_what_the_nightly_reads() -> None:
    units = {}
    for name in ("recsys-nightly.service", "recsys-tune.service", "recsys-tune.timer"):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.read(DEPLOY / "systemd" / name)
        units[name] = unit
    tune = units["recsys-tune.service"]["Service"]
    assert tune["Type"] == "oneshot"
    nightly_args = units["recsys-nightly.service"]["Service"]["ExecStart"].split()
    tune_args = tune["ExecStart"].split()
    assert tune_args[1] == "tune"
    _weekly_tune_feeds_the_nightly(nightly_args, tune_args)
    # ProtectSystem=strict: the tune may write only its working dir, where the output lies.
    assert _option(tune_args, "--output").startswith(tune["ReadWritePaths"] + "/")
    timer = units["recsys-tune.timer"]["Timer"]
    assert timer["OnCalendar"].startswith("Sun ") and timer["Persistent"] == "true"


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


def test_gpu_cronjobs_are_the_cpu_ones_on_a_gpu_node() -> None:
    """Same PVC, CronJobs and pods as cronjob.yaml, plus one GPU, the GPU image and placement."""
    cpu = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "cronjob.yaml").read_text()))
    gpu = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "gpu" / "cronjob.yaml").read_text()))
    assert [(d["kind"], d["metadata"]["name"]) for d in gpu] == [
        (d["kind"], d["metadata"]["name"]) for d in cpu
    ]
    for cpu_doc, gpu_doc in zip(cpu, gpu, strict=True):
        if gpu_doc["kind"] != "CronJob":
            assert gpu_doc == cpu_doc
            continue
        pod = gpu_doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert pod.pop("nodeSelector") == {"nvidia.com/gpu.present": "true"}
        assert pod.pop("tolerations") == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        container = pod["containers"][0]
        assert container["resources"]["limits"].pop("nvidia.com/gpu") == 1
        assert container["image"] == "REGISTRY/recsys-gpu:TAG"
        container["image"] = "REGISTRY/recsys:TAG"
        assert gpu_doc == cpu_doc, gpu_doc["metadata"]["name"]
