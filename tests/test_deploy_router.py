"""The router's deployment files: its Grafana dashboard and alerts name only series the router's
registry exports, with labels those series carry; the alerts are promtool-tested (when promtool is
installed); the compose stack and the Kubernetes manifests agree with each other, with the engine's
files and with the router's own config validation."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from pagellm.entrypoints.openai.api_server import default_served_name
from pagellm.router.config import RouterConfig, parse_config
from pagellm.router.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MONITORING = DEPLOY / "monitoring"
DASHBOARDS = MONITORING / "grafana" / "dashboards"
ROUTER_K8S = DEPLOY / "k8s" / "router"

SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
TARGET_LABELS = {"job", "instance"}
"""Prometheus adds these to every scraped series."""
SELECTOR = re.compile(r"(pagellm:[a-z_:]+)(?:\{([^}]*)\})?")
MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def router_series() -> dict[str, set[str]]:
    """Every series name the router exports -> its labels, from RouterMetrics' own registry."""
    series: dict[str, set[str]] = {}
    for collector in vars(RouterMetrics()).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        # prometheus_client keeps a metric's label names only on this attribute.
        labels = set(collector._labelnames)
        for family in collector.describe():
            for suffix in SERIES_SUFFIXES[family.type]:
                series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


def unknown_references(expr: str, series: dict[str, set[str]]) -> list[str]:
    """What `expr` names that the router does not export: series, labels in selectors or groupings."""
    problems = []
    named_labels: set[str] = set(TARGET_LABELS)
    for name, matchers in SELECTOR.findall(expr):
        if name not in series:
            problems.append(f"series {name}")
            continue
        named_labels |= series[name]
        problems += [f"label {label} of {name}" for label in MATCHER_LABEL.findall(matchers)
                     if label not in series[name] | TARGET_LABELS]
    for grouping in GROUPING.findall(expr):
        problems += [f"grouping label {label}" for label in re.findall(r"\w+", grouping) if label not in named_labels]
    return problems


def grouping_labels(expr: str) -> set[str]:
    return {label for grouping in GROUPING.findall(expr) for label in re.findall(r"\w+", grouping)}


def load_dashboard() -> dict[str, Any]:
    return json.loads((DASHBOARDS / "pagellm-router.json").read_text())


def test_reference_check_catches_what_the_router_does_not_export():
    series = router_series()
    assert series["pagellm:router_requests_total"] == {"model", "backend", "code"}
    assert "le" in series["pagellm:router_request_latency_seconds_bucket"]
    assert unknown_references('sum by (model) (rate(pagellm:router_requests_total{code="200"}[5m]))', series) == []
    assert unknown_references("rate(pagellm:router_requests[5m])", series) == ["series pagellm:router_requests"]
    assert unknown_references('pagellm:router_throttled_total{model="m"}', series) == [
        "label model of pagellm:router_throttled_total"]
    assert unknown_references("sum by (kind) (pagellm:router_backend_healthy)", series) == ["grouping label kind"]


def test_dashboard_queries_only_what_the_router_exports():
    dashboard, series = load_dashboard(), router_series()
    targets = [(p["title"], t) for p in dashboard["panels"] for t in p["targets"]]
    assert targets
    for title, target in targets:
        assert not unknown_references(target["expr"], series), (title, unknown_references(target["expr"], series))
        # A legend naming a label the query aggregated away would read "{{backend}}" for every line.
        legend = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
        assert legend <= grouping_labels(target["expr"]), (title, legend)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variables["model"]["definition"]).groups()
    assert label in series[metric]
    # $model filters only series that carry a model label.
    for title, target in targets:
        for name, matchers in SELECTOR.findall(target["expr"]):
            if "$model" in matchers:
                assert "model" in series[name], (title, name)


def test_dashboard_covers_the_router_and_is_provisioned_beside_the_engines():
    dashboard = load_dashboard()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("requests by model and backend", "errors", "latency percentiles", "cache hit rate",
                  "throttled requests (429)", "truncations", "failovers", "backends in rotation"):
        assert topic in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    engine = json.loads((DASHBOARDS / "pagellm.json").read_text())
    assert dashboard["uid"] != engine["uid"] and dashboard["title"] != engine["title"]
    # One file provider loads every dashboard of the mounted folder, the router's included.
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "pagellm.yml").read_text())
    grafana = yaml.safe_load((DEPLOY / "compose.router.yaml").read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in grafana["volumes"])
    assert mounts["./monitoring/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == mounts["./monitoring/grafana/dashboards"]
    assert (DASHBOARDS / Path(home).name).is_file() and Path(home).name == "pagellm-router.json"


def test_router_alerts_are_complete_and_name_exported_series():
    groups = yaml.safe_load((MONITORING / "router_alerts.yml").read_text())["groups"]
    rules = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    assert {"PagellmRouterDown", "PagellmRouterBackendOut", "PagellmRouterNoBackendInRotation",
            "PagellmRouterBackendErrors", "PagellmRouterThrottling"} <= set(rules)
    series = router_series()
    for name, rule in rules.items():
        assert not unknown_references(rule["expr"], series), (name, unknown_references(rule["expr"], series))
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    scrape = yaml.safe_load((MONITORING / "prometheus.router.yml").read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    for rule in rules.values():
        assert set(re.findall(r'job="([^"]+)"', rule["expr"])) <= jobs
    tests = yaml.safe_load((MONITORING / "router_alerts_test.yml").read_text())["tests"]
    assert {case["alertname"] for test in tests for case in test["alert_rule_test"]} == set(rules)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) not installed")
def test_promtool_checks_and_unit_tests_of_the_router_pass(tmp_path):
    # The dashboard's queries parse as PromQL: promtool checks them as recording rules, with Grafana's
    # variables replaced by what Grafana would send.
    exprs = [t["expr"] for p in load_dashboard()["panels"] for t in p["targets"]]
    grafana_vars = {"$__rate_interval": "1m", "$model": ".*"}
    rules = [{"record": f"dashboard:query_{i}", "expr": re.sub("|".join(map(re.escape, grafana_vars)),
                                                                lambda m: grafana_vars[m.group(0)], e)}
             for i, e in enumerate(exprs)]
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    for command, cwd in ((["check", "rules", "router_alerts.yml"], MONITORING),
                         (["test", "rules", "router_alerts_test.yml"], MONITORING),
                         (["check", "config", "prometheus.router.yml"], MONITORING),
                         (["check", "rules", "dashboard_rules.yml"], tmp_path)):
        run = subprocess.run(["promtool", *command], cwd=cwd, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname, parsed.port


def test_compose_stack_wires_router_engines_redis_and_prometheus():
    services = yaml.safe_load((DEPLOY / "compose.router.yaml").read_text())["services"]
    router = services["router"]
    assert router["entrypoint"] == ["pagellm", "router"]
    port = int(_flag(router["command"], "--port"))
    assert _flag(router["command"], "--host") == "0.0.0.0" and router["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert f"http://127.0.0.1:{port}/health'" in router["healthcheck"]["test"][-1]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in router["volumes"])
    config_path = _flag(router["command"], "--config")
    source = next(src for src, dst in mounts.items() if dst == config_path)
    config = parse_config(yaml.safe_load((DEPLOY / source).read_text()))  # the router's own validation
    engines = [name for name, s in services.items() if s.get("command") and "--shutdown-timeout" in s["command"]]
    assert len(engines) == 2
    (model,) = config.models
    assert model.name == default_served_name(None)  # what the engines' image serves
    assert sorted(_host_port(b.url) for b in model.backends) == [(name, 8000) for name in sorted(engines)]
    assert _host_port(config.cache.url) == ("redis", 6379) and "redis-cli" in services["redis"]["healthcheck"]["test"]
    # The router exits when Redis does not answer at start-up: it waits for Redis and the engines to be healthy.
    assert {name: dep["condition"] for name, dep in router["depends_on"].items()} == {
        name: "service_healthy" for name in ("redis", *engines)}
    for name in engines:
        engine = services[name]
        assert "/health/ready" in engine["healthcheck"]["test"][-1]
        assert int(engine["stop_grace_period"].rstrip("s")) > float(_flag(engine["command"], "--shutdown-timeout"))
    # Prometheus scrapes the router and the engines and loads the files its compose service mounts.
    prometheus = services["prometheus"]
    mounted = dict(v.rsplit(":", 1)[0].split(":") for v in prometheus["volumes"])
    scrape = yaml.safe_load((MONITORING / "prometheus.router.yml").read_text())
    assert mounted["./monitoring/prometheus.router.yml"] == "/etc/prometheus/prometheus.yml"
    assert {f"/etc/prometheus/{f}" for f in scrape["rule_files"]} <= set(mounted.values())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]}
    assert targets["pagellm-router"] == [f"router:{port}"]
    assert sorted(targets["pagellm"]) == sorted(f"{name}:8000" for name in engines)


def _k8s(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((ROUTER_K8S / name).read_text()))


def _k8s_router_config() -> RouterConfig:
    (configmap,) = _k8s("configmap.yaml")
    return parse_config(yaml.safe_load(configmap["data"]["router.yaml"]))


def test_kubernetes_router_points_at_the_engine_service_and_redis():
    kustomization = yaml.safe_load((ROUTER_K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in ROUTER_K8S.glob("*.yaml")} - {"kustomization.yaml"}
    (configmap,) = _k8s("configmap.yaml")
    config = _k8s_router_config()
    engine_service = yaml.safe_load((DEPLOY / "k8s" / "service.yaml").read_text())
    engine = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    engine_args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    (model,) = config.models
    assert model.name == _flag(engine_args, "--served-model-name")
    assert [_host_port(b.url) for b in model.backends] == [
        (engine_service["metadata"]["name"], engine_service["spec"]["ports"][0]["port"])]
    redis_deployment, redis_service = _k8s("redis.yaml")
    redis_port = redis_service["spec"]["ports"][0]["port"]
    assert _host_port(config.cache.url) == (redis_service["metadata"]["name"], redis_port)
    assert redis_service["spec"]["selector"] == redis_deployment["spec"]["template"]["metadata"]["labels"]

    (deployment,) = _k8s("deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["pagellm", "router"]
    (mount,) = container["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert _flag(container["args"], "--config") == f"{mount['mountPath']}/{next(iter(configmap['data']))}"
    port = int(_flag(container["args"], "--port"))
    assert container["ports"][0]["containerPort"] == port
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "httpGet" not in container["livenessProbe"]  # engines being down must not restart the router
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + 30  # the router drains for 30 s
    (service,) = _k8s("service.yaml")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) not installed")
def test_kustomize_renders_the_router_overlay():
    run = subprocess.run(["kubectl", "kustomize", str(ROUTER_K8S)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(run.stdout))
    assert kinds == [("ConfigMap", "pagellm-router"), ("Deployment", "pagellm-router"),
                     ("Deployment", "pagellm-router-redis"), ("Service", "pagellm-router"),
                     ("Service", "pagellm-router-redis")]


def test_the_router_answers_the_probed_and_scraped_paths(router):
    """The readiness probe's and Prometheus' paths exist on a router started on the Kubernetes config."""
    config = yaml.safe_load(next(iter(_k8s("configmap.yaml")))["data"]["router.yaml"])
    config["cache"] = {"url": "memory://"}  # no Redis here; the paths do not depend on it
    running = router(config)
    with httpx.Client(base_url=running.url, timeout=10) as http:
        assert http.get("/health").status_code != 404  # 200 or 503 by the backend's state, both a probe answer
        metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "pagellm:router_" in metrics.text
