"""k8s/ manifests on real cards: the pod's command lines as the kubelet runs them, on 2 GPUs.

Skipped without 2 CUDA devices. What they settle that CPU runs cannot: the granted cards
(CUDA_VISIBLE_DEVICES=0,1 in the pod) show up as two cards on the metrics port, and the SIGTERM
checkpoint of the manifests' real workloads (ResNet-50 bf16 in job.yaml, the LM with AdamW in the
multi-node ConfigMap) fits the time Kubernetes and torchrun allow.

    python -m pytest -q -s tests/gpu/test_k8s_gpu.py     # on the 2-GPU machine; -s prints the timings
"""

from __future__ import annotations

import re
import signal
import time

from tests._k8s_helpers import K8S, LocalPod, load_docs, one
from tests.conftest import requires_gpus
from tests.infra.test_k8s_contract import (
    TORCHRUN_SIGTERM_TIMEOUT_S,
    free_port,
    job_pod,
    metrics_port_override,
    scrape,
    start,
)


def wait_for_samples(proc, port: int, log, minimum: float, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            text = scrape(port)
            m = re.search(r"^trainjob_samples_total(?:\{[^}]*\})? (\S+)$", text, re.M)
            if m and float(m.group(1)) >= minimum:
                return text
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no training progress on the metrics port:\n{log.read_text()[-4000:]}")


def stop_and_time(proc, timeout: float) -> tuple[int, float]:
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, time.monotonic() - sent


@requires_gpus(2)
def test_job_yaml_on_two_gpus_sigterm_within_grace_and_resume(tmp_path):
    """job.yaml's container as is (ResNet-50, bf16, channels_last, ddp on the 2 granted cards)."""
    pod, job = job_pod(tmp_path, "trainjob-gpu01")
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    port, telemetry = metrics_port_override()
    log = tmp_path / "pod1.log"
    proc = start(pod, "trainer", ["train.steps=100000", "train.log_every=10"] + telemetry, log)
    text = wait_for_samples(proc, port, log, minimum=256 * 20)
    # the pod's CUDA_VISIBLE_DEVICES=0,1 gives two cards, each reported once
    uuids = set(re.findall(r'^trainjob_gpu_memory_used_bytes\{[^}]*uuid="([^"]+)"', text, re.M))
    assert len(uuids) == 2, text
    rc, took = stop_and_time(proc, grace)
    print(f"\njob.yaml (resnet50 bf16, 2 GPUs): SIGTERM -> exit {rc} in {took:.1f} s (grace {grace} s)")
    assert rc == 75, log.read_text()[-4000:]
    assert took < grace / 2, f"checkpoint on SIGTERM took {took:.1f} s of the {grace} s grace period"
    ckpts = sorted((tmp_path / "pvc" / "trainjob-runs" / "trainjob" / "checkpoints").glob("*.pt"))
    stopped_at = int(ckpts[-1].stem.split("_")[1])

    pod2, _ = job_pod(tmp_path, "trainjob-gpu02")
    _, telemetry2 = metrics_port_override()
    log2 = tmp_path / "pod2.log"
    proc2 = start(pod2, "trainer", [f"train.steps={stopped_at + 5}"] + telemetry2, log2)
    assert proc2.wait(timeout=600) == 0, log2.read_text()[-4000:]
    assert f"at step {stopped_at}" in log2.read_text()


@requires_gpus(2)
def test_multinode_container_sigterm_fits_torchrun_limit(tmp_path):
    """The multi-node container (torchrun, LM + AdamW from its ConfigMap) as one node of 2 GPUs:
    the checkpoint after SIGTERM has to beat torchrun's 30 s SIGKILL."""
    docs = load_docs(K8S / "multinode" / "multinode.yaml")
    job = one(docs, "Job")
    template, name = job["spec"]["template"], job["metadata"]["name"]
    meta = {"name": f"{name}-0-gpu", "labels": {"batch.kubernetes.io/job-name": name},
            "annotations": {"batch.kubernetes.io/job-completion-index": "0"}}
    pod = LocalPod(template, docs, tmp_path, meta["name"], meta)
    env = {"NNODES": "1", "GPUS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_HOST": "127.0.0.1"}
    port, telemetry = metrics_port_override()
    log = tmp_path / "node0.log"
    proc = start(pod, "trainer", ["train.steps=100000", "train.log_every=10"] + telemetry, log, env,
                 master_port=free_port())
    wait_for_samples(proc, port, log, minimum=16 * 20)
    rc, took = stop_and_time(proc, TORCHRUN_SIGTERM_TIMEOUT_S + 30)
    ckpts = sorted((tmp_path / "pvc" / "trainjob-mn-runs" / name / "checkpoints").glob("*.pt"))
    print(f"\nmultinode (lm adamw, torchrun, 2 GPUs): SIGTERM -> exit {rc} in {took:.1f} s, "
          f"checkpoints {[p.name for p in ckpts]}")
    assert ckpts, log.read_text()[-4000:]
    assert took < TORCHRUN_SIGTERM_TIMEOUT_S, f"torchrun would have SIGKILLed the checkpoint ({took:.1f} s)"


@requires_gpus(2)
def test_multinode_two_pods_one_gpu_each_over_nccl(tmp_path):
    """The Indexed Job's two pods, one card each (the device plugin's isolation stood in for by
    CUDA_VISIBLE_DEVICES=<host index>), the LM from the multi-node ConfigMap, NCCL between them."""
    docs = load_docs(K8S / "multinode" / "multinode.yaml")
    job = one(docs, "Job")
    template, name = job["spec"]["template"], job["metadata"]["name"]
    port = free_port()
    procs = []
    try:
        for index in range(2):
            meta = {"name": f"{name}-{index}-gpu", "labels": {"batch.kubernetes.io/job-name": name},
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}
            pod = LocalPod(template, docs, tmp_path, meta["name"], meta)
            env = {"NNODES": "2", "GPUS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": str(index),
                   "MASTER_HOST": "127.0.0.1"}
            _, telemetry = metrics_port_override()
            log = tmp_path / f"node{index}.log"
            procs.append((start(pod, "trainer", ["train.steps=20", "train.log_every=5"] + telemetry, log, env,
                                master_port=port), log))
        for proc, log in procs:
            assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "".join(log.read_text() for _, log in procs)
    assert "2 processes x 1 GPU" in logs, logs[-4000:]  # one group across both "nodes"
    assert (tmp_path / "pvc" / "trainjob-mn-runs" / name / "checkpoints" / "step_00000020.pt").is_file()
