# Per-card telemetry (issue 4): the standalone exporter, a local Prometheus with the project's rules,
# the rule tests and the scrape benchmark. docs/telemetry.md.
EXPORTER_PORT ?= 9400
PROMETHEUS_PORT ?= 9090
PROMETHEUS_DATA ?= runs/prometheus-data

.PHONY: export prometheus rules-check bench-scrape telemetry-test

export: setup ## Serve per-card NVML metrics on 127.0.0.1:9400 (EXPORTER_PORT=) via python -m job export
	$(PY) -m job export --port $(EXPORTER_PORT) $(ARGS)

prometheus: ## Run Prometheus on 127.0.0.1:9090 (PROMETHEUS_PORT=) with monitoring/prometheus/ (scrapes 9400, 9401)
	prometheus --config.file=monitoring/prometheus/prometheus.yml --storage.tsdb.path=$(PROMETHEUS_DATA) \
	  --web.listen-address=127.0.0.1:$(PROMETHEUS_PORT)

rules-check: ## promtool check config + check rules + test rules on monitoring/prometheus/
	cd monitoring/prometheus && promtool check config prometheus.yml && promtool check rules rules/*.yml \
	  && promtool test rules tests/*.yml

bench-scrape: setup ## Time a merged scrape with 8 fake cards x 8 rank processes (prints a table)
	$(PY) -m job.telemetry --bench-scrape $(ARGS)

telemetry-test: setup ## The telemetry tests only (devices, collectors, exporter, Prometheus end to end)
	$(PY) -m pytest -q tests/unit/test_devices.py tests/unit/test_telemetry.py tests/e2e/test_telemetry_runs.py tests/infra/test_prometheus.py
