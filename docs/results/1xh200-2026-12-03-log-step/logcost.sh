# What one log step costs on the card's host: the trainer's log step and its parts, per shape (eager and compiled).
O=/tmp/logcost; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name" >> $O/host.txt
python3 -c "import torch; print(torch.__version__)" >> $O/host.txt
run() { tag=$1; shift; python3 .gpu/logcost.py train strategy=ddp strategy.nprocs=1 train.amp=bf16 train.log_every=10 train.run_dir=/tmp/runs train.run_id=$tag "$@" > $O/$tag.txt 2>&1; echo "$tag rc=$?" >> $O/host.txt; }
run lm24-eager workload=lm-24x384 train.steps=60
run lm12-compiled workload=lm-12x512 train.steps=60 train.compile=true
run lm-eager workload=lm train.steps=60
run rn50-compiled workload=resnet50 train.steps=40 train.batch_size=256 train.channels_last=true train.compile=true
for f in /tmp/runs/*/metrics.jsonl; do python3 - "$f" >> $O/windows.txt <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
print(sys.argv[1], [(x["step"], round(x["samples_per_s"], 1)) for x in r])
PY
done
python3 -m job bench bench.workloads=[lm-24x384] train.amp=bf16 bench.strategies=[ddp] bench.baseline=none bench.reference=true bench.repeats=3 bench.warmup=10 bench.steps=200 train.run_dir=/tmp/runs-b bench.out=/tmp/lb24 > $O/bench-lm24-eager.txt 2>&1
cp /tmp/lb24/bench.json $O/bench-lm24-eager.json
