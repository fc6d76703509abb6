# Threads and their CPU time, trainer vs loop, lm-24x384 eager; OMP_NUM_THREADS=1 variants; pinned variants.
O=/tmp/s21; mkdir -p $O
A="workload=lm-24x384 train.amp=bf16 train.compile=false strategy=ddp train.steps=150 train.timing_warmup=10 train.log_every=10 train.checkpoint_every=0 train.final_checkpoint=false train.run_dir=/tmp/runs-h train.resume=overwrite"
python3 -c "import torch; print('threads', torch.get_num_threads(), torch.__config__.parallel_info())" > $O/par.txt 2>&1
for r in 1 2; do for v in loop train train1 loop1; do
  W=${v%1}; E=""; [ $v != $W ] && E="OMP_NUM_THREADS=1"
  env $E python3 .gpu/threads.py $W $A train.run_id=t-$v > $O/$v-$r.log 2>&1
  grep "HOSTCMP\|THREADS" $O/$v-$r.log | sed "s/^/r$r $v: /" >> $O/out.txt
done; done
for v in train1 loop1 train; do
  W=${v%1}; E=""; [ $v != $W ] && E="OMP_NUM_THREADS=1"
  env $E taskset -c 3 python3 .gpu/threads.py $W $A train.run_id=p-$v > $O/p-$v.log 2>&1
  grep "HOSTCMP\|THREADS" $O/p-$v.log | sed "s/^/pinned $v: /" >> $O/out.txt
done
echo done >> $O/out.txt
