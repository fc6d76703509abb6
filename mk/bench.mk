# Benchmark (issues 8, 12, 16): every strategy side by side, each in a fresh trainer process; docs/benchmarks.md.
# GPUs visible: workloads resnet50, lm and two narrower lm shapes (lm-12x512, lm-24x384: no strategy is tuned to
# one shape) on all visible cards (plus the 1-GPU baseline); no GPU: tiny.
# ARGS='key=value ...' is passed on, e.g. ARGS='train.amp=bf16 bench.telemetry_overhead=true'.
.PHONY: bench bench-maxbatch bench-profile

bench: setup ## Benchmark every strategy, 3 repeats (GPUs: resnet50, lm, lm-12x512, lm-24x384 on all visible cards; CPU: tiny) -> runs/bench-*/
	@workloads=$$($(PY) -c 'import torch; print("[resnet50,lm,lm-12x512,lm-24x384]" if torch.cuda.is_available() else "[tiny]")'); \
	  echo "$(PY) -m job bench bench.workloads=$$workloads $(ARGS)"; \
	  $(PY) -m job bench bench.workloads=$$workloads $(ARGS)

# On a CPU nothing runs out of memory before the host does: there, 5 trials (batch 64 to 1024) bound it.
bench-maxbatch: setup ## Largest global batch each strategy trains (GPUs: lm bf16; CPU: tiny); ARGS='bench.tenant_gb=80' shares card 0
	@args=$$($(PY) -c 'import torch; print("workload=lm train.amp=bf16" if torch.cuda.is_available() else "workload=tiny bench.maxbatch_trials=5")'); \
	  echo "$(PY) -m job bench bench.mode=maxbatch $$args $(ARGS)"; \
	  $(PY) -m job bench bench.mode=maxbatch $$args $(ARGS)

bench-profile: setup ## Where a dp step's time goes (torch.profiler; GPUs: lm bf16; CPU: tiny) -> runs/bench-*/profile-*
	@args=$$($(PY) -c 'import torch; print("workload=lm train.amp=bf16" if torch.cuda.is_available() else "workload=tiny")'); \
	  echo "$(PY) -m job bench bench.mode=profile strategies=[dp] $$args $(ARGS)"; \
	  $(PY) -m job bench bench.mode=profile strategies=[dp] $$args $(ARGS)
