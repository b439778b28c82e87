"""The alerts as the cluster loads them: the PrometheusRule rendered from the kustomize overlays, run by
`promtool test rules` on series labelled as the Prometheus Operator labels a ServiceMonitor's targets
(job = the Service's name, namespace, service, endpoint, pod, container, instance, and the endpoint's
relabelings), so an alert that selects the wrong labels there fails here. Needs promtool
(scripts/install-prometheus.sh); fails without it, never skips.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_deploy import OVERLAYS, one, render_module, server_container
from tests.test_prometheus import installed

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus"
RUNBOOK = ROOT / "docs" / "runbook.md"
Resource = dict[str, Any]


@pytest.fixture(scope="module")
def promtool() -> str:
    return installed("promtool")


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((RULES / "alerting.rules.yml").read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def target_labels(docs: list[Resource]) -> dict[str, str]:
    """The labels the Operator gives one target of the ServiceMonitor (its default jobLabel: none)."""
    monitor = one(docs, "ServiceMonitor")
    assert "jobLabel" not in monitor["spec"]
    (endpoint,) = monitor["spec"]["endpoints"]
    service = one(docs, "Service", "minilm-embed-metrics")
    labels = {
        "job": service["metadata"]["name"],
        "namespace": service["metadata"]["namespace"],
        "service": service["metadata"]["name"],
        "endpoint": endpoint["port"],
        "pod": "minilm-embed-7c9d8f6b5-x2k9q",
        "container": server_container(docs)["name"],
        "instance": "10.42.0.17:9464",
    }
    for relabel in endpoint.get("relabelings", []):
        assert set(relabel) == {"targetLabel", "replacement"}, f"relabeling not modelled here: {relabel}"
        labels[relabel["targetLabel"]] = relabel["replacement"]
    return labels


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def annotations(alert: str, labels: dict[str, str], value: str) -> dict[str, str]:
    """The rule's annotations with {{ $labels.x }} and {{ $value | ... }} filled in."""
    (rule,) = [r for r in alert_rules() if r["alert"] == alert and labels.items() >= r["labels"].items()]
    filled = {}
    for key, text in rule["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        filled[key] = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
    return filled


def expect(alert: str, labels: dict[str, str], value: str = "") -> dict[str, Any]:
    rule_labels = next(
        r["labels"] for r in alert_rules() if r["alert"] == alert and labels.items() >= r["labels"].items()
    )
    assert rule_labels.items() <= labels.items()
    return {"exp_labels": labels, "exp_annotations": annotations(alert, labels, value)}


def operator_tests(target: dict[str, str], gpu: bool) -> list[dict[str, Any]]:
    """One promtool test per alert, on the Operator's labels."""
    job = {"namespace": target["namespace"], "job": target["job"]}
    info = {**target, "model_id": "m", "sha256": "s", "precision": "fp32"}
    other_pod = {**target, "pod": "minilm-embed-7c9d8f6b5-r4t7w", "instance": "10.42.1.9:9464"}
    down = {"severity": "critical", **target}
    tests = [
        {
            "name": "EmbedServerDown: a pod of the Service stops answering scrapes",
            "interval": "1m",
            "input_series": [
                series("up", target, "1 1 0 0 0 0"),
                series("embed_model_info", {**info, "provider": "CPUExecutionProvider"}, "1 1 stale"),
                series("up", other_pod, "1x5"),
                series("embed_model_info", {**other_pod, **info, "provider": "CPUExecutionProvider"}, "1x5"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "5m",
                    "alertname": "EmbedServerDown",
                    "exp_alerts": [expect("EmbedServerDown", down)],
                }
            ],
        },
        {
            "name": "EmbedTargetsAbsent: the ServiceMonitor finds no pod any more",
            "interval": "1m",
            "input_series": [
                series("embed_model_info", {**info, "provider": "CPUExecutionProvider"}, "1x3 stale")
            ],
            "alert_rule_test": [
                {
                    "eval_time": "10m",
                    "alertname": "EmbedTargetsAbsent",
                    "exp_alerts": [expect("EmbedTargetsAbsent", {"severity": "critical"})],
                }
            ],
        },
        {
            "name": "EmbedHighErrorRatio: a quarter of the calls failed inside the server, refusals aside",
            "interval": "15s",  # the ServiceMonitor's: the alert's 1-minute ratio needs several scrapes
            "input_series": [
                series("embed_requests_total", {**target, "method": "Embed", "code": "OK"}, "0+30x80"),
                series("embed_requests_total", {**target, "method": "Embed", "code": "INTERNAL"}, "0+10x80"),
                # Back-pressure and a caller's wrong token: not the server failing, not in the ratio.
                series(
                    "embed_requests_total",
                    {**target, "method": "Embed", "code": "RESOURCE_EXHAUSTED"},
                    "0+40x80",
                ),
                series(
                    "embed_requests_total",
                    {**target, "method": "http_embeddings", "code": "UNAUTHENTICATED"},
                    "0+40x80",
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "15m",
                    "alertname": "EmbedHighErrorRatio",
                    "exp_alerts": [expect("EmbedHighErrorRatio", {"severity": "critical", **job}, "8.333%")],
                }
            ],
        },
        {
            "name": "EmbedLatencyP99High: single inputs slow, 32-input bulk calls at their ordinary ~1.5 s",
            "interval": "1m",
            "input_series": [
                *(
                    series(
                        "embed_request_duration_seconds_bucket",
                        {**target, "method": "Embed", "size": "1", "le": le},
                        v,
                    )
                    # 2-2.5 s each, between the buckets of 2 and 2.5 s.
                    for le, v in (("1", "0x30"), ("2", "0x30"), ("2.5", "0+10x30"), ("+Inf", "0+10x30"))
                ),
                *(
                    series(
                        "embed_request_duration_seconds_bucket",
                        {**target, "method": "Embed", "size": "9-64", "le": le},
                        v,
                    )
                    # 1-2 s each.
                    for le, v in (("1", "0x30"), ("2", "0+10x30"), ("2.5", "0+10x30"), ("+Inf", "0+10x30"))
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "20m",
                    "alertname": "EmbedLatencyP99High",
                    "exp_alerts": [
                        expect(
                            "EmbedLatencyP99High",
                            {"severity": "warning", "objective": "1s", **job, "method": "Embed", "size": "1"},
                            "2.495s",
                        )
                    ],
                }
            ],
        },
        {
            "name": "EmbedQueueSaturated: one pod's queue refuses calls",
            "interval": "15s",  # the ServiceMonitor's: the alert's 1-minute rate needs several scrapes
            "input_series": [
                series("embed_requests_refused_total", {**target, "reason": "queue"}, "0+7.5x80"),
                series("embed_requests_refused_total", {**target, "reason": "tokenizing"}, "0x80"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "15m",
                    "alertname": "EmbedQueueSaturated",
                    "exp_alerts": [
                        expect(
                            "EmbedQueueSaturated",
                            {
                                "severity": "warning",
                                **job,
                                "instance": target["instance"],
                                "pod": target["pod"],
                            },
                            "500m",
                        )
                    ],
                }
            ],
        },
        {
            "name": "EmbedFrontSaturated: one pod's fronts refuse calls at their request-bytes budget",
            "interval": "15s",
            "input_series": [
                series("embed_requests_refused_total", {**target, "reason": "queue"}, "0x80"),
                series("embed_requests_refused_total", {**target, "reason": "request_bytes"}, "0+7.5x80"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "15m",
                    "alertname": "EmbedFrontSaturated",
                    "exp_alerts": [
                        expect(
                            "EmbedFrontSaturated",
                            {
                                "severity": "warning",
                                **job,
                                "instance": target["instance"],
                                "pod": target["pod"],
                                "reason": "request_bytes",
                            },
                            "500m",
                        )
                    ],
                }
            ],
        },
        {
            "name": "EmbedFrontRestarting: one pod's fronts restarted three times in 15 minutes",
            "interval": "1m",
            "input_series": [series("embed_front_restarts_total", target, "0x10 1 1 2 2 3x10")],
            "alert_rule_test": [
                {
                    "eval_time": "15m",
                    "alertname": "EmbedFrontRestarting",
                    "exp_alerts": [
                        expect(
                            "EmbedFrontRestarting",
                            {
                                "severity": "warning",
                                **job,
                                "instance": target["instance"],
                                "pod": target["pod"],
                            },
                            "3",
                        )
                    ],
                }
            ],
        },
    ]
    cpu_info = {**info, "provider": "CPUExecutionProvider"}
    fallback = [expect("EmbedCpuFallback", {"severity": "critical", **cpu_info})] if gpu else []
    tests.append(
        {
            "name": "EmbedCpuFallback: fires for a pod of the gpu overlay on the CPU provider, only there",
            "interval": "1m",
            "input_series": [series("embed_model_info", cpu_info, "1x10")],
            "alert_rule_test": [{"eval_time": "5m", "alertname": "EmbedCpuFallback", "exp_alerts": fallback}],
        }
    )
    return tests


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_alerts_fire_on_series_labelled_as_the_operator_labels_them(
    overlay: str, promtool: str, tmp_path: Path
) -> None:
    docs = render_module().render(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == one(docs, "Deployment")["metadata"]["namespace"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    target = target_labels(docs)
    assert target["job"] != "embed"  # what made the old rules silent in the cluster
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": operator_tests(target, overlay == "gpu"),
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    done = subprocess.run(
        [promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_prometheus_rule_is_the_rules_files(tmp_path: Path) -> None:
    module = render_module()
    assert (ROOT / "deploy/k8s/base/prometheusrule.yaml").read_text(
        encoding="utf-8"
    ) == module.prometheus_rule_text()
    groups = [g for name in module.RULE_FILES for g in yaml.safe_load((RULES / name).read_text())["groups"]]
    assert sorted(module.RULE_FILES) == sorted(p.name for p in RULES.glob("*.rules.yml"))
    for overlay in OVERLAYS:
        docs = module.render(ROOT / "deploy" / "k8s" / "overlays" / overlay)
        assert one(docs, "PrometheusRule")["spec"]["groups"] == groups


def test_a_stale_prometheus_rule_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    module = render_module()
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(module.prometheus_rule_text().replace("> 0.05", "> 0.5"), encoding="utf-8")
    monkeypatch.setattr(module, "PROMETHEUS_RULE", stale)
    with pytest.raises(module.KustomizeError, match="--write-rules"):
        module.render(ROOT / "deploy" / "k8s" / "overlays" / "cpu")


def test_no_rule_depends_on_the_job_label_value() -> None:
    for name in ("recording.rules.yml", "alerting.rules.yml"):
        text = (RULES / name).read_text(encoding="utf-8")
        exprs = [r["expr"] for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
        assert not [e for e in exprs if re.search(r"\bjob\s*(=|!=|=~|!~)", e)], name


def test_both_error_ratios_count_the_same_codes() -> None:
    """EmbedHighErrorRatio takes the 5-minute ratio unless the 1-minute ratio is at or under 5%: a code
    in one only would page on the other's errors alone, or never."""
    groups = yaml.safe_load((RULES / "recording.rules.yml").read_text(encoding="utf-8"))["groups"]
    exprs = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    codes = {
        window: set(re.findall(r'code=~"([A-Z_|]+)"', exprs[f"job:embed_request_errors:ratio_rate{window}"]))
        for window in ("5m", "1m")
    }
    assert len(codes["5m"]) == 1 and codes["5m"] == codes["1m"], codes
    expr = next(r["expr"] for r in alert_rules() if r["alert"] == "EmbedHighErrorRatio")
    assert "ratio_rate5m > 0.05 unless" in expr and "ratio_rate1m <= 0.05" in expr, expr
    # Not `and ... > 0.05`: a minute without calls (0/0, NaN) dropped the alert and restarted its 5 minutes.
    assert "ratio_rate1m > 0.05" not in expr, expr


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_every_alert_links_its_runbook_section() -> None:
    sections = anchors(RUNBOOK.read_text(encoding="utf-8"))
    urls = {rule["alert"]: rule["annotations"].get("runbook_url", "") for rule in alert_rules()}
    for alert, url in urls.items():
        base, _, anchor = url.partition("#")
        assert base.endswith("/docs/runbook.md"), f"{alert}: runbook_url {url!r}"
        assert anchor == alert.lower() and anchor in sections, (
            f"{alert}: no section #{anchor} in docs/runbook.md"
        )
    assert len({url.partition("#")[0] for url in urls.values()}) == 1, "one runbook base for every alert"
