"""The deployment files under deploy/: alert rules (promtool, when installed: Debian's prometheus package;
a structural check always), and the settings that must agree across the Dockerfiles, compose and
Kubernetes manifests (drain time, ports, labels, the autoscaling metric)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MONITORING = DEPLOY / "monitoring"


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_alert_rules_are_complete():
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    rules = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    assert {"PagellmEngineDown", "PagellmKVCacheHigh", "PagellmQueueGrowing", "PagellmTTFTHigh",
            "PagellmPreemptions"} <= set(rules)
    for name, rule in rules.items():
        assert rule["expr"].strip() and re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    # Every alert is exercised by the promtool unit tests.
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    assert {case["alertname"] for test in tests for case in test["alert_rule_test"]} == set(rules)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) not installed")
def test_promtool_checks_and_unit_tests_pass():
    for command in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                    ["check", "config", "prometheus.yml"]):
        run = subprocess.run(["promtool", *command], cwd=MONITORING, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr


def test_drain_time_fits_inside_the_grace_periods():
    """SIGTERM drains for --shutdown-timeout seconds: Docker and Kubernetes must wait longer than that."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    pagellm = compose["pagellm"]
    assert int(pagellm["stop_grace_period"].rstrip("s")) > float(_flag(pagellm["command"], "--shutdown-timeout"))
    pod = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(_flag(container["args"], "--shutdown-timeout"))


def test_manifests_agree_with_each_other_and_the_images():
    k8s = DEPLOY / "k8s"
    deployment = yaml.safe_load((k8s / "deployment.yaml").read_text())
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert yaml.safe_load((k8s / "service.yaml").read_text())["spec"]["selector"] == labels
    assert yaml.safe_load((k8s / "pdb.yaml").read_text())["spec"]["selector"]["matchLabels"] == labels
    hpa = yaml.safe_load((k8s / "hpa.yaml").read_text())["spec"]
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # The adapter rule turns pagellm:num_requests_waiting into the metric the HPA asks for.
    rule = yaml.safe_load(yaml.safe_load((k8s / "prometheus-adapter-rules.yaml").read_text())["data"]["config.yaml"])
    rule = rule["rules"][0]
    series = re.match(r"[a-z_:]+", rule["seriesQuery"]).group(0)
    adapted = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert series == "pagellm:num_requests_waiting" and adapted == hpa["metrics"][0]["pods"]["metric"]["name"]
    kustomization = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in k8s.glob("*.yaml")} - {"kustomization.yaml"}
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / dockerfile).read_text()
        assert 'ENTRYPOINT ["pagellm", "serve", "--host", "0.0.0.0", "--port", "8000"]' in text
        assert "EXPOSE 8000" in text and re.search(r"^USER \d+$", text, re.MULTILINE)
    assert container["ports"][0]["containerPort"] == 8000
    assert (DEPLOY / "monitoring" / "grafana" / "dashboards" / "pagellm.json").is_file()
