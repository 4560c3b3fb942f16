"""The scheduling manifests parse and keep the properties the docs promise."""

from __future__ import annotations

import configparser
from pathlib import Path

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
