#!/usr/bin/env bash
# Build the stand-in images CI uses where no image registry is reachable (see docs/docker.md):
#
#   trainjob-standin/base        Debian 12 (debootstrap from the machine's apt mirror) + Python 3.11
#                                venv at /opt/venv with the Makefile's TORCH_PIN (torch, torchvision:
#                                the version the venv and the real base image have; + numpy, pip) that
#                                the host's pip installs from this machine's package sources. Passed as
#                                BASE_IMAGE, like the pytorch/pytorch runtime image it stands in for.
#   trainjob-standin/prometheus  the base + this machine's Debian prometheus binary, laid out like
#                                prom/prometheus (ENTRYPOINT /bin/prometheus, user nobody, /prometheus).
#
# Usage: docker/build-base.sh            (DOCKER_HOST picks the engine; idempotent: an image whose
#                                         cache-key label matches is kept)
# Env:   VENV=.venv  MIRROR=<apt mirror URL>  WORK=<scratch dir>  DOCKER=docker
#        PROMETHEUS_BIN=$(command -v prometheus)  TORCH_PIN='torch==X torchvision==Y' (default: the Makefile's)
# The pin is the one torch of the project (tests/infra/test_docker.py fails when the Makefile, the Dockerfile's
# base tag and this script disagree). Where only its CUDA build is served (as here), pip brings its
# nvidia-* libraries too: the stand-in is then about 4.5 GB, but it runs the torch that ships.
# Prints the two image references on its last two lines.
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
VENV=${VENV:-.venv}
BASE_REPO=trainjob-standin/base
PROM_REPO=trainjob-standin/prometheus
SUITE=bookworm
PY=$VENV/bin/python

log() { printf '[build-base %3ds] %s\n' "$SECONDS" "$*" >&2; }

[[ -x $PY ]] || { echo "error: $PY missing; run make setup first" >&2; exit 2; }
PROMETHEUS_BIN=${PROMETHEUS_BIN:-$(command -v prometheus || true)}
[[ -x $PROMETHEUS_BIN ]] || { echo "error: prometheus binary missing; apt-get install prometheus" >&2; exit 2; }
command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] ||
  { echo "error: debootstrap missing; apt-get install debootstrap" >&2; exit 2; }

# The mirror this machine's apt already uses (deb822 or one-line sources), else Debian's CDN.
if [[ -z ${MIRROR:-} ]]; then
  MIRROR=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*debian\/\{0,1\}\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
  [[ -n $MIRROR ]] || MIRROR=$(awk '$1=="deb" && $3=="'$SUITE'" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

# The project's one torch: the Makefile's TORCH_PIN, installed by the host's pip from its package sources.
TORCH_PIN=${TORCH_PIN:-$(sed -n 's/^TORCH_PIN := //p' Makefile)}
[[ $TORCH_PIN =~ ^torch==([0-9][0-9.]*)(\+[a-z0-9.]+)?[[:space:]]+torchvision==[0-9][0-9.]*(\+[a-z0-9.]+)?$ ]] ||
  { echo "error: TORCH_PIN '$TORCH_PIN' is not 'torch==X torchvision==Y'; fix the Makefile's TORCH_PIN line" >&2; exit 2; }
TORCH_VERSION=${BASH_REMATCH[1]}
PY_MINOR=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[[ $PY_MINOR == 3.11 ]] || { echo "error: $PY is Python $PY_MINOR; Debian 12's python3 is 3.11 and the wheels must match" >&2; exit 2; }

# Cache key: this script, the mirror, the torch spec, the prometheus binary.
KEY=$( { cat docker/build-base.sh; echo "$MIRROR $SUITE $TORCH_PIN"; sha256sum "$PROMETHEUS_BIN"; } |
       sha256sum | cut -c1-16)
BASE_IMAGE=$BASE_REPO:py$PY_MINOR-torch$TORCH_VERSION-$KEY
PROM_VERSION=$("$PROMETHEUS_BIN" --version 2>&1 | awk 'NR==1 {print $3}')
PROM_IMAGE=$PROM_REPO:${PROM_VERSION//+/-}-$KEY

have() { [[ $("$DOCKER" image inspect -f '{{index .Config.Labels "org.trainjob.standin.key"}}' "$1" 2>/dev/null) == "$KEY" ]]; }

if have "$BASE_IMAGE"; then
  log "cached: $BASE_IMAGE"
else
  WORK=${WORK:-$(mktemp -d /var/tmp/trainjob-standin.XXXXXX)}
  ROOT=$WORK/rootfs
  cleanup() { rm -rf "$WORK"; }
  trap cleanup EXIT
  log "debootstrap $SUITE from $MIRROR"
  debootstrap --variant=minbase --include=python3 "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }
  # Slim the rootfs: apt caches and docs are not needed to run Python.
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* \
    "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
  log "venv at /opt/venv + $TORCH_PIN numpy pip (host pip, local package sources)"
  chroot "$ROOT" python3 -m venv --without-pip /opt/venv
  DEST=$ROOT/opt/venv/lib/python$PY_MINOR/site-packages
  "$PY" -m pip install -q --no-warn-conflicts --disable-pip-version-check --only-binary=:all: \
    --target "$DEST" $TORCH_PIN numpy pip 2>&1 | grep -v 'is ignored: it is neither' >&2 || true
  "$PY" -c 'import sys; from pathlib import Path; sys.exit(not list(Path(sys.argv[1]).glob(f"torch-{sys.argv[2]}*.dist-info")))' "$DEST" "$TORCH_VERSION" ||
    { echo "error: pip could not install $TORCH_PIN; it must be in this machine's package sources" >&2; exit 1; }
  rm -rf "$DEST/bin" "$DEST/share"
  # pip's console script, pointing at the venv's interpreter.
  printf '#!/opt/venv/bin/python3\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n' \
    >"$ROOT/opt/venv/bin/pip"
  chmod 755 "$ROOT/opt/venv/bin/pip"
  log "docker import $BASE_IMAGE ($(du -sh "$ROOT" | cut -f1))"
  tar -C "$ROOT" -cf - . | "$DOCKER" import \
    --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "LABEL org.trainjob.standin.key=$KEY" \
    --change 'CMD ["python3"]' \
    - "$BASE_IMAGE" >/dev/null
  "$DOCKER" run --rm --network none "$BASE_IMAGE" python -c \
    'import torch, torchvision; assert torch.randn(2, 2).sum().isfinite(); print("stand-in torch", torch.__version__, "torchvision", torchvision.__version__)' >&2
  # The scratch tree (5-6 GB, tens of thousands of files) is in the image now. Deleting it took seconds on a quiet
  # machine and minutes while other tests shared the disk, with the image ready: it is renamed out of the way and
  # removed in the background, detached from this script's output (a caller waiting for it would wait for rm).
  trap - EXIT
  mv "$WORK" "$WORK.removing.$$" && setsid -f rm -rf "$WORK.removing.$$" </dev/null >/dev/null 2>&1
fi

if have "$PROM_IMAGE"; then
  log "cached: $PROM_IMAGE"
else
  CTX=$(mktemp -d)
  cp "$PROMETHEUS_BIN" "$CTX/prometheus"
  cat >"$CTX/Dockerfile" <<EOF
FROM $BASE_IMAGE
COPY prometheus /bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
LABEL org.trainjob.standin.key=$KEY
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
  log "docker build $PROM_IMAGE"
  DOCKER_BUILDKIT=0 "$DOCKER" build -q --network host -t "$PROM_IMAGE" "$CTX" >/dev/null
  rm -rf "$CTX"
fi
# Older stand-ins (another cache key) would pile up 1 GB each in a kept data root: drop them.
for img in "$PROM_IMAGE" "$BASE_IMAGE"; do  # children first: an old prometheus stand-in sits on an old base
  "$DOCKER" images --format '{{.Repository}}:{{.Tag}}' "${img%%:*}" | grep -vxF "$img" |
    xargs -r "$DOCKER" rmi >/dev/null 2>&1 || true
done
log "done"
echo "$BASE_IMAGE"
echo "$PROM_IMAGE"
