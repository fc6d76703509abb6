# The Makefile mirrors CI: `make test` is exactly what .ci/run runs after installing system packages.
SHELL := /bin/bash
# The variables below are settings given on make's command line (`make submit TIME=30`). Short names such as
# TIME (GNU time's output format), NODES, JOB or RUN are also common environment variables: a value that
# comes from the environment is ignored, never passed on as a setting (`TIME='%E real' make submit` must not
# become submit.timeout_min=%E real). docs/security.md.
CLI_VARS := STRATEGY ARGS PYTHON VENV GPUS NODES PARTITION TIME ACCOUNT QOS EXECUTOR JOB RUN FOLLOW IMAGE SERVICES
$(foreach v,$(CLI_VARS),$(if $(filter environment environment\ override,$(origin $(v))),$(eval undefine $(v))))
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STRATEGY ?=
WORKLOAD ?=
ARGS ?=
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.DEFAULT_GOAL := help
.PHONY: help setup run test lint

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sort -u | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  make %-14s %s\n", $$1, $$2}'
	@echo "  variables: STRATEGY=<dp|balanced|balanced-graphs|ddp|fsdp|accum> WORKLOAD=<preset|module:attribute> ARGS='key=value ...'"

$(VENV)/.stamp-setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.stamp-setup ## Create .venv with torch and the project (idempotent)

run: setup ## Train a short local run on the embedded default and print the per-card table
	$(PY) -m job train $(if $(STRATEGY),strategy=$(STRATEGY)) $(if $(WORKLOAD),workload=$(WORKLOAD)) $(ARGS)

# compileall first: the suite starts hundreds of `python -m job` processes, and where PYTHONDONTWRITEBYTECODE is
# set (as on CI's machine) none of them writes the package's bytecode, so each compiled job/ again (~0.1 s).
test: setup ## Run the whole test suite (what CI runs); fails if no test ran
	$(PY) -m compileall -q job
	$(PY) -m pytest -n 2 --dist loadgroup $(ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; exit $$rc

lint: setup ## ruff check
	$(PY) -m ruff check job tests examples

-include $(wildcard mk/*.mk)
