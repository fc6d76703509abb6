# Slurm (issue 6): submit the trainer through submitit; a local test cluster for trying it (slurm/cluster.sh).
# `make submit` maps the variables below to `python -m job submit` keys; unset ones keep the config's values.
GPUS ?=
NODES ?=
PARTITION ?=
TIME ?=
ACCOUNT ?=
QOS ?=
EXECUTOR ?=
SLURM_TEST_DIR ?= /tmp/jobtest-slurm
SLURM_NODES ?= 1
SLURM_GPUS ?= 2

SUBMIT_ARGS = $(if $(STRATEGY),strategy=$(STRATEGY)) $(if $(WORKLOAD),workload=$(WORKLOAD)) \
  $(if $(GPUS),submit.gpus_per_node=$(GPUS)) $(if $(NODES),submit.nodes=$(NODES)) \
  $(if $(PARTITION),submit.partition=$(PARTITION)) $(if $(TIME),submit.timeout_min=$(TIME)) \
  $(if $(ACCOUNT),submit.account=$(ACCOUNT)) $(if $(QOS),submit.qos=$(QOS)) \
  $(if $(EXECUTOR),submit.executor=$(EXECUTOR))

JOB ?=
RUN ?=
FOLLOW ?=

.PHONY: submit status slurm-up slurm-down

submit: setup ## Submit training via submitit: STRATEGY= WORKLOAD= GPUS= NODES= PARTITION= TIME=(min) ACCOUNT= QOS= EXECUTOR=auto|slurm|local
	$(PY) -m job submit $(strip $(SUBMIT_ARGS)) $(ARGS)

status: setup ## A submitted job's state, exit code, logs, per-card table: JOB=<id> or RUN=<run id>; FOLLOW=1 prints the log until it ends
	@test -n "$(JOB)$(RUN)" || { echo "error: give JOB=<job id> or RUN=<run id> (make submit printed the job id and the run)" >&2; exit 2; }
	$(PY) -m job status $(or $(JOB),$(RUN)) $(if $(FOLLOW),--follow) $(ARGS)

slurm-up: ## Start a local Slurm test cluster (SLURM_NODES=1|2, SLURM_GPUS fake GPUs/node) in SLURM_TEST_DIR
	NODES=$(SLURM_NODES) GPUS=$(SLURM_GPUS) bash slurm/cluster.sh up $(SLURM_TEST_DIR)

slurm-down: ## Cancel the local test cluster's jobs and stop its daemons
	bash slurm/cluster.sh down $(SLURM_TEST_DIR)
