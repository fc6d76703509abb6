#!/usr/bin/env bash
# Fill docker/wheels/ with wheels of the image's runtime dependencies (all but torch/torchvision)
# and of everything they need, for `docker build --build-arg PIP_NO_INDEX=1` where the build
# cannot reach a package index. Uses the host's pip and its configured indexes. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" docker/runtime_requirements.py pyproject.toml >docker/wheels/requirements.txt
rc=0
"$PY" -m pip wheel -q --disable-pip-version-check --wheel-dir docker/wheels -r docker/wheels/requirements.txt \
  2>docker/wheels/pip.log || rc=$?
grep -v 'is ignored: it is neither' docker/wheels/pip.log >&2 || true
rm -f docker/wheels/requirements.txt docker/wheels/pip.log
exit "$rc"
