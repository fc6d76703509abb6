# (1) the GPU tests of data.decode=auto and training from JPEGs; (2) eager ResNet-50 ddp on 8 of the host's cores
# (taskset), 7 workers: synthetic; data.decode=auto (tuned while it trains); decode=cpu; decode=gpu. 3 repeats, 10+250.
O=/tmp/auto; mkdir -p $O
nproc > $O/host.txt; lscpu | grep -E "Model name|Thread|Core|Socket" >> $O/host.txt
python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_data.py -k "auto or training_from" > $O/pytest.txt 2>&1
echo pytest rc=$? >> $O/host.txt
taskset -c 0-7 python3 -m job bench bench.workloads=[resnet50] train.amp=bf16 train.channels_last=true \
  train.batch_size=256 bench.baseline=none bench.strategies=[ddp] bench.imagefolder=true \
  bench.imagefolder_images=5000 bench.imagefolder_dir=/tmp/bench-images bench.repeats=3 bench.warmup=10 \
  bench.steps=250 data.workers=7 'bench.imagefolder_variants=["data.decode=cpu","data.decode=gpu"]' \
  train.run_dir=/tmp/runs bench.out=$O/bench > $O/bench.txt 2>&1
echo bench rc=$? >> $O/host.txt
grep -h "data.decode=auto:" $O/bench/runs/*/log* $O/bench/runs/*/*.log 2>/dev/null > $O/auto-lines.txt
grep -rh "data.decode=auto:" $O/bench/runs/ 2>/dev/null | head -40 >> $O/auto-lines.txt
