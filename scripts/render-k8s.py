#!/usr/bin/env python3
"""Render the deploy/k8s overlays as `kubectl kustomize` does, on machines without kubectl.

Reads the kustomization fields this project uses and refuses any other by name, so an overlay can
never render silently wrong: resources (files and directories), configMapGenerator (literals; behavior
create or merge; the content-hash name suffix and the references to it), patches (strategic merge,
from a file), images, namespace and labels. tests/test_deploy.py checks the output against kubectl's
where kubectl is installed.

    python scripts/render-k8s.py                       # every overlay -> build/k8s/<overlay>.yaml
    python scripts/render-k8s.py --out DIR deploy/k8s/overlays/gpu
    python scripts/render-k8s.py --write-rules         # deploy/prometheus/*.rules.yml -> the base's
                                                       # PrometheusRule (base/prometheusrule.yaml)

The PrometheusRule is generated, never edited: rendering refuses a base whose copy differs from what
the rules files make, so the rules Prometheus tests and the rules the cluster loads cannot drift.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
RULE_FILES = ("recording.rules.yml", "alerting.rules.yml")  # in deploy/prometheus/, in this order
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "images", "namespace", "labels"}
# Lists that a strategic merge patch merges item by item, by this key (k8s.io/api's patchMergeKey);
# every other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
# kustomize's default ("legacy") output order; kinds not named sort between the two lists.
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
    "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret",
    "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim",
    "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget",
]  # fmt: skip
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Marks a ConfigMap made by configMapGenerator: it gets the hash suffix once the whole tree is built.
GENERATED = "__generated__"

Resource = dict[str, Any]


class KustomizeError(Exception):
    """A kustomization this renderer cannot render faithfully."""


def load_kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    unknown = set(spec) - FIELDS
    if unknown:
        raise KustomizeError(f"{path}: fields not supported here: {sorted(unknown)}")
    return spec


def load_documents(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def build(directory: Path) -> list[Resource]:
    """One kustomization and everything under it, before name suffixes."""
    spec = load_kustomization(directory)
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        resources += build(path) if path.is_dir() else load_documents(path)
    for generator in spec.get("configMapGenerator", []):
        generate_config_map(resources, generator)
    for patch in spec.get("patches", []):
        apply_patch(resources, directory, patch)
    if "namespace" in spec:
        for r in resources:
            r["metadata"]["namespace"] = spec["namespace"]
    for label in spec.get("labels", []):
        add_labels(resources, label)
    for image in spec.get("images", []):
        set_image(resources, image)
    return resources


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    for r in resources:
        if r["kind"] == kind and r["metadata"]["name"] == name:
            return r
    raise KustomizeError(f"no {kind} named {name!r} to patch or merge into")


def literals(generator: dict[str, Any]) -> dict[str, str]:
    unknown = set(generator) - {"name", "behavior", "literals"}
    if unknown:
        raise KustomizeError(f"configMapGenerator {generator['name']}: not supported here: {sorted(unknown)}")
    pairs = (item.split("=", 1) for item in generator.get("literals", []))
    return {key: value for key, value in pairs}


def generate_config_map(resources: list[Resource], generator: dict[str, Any]) -> None:
    name, behavior = generator["name"], generator.get("behavior", "create")
    data = literals(generator)
    if behavior == "create":
        metadata = {"name": name, GENERATED: True}
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
        return
    existing = find(resources, "ConfigMap", name)
    if behavior == "merge":
        existing["data"] = {**existing["data"], **data}
    elif behavior == "replace":
        existing["data"] = data
    else:
        raise KustomizeError(f"configMapGenerator {name}: unknown behavior {behavior!r}")


def apply_patch(resources: list[Resource], directory: Path, patch: dict[str, Any]) -> None:
    if set(patch) != {"path"}:
        raise KustomizeError(f"patches: only `path:` strategic merge patches are supported, not {patch}")
    for doc in load_documents(directory / patch["path"]):
        target = find(resources, doc["kind"], doc["metadata"]["name"])
        merged = strategic_merge(target, doc)
        target.clear()
        target.update(merged)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Maps merge key by key (null deletes); lists in MERGE_KEYS merge by key; anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if key.startswith("$"):
                raise KustomizeError(f"patch directive {key} is not supported here")
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base.get(key), value, key)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        return merge_list(base, patch, MERGE_KEYS[field])
    return copy.deepcopy(patch)


def merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    merged = [copy.deepcopy(item) for item in base]
    for item in patch:
        index = next((i for i, old in enumerate(merged) if old.get(key) == item[key]), None)
        if index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item)
    return merged


def add_labels(resources: list[Resource], label: dict[str, Any]) -> None:
    if label.get("includeSelectors"):
        raise KustomizeError("labels: includeSelectors is not supported here")
    for r in resources:
        r["metadata"].setdefault("labels", {}).update(label["pairs"])
        if label.get("includeTemplates") and r["kind"] in WORKLOADS:
            template = r["spec"]["template"].setdefault("metadata", {})
            template.setdefault("labels", {}).update(label["pairs"])


def pod_specs(r: Resource) -> list[dict[str, Any]]:
    return [r["spec"]["template"]["spec"]] if r["kind"] in WORKLOADS else []


def containers(r: Resource) -> list[dict[str, Any]]:
    return [c for spec in pod_specs(r) for c in spec.get("containers", []) + spec.get("initContainers", [])]


def split_image(image: str) -> tuple[str, str]:
    """("name", ":tag" or "@digest" or "")."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    name, _, tag = image.rpartition(":")
    return (name, ":" + tag) if name and "/" not in tag else (image, "")


def set_image(resources: list[Resource], image: dict[str, str]) -> None:
    for r in resources:
        for c in containers(r):
            name, suffix = split_image(c["image"])
            if name != image["name"]:
                continue
            if "digest" in image:
                suffix = "@" + image["digest"]
            elif "newTag" in image:
                suffix = ":" + image["newTag"]
            c["image"] = image.get("newName", name) + suffix


def go_json(value: Any) -> str:
    """Go's json.Marshal, which kustomize hashes: sorted keys, no spaces, HTML characters escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):
        text = text.replace(char, escaped)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def name_hash(config_map: Resource) -> str:
    """kustomize's suffix: sha256 of kind, name and data; 10 hex digits with look-alikes replaced.

    kustomize 5 looks the name up as the single field "metadata/name", finds none and hashes "".
    """
    encoded = go_json({"kind": "ConfigMap", "name": "", "data": config_map["data"]})
    digest = hashlib.sha256(encoded.encode("utf-8")).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def config_map_refs(r: Resource) -> list[dict[str, Any]]:
    """Every place in a pod spec that names a ConfigMap, as the dict holding the name."""
    refs = []
    for spec in pod_specs(r):
        refs += [v["configMap"] for v in spec.get("volumes", []) if "configMap" in v]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            refs += [e["configMapRef"] for e in c.get("envFrom", []) if "configMapRef" in e]
            refs += [
                e["valueFrom"]["configMapKeyRef"]
                for e in c.get("env", [])
                if "configMapKeyRef" in e.get("valueFrom", {})
            ]
    return refs


def add_name_suffixes(resources: list[Resource]) -> None:
    renamed = {}
    for r in resources:
        if r["metadata"].pop(GENERATED, False):
            renamed[r["metadata"]["name"]] = new = f"{r['metadata']['name']}-{name_hash(r)}"
            r["metadata"]["name"] = new
    for r in resources:
        for ref in config_map_refs(r):
            ref["name"] = renamed.get(ref["name"], ref["name"])


def order(r: Resource) -> tuple[int, str, str, str]:
    kind = r["kind"]
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    return rank, f"{r['apiVersion']}/{kind}", r["metadata"].get("namespace", ""), r["metadata"]["name"]


class BlockStyleDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, descriptions) as `|` blocks, as they are written in the rules files."""


def _str_block(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


BlockStyleDumper.add_representer(str, _str_block)


def prometheus_rule_text() -> str:
    """The PrometheusRule wrapping every group of deploy/prometheus/*.rules.yml, as YAML."""
    groups = []
    for name in RULE_FILES:
        groups += yaml.safe_load((ROOT / "deploy" / "prometheus" / name).read_text(encoding="utf-8"))[
            "groups"
        ]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "minilm-embed", "labels": {"app.kubernetes.io/name": "minilm-embed"}},
        "spec": {"groups": groups},
    }
    header = (
        "# Generated by `python scripts/render-k8s.py --write-rules` from deploy/prometheus/*.rules.yml:\n"
        "# edit those, never this file. Rendering refuses a stale copy.\n"
    )
    return header + yaml.dump(rule, Dumper=BlockStyleDumper, sort_keys=False, width=110)


def check_prometheus_rule() -> None:
    current = PROMETHEUS_RULE.read_text(encoding="utf-8") if PROMETHEUS_RULE.exists() else ""
    if current != prometheus_rule_text():
        raise KustomizeError(
            f"{PROMETHEUS_RULE} differs from deploy/prometheus/*.rules.yml: "
            "run `python scripts/render-k8s.py --write-rules`"
        )


def render(directory: Path) -> list[Resource]:
    check_prometheus_rule()
    resources = build(directory.resolve())
    add_name_suffixes(resources)
    return sorted(resources, key=order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overlays", nargs="*", type=Path, help="overlay directories (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "k8s", help="default: build/k8s")
    parser.add_argument("--write-rules", action="store_true", help=f"write {PROMETHEUS_RULE.name} and stop")
    args = parser.parse_args(argv)
    if args.write_rules:
        PROMETHEUS_RULE.write_text(prometheus_rule_text(), encoding="utf-8")
        print(f"render-k8s: wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
        return 0
    overlays = args.overlays or sorted(p for p in OVERLAYS.iterdir() if p.is_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    for overlay in overlays:
        try:
            docs = render(overlay)
        except (KustomizeError, KeyError, OSError, yaml.YAMLError) as e:
            print(f"render-k8s: {overlay}: {e!r}", file=sys.stderr)
            return 2
        out = args.out / f"{overlay.name}.yaml"
        out.write_text(yaml.safe_dump_all(docs, sort_keys=True), encoding="utf-8")
        print(f"render-k8s: wrote {out} ({len(docs)} resources)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
