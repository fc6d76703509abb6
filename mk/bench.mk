# Benchmark (issue 8): every strategy side by side, each in a fresh trainer process; docs/benchmarks.md.
# GPUs visible: workloads resnet50 and lm on all visible cards (plus the 1-GPU baseline); no GPU: tiny.
# ARGS='key=value ...' is passed on, e.g. ARGS='train.amp=bf16 bench.telemetry_overhead=true'.
.PHONY: bench

bench: setup ## Benchmark every strategy (GPUs: resnet50 + lm on all visible cards; CPU: tiny) -> runs/bench-*/
	@workloads=$$($(PY) -c 'import torch; print("[resnet50,lm]" if torch.cuda.is_available() else "[tiny]")'); \
	  echo "$(PY) -m job bench bench.workloads=$$workloads $(ARGS)"; \
	  $(PY) -m job bench bench.workloads=$$workloads $(ARGS)
