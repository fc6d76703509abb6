# The training job image: `docker run IMAGE train strategy=ddp ...` runs `python -m job train ...`.
# BASE_IMAGE brings Python 3.11 and torch (the CUDA runtime image by default), pinned by digest: the
# tag for people, the digest for the engine (docs/docker.md says how to refresh it). Its torch is
# TORCH_VERSION = the Makefile's TORCH_PIN, checked below. With no registry, CI passes a stand-in
# built from the machine's own package sources with the same torch (docker/build-base.sh).
# Build: `make image` (BASE_IMAGE=..., PIP_NO_INDEX=1 for offline builds from docker/wheels/).
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.2-cudnn9-runtime@sha256:c4ab67f95221a342dff0e8ca4543a7b8885f79f7a0029c0e2e39685d5eaf1722
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.14.1

# PCI bus order makes CUDA's device indices match nvidia-smi/NVML (docs/design.md: device identity).
ENV CUDA_DEVICE_ORDER=PCI_BUS_ID \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies in their own layer, rebuilt only when the lock (or the offline wheels) change: exactly
# the versions and wheel hashes of docker/requirements.lock (`make image-lock`), nothing resolved here.
# torch and torchvision come from the base image and are never reinstalled over it; the build stops
# if its torch is not TORCH_VERSION. PIP_NO_INDEX=1: only from docker/wheels/ (`make image-wheels`).
ARG PIP_NO_INDEX=0
COPY docker/requirements.lock /tmp/build/
COPY docker/wheels/ /tmp/build/wheels/
RUN python -m pip install --no-cache-dir --require-hashes --no-deps --only-binary=:all: \
      --find-links /tmp/build/wheels -r /tmp/build/requirements.lock \
 && python -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(v != sys.argv[1] and f'error: the base image has torch {v}, the pin is {sys.argv[1]} (TORCH_PIN in the Makefile)')" "${TORCH_VERSION}" \
 && python -c "import torch, omegaconf, prometheus_client, submitit, pynvml" \
 && rm -rf /tmp/build

# A non-root user owns the working directory (and so the runs/ volume that compose mounts there).
RUN useradd --no-log-init --create-home --uid 10001 --user-group trainer \
 && mkdir -p /workspace/runs \
 && chown -R trainer:trainer /workspace

# The code last: editing job/ rebuilds only this layer. Owned by root, read-only to the trainer.
COPY job/ /opt/trainjob/job/
ENV PYTHONPATH=/opt/trainjob

USER 10001:10001
WORKDIR /workspace
ENTRYPOINT ["python", "-m", "job"]
CMD ["train"]
