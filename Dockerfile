# The training job image: `docker run IMAGE train strategy=ddp ...` runs `python -m job train ...`.
# BASE_IMAGE brings Python >= 3.11 and torch (the CUDA runtime image by default). With no registry,
# CI passes a CPU stand-in built from the machine's own package sources (docker/build-base.sh).
# Build: `make image` (BASE_IMAGE=..., PIP_NO_INDEX=1 for offline builds from docker/wheels/).
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# PCI bus order makes CUDA's device indices match nvidia-smi/NVML (DESIGN.md: device identity).
ENV CUDA_DEVICE_ORDER=PCI_BUS_ID \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies in their own layer, rebuilt only when pyproject.toml (or the offline wheels) change.
# torch and torchvision come from the base image and are never reinstalled over it.
# PIP_NO_INDEX=1: install only from docker/wheels/ (filled by `make image-wheels`).
ARG PIP_NO_INDEX=0
COPY pyproject.toml docker/runtime_requirements.py /tmp/build/
COPY docker/wheels/ /tmp/build/wheels/
RUN python /tmp/build/runtime_requirements.py /tmp/build/pyproject.toml >/tmp/build/requirements.txt \
 && python -m pip install --no-cache-dir --find-links /tmp/build/wheels -r /tmp/build/requirements.txt \
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
