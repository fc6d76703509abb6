# compiled ResNet-50 ddp on 8 of the host's cores (taskset: a Slurm allocation of 8 cores a card), 7 workers:
# synthetic, the workers alone, half of the JPEGs on the card; 3 repeats, 10 + 150 steps.
O=/tmp/tight; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name|Thread|Core|Socket|MHz" >> $O/host.txt
taskset -c 0-7 python3 -m job bench bench.workloads=[resnet50] train.amp=bf16 train.channels_last=true \
  train.batch_size=256 train.compile=true bench.baseline=none bench.strategies=[ddp] bench.imagefolder=true \
  bench.imagefolder_images=5000 bench.imagefolder_dir=/tmp/bench-images bench.repeats=3 bench.warmup=10 \
  bench.steps=150 data.workers=7 'bench.imagefolder_variants=["data.decode=gpu data.gpu_share=0.5"]' \
  train.run_dir=/tmp/runs bench.out=$O/bench > $O/bench.txt 2>&1
echo bench rc=$? >> $O/host.txt
