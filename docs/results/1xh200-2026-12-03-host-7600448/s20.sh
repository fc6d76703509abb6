# Session 20: lm-24x384 host dispatch (eager first, 2 repeats; compiled 1 repeat), py-spy eager, pinned eager; then
# the config-read check (lm eager, resnet50 eager against the loop). Everything under /tmp/s20.
export PATH=/tmp/site/bin:$PATH
O=/tmp/s20; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name" >> $O/host.txt; python3 -c "import torch; print(torch.__version__)" >> $O/host.txt
args() { echo "workload=lm-24x384 train.amp=bf16 train.compile=$1 strategy=ddp train.steps=150 train.timing_warmup=10 train.log_every=10 train.checkpoint_every=0 train.final_checkpoint=false train.run_dir=/tmp/runs-h train.resume=overwrite"; }
run3() { # tag repeats
  for r in $(seq $2); do for which in loop train even; do
    if [ $which = even ]; then X="strategy.split=even"; W=train; else X=""; W=$which; fi
    python3 .gpu/hostcmp.py $W $(args $([ $1 = compiled ] && echo true || echo false)) $X train.run_id=h-$1-$which > $O/run-$1-$which-$r.log 2>&1
    grep "HOSTCMP" $O/run-$1-$which-$r.log | sed "s/^/$1 r$r $which: /" >> $O/hostcmp.txt
  done; done; }
date -u +%T >> $O/host.txt
run3 eager 2
for which in loop train; do
  if [ $which = loop ]; then M="-m job.bench.reference"; else M="-m job train"; fi
  py-spy record -r 500 -f raw -o $O/spy-eager-$which.txt -- python3 $M $(args false) train.steps=300 train.run_id=s-$which > $O/spy-eager-$which.log 2>&1
  echo "spy eager $which rc=$?" >> $O/hostcmp.txt
done
for which in loop train; do
  taskset -c 3 python3 .gpu/hostcmp.py $which $(args false) train.run_id=p-$which 2>&1 | grep "HOSTCMP" | sed "s/^/eager pinned $which: /" >> $O/hostcmp.txt
done
date -u +%T >> $O/host.txt
run3 compiled 1
date -u +%T >> $O/host.txt
mkdir -p $O/loopc; touch $O/loopc/logcost-lm24-eager.txt; O=$O/loopc bash docs/results/1xh200-2026-12-03-loop-a36ab3c/loop.sh "lm false" "resnet50 false"
date -u +%T >> $O/host.txt
echo done >> $O/host.txt
