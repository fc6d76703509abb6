O=/tmp/auto2; mkdir -p $O
pkill -f "job bench" ; sleep 1
python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_data.py -k "auto" > $O/pytest.txt 2>&1
echo pytest rc=$? >> $O/host.txt
ls /tmp/bench-images/MANIFEST.json >> $O/host.txt 2>&1
taskset -c 0-7 python3 -m job train workload=resnet50 strategy=ddp train.amp=bf16 train.channels_last=true \
  train.batch_size=256 train.steps=300 train.log_every=25 data.kind=imagefolder data.path=/tmp/bench-images \
  data.workers=7 data.prefetch=true train.run_dir=/tmp/runs train.run_id=auto8 > $O/train.txt 2>&1
echo train rc=$? >> $O/host.txt
