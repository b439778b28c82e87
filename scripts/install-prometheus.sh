#!/usr/bin/env bash
# Installs Debian's `prometheus` package (prometheus + promtool) when either binary is missing.
# Idempotent: does nothing when both are on PATH. `apt-get update` runs only if the first install fails
# (a stale or empty package list). The tests start their own Prometheus on loopback, so the packaged
# daemon must not start: a policy-rc.d that refuses service starts is put in place for the install
# when the machine has none (Docker images usually do).
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
fi

POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\n# Temporary, from scripts/install-prometheus.sh: no daemon starts.\nexit 101\n' \
        | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi

install() {
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
}

if ! install; then
    $SUDO apt-get update -q
    install
fi

command -v prometheus >/dev/null && command -v promtool >/dev/null
prometheus --version 2>&1 | head -n 1
