# Containers and dashboards (issue 5): the image, the compose stack, CI's stand-in base. docs/docker.md.
IMAGE ?= trainjob:latest
BASE_IMAGE ?=
PIP_NO_INDEX ?=
TRAINJOB_HOST ?= $(shell hostname)
SERVICES ?=
# Your own model under compose (docs/docker.md, "Your model in the image"): CONTEXT is your project's folder with a
# Dockerfile FROM $(TRAINJOB_BASE) (built first from this repository), built and run as IMAGE; DATA and CODE are
# host folders mounted read-only at /data and /code; WORKLOAD and ARGS reach the trainer's command line.
CONTEXT ?=
TRAINJOB_BASE ?= trainjob:latest
DATA ?=
CODE ?=
# Compose v2 (`docker compose`) where installed, else Debian's docker-compose 1.29 (>= 1.27: `extends` with
# a file, docker/compose-devices.yml; GPUS=none -> TRAINJOB_DEVICES=cpu: no GPU reservation).
COMPOSE = $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: image image-wheels image-lock images-verify image-standin up down docker-test

image: ## Build the image (IMAGE=trainjob:latest BASE_IMAGE=... PIP_NO_INDEX=1: offline, from docker/wheels/)
	docker build -t $(IMAGE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  $(if $(PIP_NO_INDEX),--build-arg PIP_NO_INDEX=$(PIP_NO_INDEX)) .

image-wheels: setup ## Put the image's non-torch dependencies in docker/wheels/ for offline builds
	PY=$(PY) docker/fetch-wheels.sh

image-lock: setup ## Re-resolve docker/requirements.lock (versions + sha256 of the image's non-torch wheels)
	$(PY) docker/lock.py

images-verify: ## Compare every pinned digest (Dockerfile, compose) with its registry (needs crane or docker buildx)
	$(PY) docker/images.py verify

image-standin: setup ## Build CI's stand-in base and prometheus images from this machine's package sources
	VENV=$(VENV) docker/build-base.sh

up: export TRAIN_ARGS := $(ARGS)
up: ## docker compose up: trainer, exporter, Prometheus, Grafana (needs GRAFANA_ADMIN_PASSWORD_FILE; STRATEGY, WORKLOAD, ARGS, GPUS=all|0,1|none: CPU, SERVICES=, CONTEXT= DATA= CODE=: your model)
	$(if $(CONTEXT),@test "$(IMAGE)" != "$(TRAINJOB_BASE)" || { echo "error: CONTEXT=$(CONTEXT) builds your image on top of $(TRAINJOB_BASE); name yours: IMAGE=myproject:latest" >&2; exit 2; })
	$(if $(CONTEXT),docker build -t $(TRAINJOB_BASE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  $(if $(PIP_NO_INDEX),--build-arg PIP_NO_INDEX=$(PIP_NO_INDEX)) .)
	TRAINJOB_IMAGE=$(IMAGE) TRAINJOB_HOST=$(TRAINJOB_HOST) $(if $(STRATEGY),STRATEGY=$(STRATEGY)) \
	  $(if $(WORKLOAD),WORKLOAD=$(WORKLOAD)) $(if $(DATA),DATA_DIR=$(abspath $(DATA))) \
	  $(if $(CODE),CODE_DIR=$(abspath $(CODE))) \
	  $(if $(CONTEXT),TRAINJOB_CONTEXT=$(abspath $(CONTEXT)) TRAINJOB_BASE=$(TRAINJOB_BASE)) \
	  $(if $(filter none,$(GPUS)),TRAINJOB_DEVICES=cpu) $(COMPOSE) up -d --build $(SERVICES) \
	  $(if $(filter none,$(GPUS)),,|| { rc=$$?; echo "hint: an engine without the NVIDIA runtime says 'could not select device driver nvidia': make up GPUS=none runs the stack on the CPU" >&2; exit $$rc; })
	@echo "Grafana: http://$${BIND_ADDR:-127.0.0.1}:$${GRAFANA_PORT:-3000} (anonymous read-only; admin: the password in GRAFANA_ADMIN_PASSWORD_FILE)"

down: ## docker compose down (keeps the runs, Prometheus and Grafana volumes; ARGS=-v deletes them)
	@docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers (docker info failed): nothing to stop; start the engine first if the stack should be running" >&2; exit 1; }
	GRAFANA_ADMIN_PASSWORD_FILE=$${GRAFANA_ADMIN_PASSWORD_FILE:-/dev/null} $(COMPOSE) down $(ARGS)

docker-test: setup ## The docker and dashboard tests only (first run builds the stand-in base: minutes)
	$(PY) -m pytest -q tests/infra/test_dashboards.py tests/infra/test_docker.py $(ARGS)
