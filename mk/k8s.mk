# Kubernetes (k8s/): render, refresh the copies of monitoring/, pin the image, validate offline. docs/kubernetes.md.
.PHONY: k8s-render k8s-sync k8s-pin k8s-pins k8s-check

k8s-render: setup ## Print every object `kubectl apply -k k8s` would create (kustomize, offline)
	@$(VENV)/bin/kubectl kustomize k8s

k8s-sync: setup ## Regenerate k8s/monitoring/ (PrometheusRules, dashboard copies) from monitoring/
	$(PY) k8s/sync.py

k8s-pin: setup ## Pin the image by digest in k8s/image (IMAGE=registry/team/trainjob:0.1.0[@sha256:...])
	@test -n "$(IMAGE)" && [ "$(IMAGE)" != "trainjob:latest" ] || \
	  { echo "error: give IMAGE=registry/team/trainjob:TAG (the pushed image), optionally @sha256:DIGEST" >&2; exit 2; }
	$(PY) k8s/pins.py $(if $(findstring @sha256:,$(IMAGE)),set,resolve) $(IMAGE)

k8s-pins: setup ## Refuse (exit 2) any image in k8s, k8s/multinode, k8s/pytorchjob not pinned by digest
	$(PY) k8s/pins.py check

k8s-check: setup ## The Kubernetes tests only: schemas, CRD models, policies, sync, contract runs (CPU, Docker)
	$(PY) -m pytest -q tests/infra/test_k8s.py tests/infra/test_k8s_contract.py tests/infra/test_k8s_docker.py tests/gpu/test_k8s_gpu.py
