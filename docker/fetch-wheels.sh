#!/usr/bin/env bash
# Fill docker/wheels/ with the wheels docker/requirements.lock pins (all but torch/torchvision), for
# `docker build --build-arg PIP_NO_INDEX=1` where the build cannot reach a package index. Uses the
# host's pip and its configured indexes; pip checks every wheel against the lock's sha256 hashes.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rc=0
"$PY" -m pip download -q --disable-pip-version-check --require-hashes --no-deps --only-binary=:all: \
  --python-version 3.11 --implementation cp --abi cp311 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --dest docker/wheels -r docker/requirements.lock 2>docker/wheels/pip.log || rc=$?
grep -v 'is ignored: it is neither' docker/wheels/pip.log >&2 || true
rm -f docker/wheels/pip.log
exit "$rc"
