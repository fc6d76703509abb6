#!/usr/bin/env bash
# Prometheus 2.42 + promtool (Debian) for tests/infra/test_prometheus.py and the telemetry tests'
# `promtool check metrics`. The tests start Prometheus themselves on loopback; the package's own
# service is never started here (no init system). Idempotent. .ci/run has already run `apt-get update`.
set -euo pipefail
if ! dpkg-query -W -f='${Status}\n' prometheus 2>/dev/null | grep -q '^install ok installed$'; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
echo "prometheus: $(prometheus --version 2>&1 | head -1)"
