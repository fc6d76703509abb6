# Kubernetes (k8s/): render, refresh the copies of monitoring/, validate offline. docs/kubernetes.md.
.PHONY: k8s-render k8s-sync k8s-check

k8s-render: setup ## Print every object `kubectl apply -k k8s` would create (kustomize, offline)
	@$(VENV)/bin/kubectl kustomize k8s

k8s-sync: setup ## Regenerate k8s/monitoring/ (PrometheusRules, dashboard copies) from monitoring/
	$(PY) k8s/sync.py

k8s-check: setup ## The Kubernetes tests only: schemas, CRD models, sync, contract runs (CPU, Docker)
	$(PY) -m pytest -q tests/test_k8s.py tests/test_k8s_contract.py tests/test_k8s_docker.py tests/test_k8s_gpu.py
