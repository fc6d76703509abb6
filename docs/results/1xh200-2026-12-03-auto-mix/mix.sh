# data.decode=auto with the mix step, 8 of the host's cores (taskset), 7 workers, ResNet-50 ddp bf16 channels_last:
# compiled and eager benches (synthetic against auto), 3 repeats, 10 + 400 (compiled) / 300 (eager) steps; the GPU test of auto.
O=/tmp/mix; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name|Thread|Core|Socket|MHz" >> $O/host.txt
python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" >> $O/host.txt
for mode in compiled PYTEST eager; do
  if [ $mode = PYTEST ]; then
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_data.py -k "auto" > $O/pytest.txt 2>&1
    echo pytest rc=$? >> $O/host.txt
    continue
  fi
  c=false; n=300; [ $mode = compiled ] && c=true && n=400
  taskset -c 0-7 python3 -m job bench bench.workloads=[resnet50] train.amp=bf16 train.channels_last=true \
    train.batch_size=256 train.compile=$c bench.baseline=none bench.strategies=[ddp] bench.imagefolder=true \
    bench.imagefolder_images=5000 bench.imagefolder_dir=/tmp/bench-images bench.repeats=3 bench.warmup=10 \
    bench.steps=$n data.workers=7 train.run_dir=/tmp/runs bench.out=/tmp/mixb-$mode > $O/bench-$mode.txt 2>&1
  echo bench $mode rc=$? >> $O/host.txt
  cp /tmp/mixb-$mode/bench.json $O/bench-$mode.json
  grep -H "data.decode=auto: \|input: " /tmp/mixb-$mode/logs/*.log > $O/auto-lines-$mode.txt
done
