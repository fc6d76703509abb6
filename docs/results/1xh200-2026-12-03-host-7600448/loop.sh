# The trainer (ddp, one process) against the hand-written loop on every bench shape, eager and compiled,
# 3 repeats (order rotated), 10 + 150 steps; and one run's log-step cost after the change.
O=${O:-/tmp/loop}; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name" >> $O/host.txt
python3 -c "import torch; print(torch.__version__)" >> $O/host.txt
[ -f $O/logcost-lm24-eager.txt ] || python3 .gpu/logcost.py train workload=lm-24x384 strategy=ddp strategy.nprocs=1 train.amp=bf16 train.steps=60 train.log_every=10 train.run_dir=/tmp/runs train.run_id=lc > $O/logcost-lm24-eager.txt 2>&1
# bash .gpu/loop.sh "lm false" "lm true" ...  (shape compiled); each compiled bench ~2.5-3 min, eager ~1.5 min
for job in "$@"; do
  set -- $job; w=$1; c=$2; tag=$w-$([ $c = true ] && echo compiled || echo eager)
  extra=""; [ $w = resnet50 ] && extra="train.batch_size=256 train.channels_last=true"
  date -u +%T >> $O/host.txt
  python3 -m job bench bench.workloads=[$w] train.amp=bf16 train.compile=$c $extra bench.strategies=[ddp] bench.baseline=none \
    bench.reference=true bench.repeats=3 bench.warmup=10 bench.steps=150 train.run_dir=/tmp/runs-$tag bench.out=/tmp/b-$tag > $O/bench-$tag.txt 2>&1
  echo "$tag rc=$?" >> $O/host.txt
  cp /tmp/b-$tag/bench.json $O/bench-$tag.json
  grep -A3 "ratios of medians" $O/bench-$tag.txt | grep "loop" | sed "s/^/$tag: /" >> $O/summary.txt
done
date -u +%T >> $O/host.txt
