"""The contract between k8s/ and the trainer, run for real on CPU.

Each test takes a container's command, args and env from the manifest as a user applies it,
does what the kubelet would (downward-API env, $(VAR) expansion, ConfigMap and volumes mounted;
here: written to and mapped onto temporary folders, see tests/_k8s_helpers.py), appends a small
CPU override (tiny workload, a few steps, small batch, metrics on a free loopback port) and runs
it through the project's entry point. The PVC is a folder shared by the successive "pods".
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests._k8s_helpers import K8S, LocalPod, dockerfile_entrypoint, load_docs, one, pod_templates
from tests._ports import free_port

JOB = K8S / "job.yaml"
# The image's ENTRYPOINT (tests/infra/test_k8s.py pins it to the Dockerfile's once that exists).
ENTRYPOINT = dockerfile_entrypoint() or ["python", "-m", "job"]
CPU_OVERRIDE = ["workload=tiny", "train.batch_size=8", "train.log_every=1"]


def job_pod(root: Path, pod_name: str) -> tuple[LocalPod, dict]:
    docs = load_docs(JOB)
    job = one(docs, "Job")
    template = job["spec"]["template"]
    name = job["metadata"]["name"]
    meta = {
        "name": pod_name,
        # what the Job controller adds to every pod it creates
        "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": name, "job-name": name},
        "annotations": dict(template["metadata"].get("annotations", {})),
    }
    return LocalPod(template, docs, root, pod_name, meta), job


def start(pod: LocalPod, container: str, extra: list[str], log: Path, env_overrides=None,
          entrypoint=ENTRYPOINT, master_port: int | None = None) -> subprocess.Popen:
    argv, env = pod.command(container, entrypoint, env_overrides)
    if any(a.startswith("telemetry.port=") for a in argv) and not any(a.startswith("telemetry.port=") for a in extra):
        extra = [*extra, *metrics_port_override()[1]]  # the pod's 0.0.0.0:9401 is this host's: loopback, free port
    if master_port:  # a free port instead of the manifest's fixed 29500 (other tests run alongside)
        assert "--master-port=29500" in argv
        argv = [f"--master-port={master_port}" if a == "--master-port=29500" else a for a in argv]
    with log.open("w") as out:
        return subprocess.Popen(argv + extra, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=pod.root)


def metrics_port_override() -> tuple[int, list[str]]:
    port = free_port()
    return port, [f"telemetry.port={port}", "telemetry.host=127.0.0.1"]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.read().decode()


def test_sigterm_checkpoints_in_grace_and_next_pod_resumes(tmp_path):
    """Mid-run SIGTERM: checkpoint and exit 75 well inside the grace period; the Job's next pod
    (same run id, same PVC) resumes from that checkpoint, trains to the end and exits 0."""
    pod, job = job_pod(tmp_path, "trainjob-bbbbb")
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    port, telemetry = metrics_port_override()
    log = tmp_path / "pod1.log"
    proc = start(pod, "trainer", CPU_OVERRIDE + ["train.steps=100000"] + telemetry, log)
    try:
        # mid-run: wait until the metrics port the PodMonitor scrapes reports trained samples
        deadline, samples = time.monotonic() + 90, 0.0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                m = re.search(r"^trainjob_samples_total(?:\{[^}]*\})? (\S+)$", scrape(port), re.M)
                samples = float(m.group(1)) if m else 0.0
            except OSError:
                samples = 0.0
            if samples >= 16:
                break
            time.sleep(0.2)
        assert samples >= 16, f"no training progress on the metrics port:\n{log.read_text()}"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends on eviction/preemption/delete
        rc = proc.wait(timeout=grace)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    print(f"\njob.yaml container on CPU: SIGTERM -> exit {rc} in {took:.2f} s (grace {grace} s)")
    assert rc == 75, text
    # well inside the grace period: the kubelet would SIGKILL at `grace`
    assert took < grace / 4, f"SIGTERM -> exit took {took:.1f} s, grace is {grace} s"
    ckpts = sorted((tmp_path / "pvc" / "trainjob-runs" / job["metadata"]["name"] / "checkpoints").glob("*.pt"))
    assert ckpts, text
    stopped_at = int(ckpts[-1].stem.split("_")[1])
    assert 2 <= stopped_at < 100000
    # the ConfigMap's checkpoint_every (200) did not write it: the SIGTERM did
    assert stopped_at < 200

    # the Job's next pod: same Job name, same PVC, a fresh pod (new emptyDirs, new name)
    pod2, _ = job_pod(tmp_path, "trainjob-ccccc")
    log2 = tmp_path / "pod2.log"
    _, telemetry2 = metrics_port_override()
    proc2 = start(pod2, "trainer", CPU_OVERRIDE + [f"train.steps={stopped_at + 3}"] + telemetry2, log2)
    # it trains to the end and exits 0 (the Job succeeds)
    assert proc2.wait(timeout=120) == 0, log2.read_text()
    text2 = log2.read_text()
    assert f"at step {stopped_at}" in text2 and "resumed from" in text2, text2
    steps = [int(s) for s in re.findall(r"^step (\d+)/", text2, re.M)]
    assert steps == [stopped_at + 1, stopped_at + 2, stopped_at + 3], text2
    # runs/<run id> on the PVC, the run id being the Job's name: the layout the trainer promises
    run = tmp_path / "pvc" / "trainjob-runs" / job["metadata"]["name"]
    assert (run / "checkpoints" / f"step_{stopped_at + 3:08d}.pt").is_file(), sorted(run.rglob("*"))
    assert (run / "summary.json").is_file() and (run / "metrics.jsonl").is_file()
    # the run used the ConfigMap (amp: bf16 comes only from there) and the STRATEGY env
    config = (run / "config.yaml").read_text()
    assert re.search(r"^\s+amp: bf16$", config, re.M) and re.search(r"^\s+name: ddp$", config, re.M), config


def test_config_error_exits_2_for_the_failure_policy(tmp_path):
    """The FailJob rule's exit code, from the same command line with a misspelt key."""
    pod, job = job_pod(tmp_path, "trainjob-ddddd")
    log = tmp_path / "pod.log"
    proc = start(pod, "trainer", ["train.stepz=3"], log)
    assert proc.wait(timeout=60) == 2
    text = log.read_text()
    assert text.startswith("error: unknown key `train.stepz`") and "Traceback" not in text
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]


# ---------------------------------------------------------------- multi-node, two "pods" on loopback


def multinode_pods(which: str, root: Path, port: int):
    """(LocalPod, container name, env overrides, entrypoint) for each node of a 2-node run."""
    if which == "indexed-job":
        docs = load_docs(K8S / "multinode" / "multinode.yaml")
        job = one(docs, "Job")
        template, name = job["spec"]["template"], job["metadata"]["name"]
        out = []
        for index in range(job["spec"]["completions"]):
            meta = {"name": f"{name}-{index}-xxxxx",
                    "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": name},
                    "annotations": {**template["metadata"]["annotations"],
                                    "batch.kubernetes.io/job-completion-index": str(index)}}
            # on CPU: one process per "node"; pod 0's DNS name is loopback here
            env = {"GPUS_PER_NODE": "1", "MASTER_HOST": "127.0.0.1"}
            out.append((LocalPod(template, docs, root, meta["name"], meta), "trainer", env))
        return out, name
    docs = load_docs(K8S / "pytorchjob" / "pytorchjob.yaml")
    ptj = one(docs, "PyTorchJob")
    name = ptj["metadata"]["name"]
    out = []
    for rank, (rtype, template) in enumerate(
            [(w.split("/")[-1], t) for w, t in pod_templates(ptj)]):
        meta = {"name": f"{name}-{rtype.lower()}-0",
                "labels": {**template["metadata"]["labels"], "training.kubeflow.org/job-name": name,
                           "training.kubeflow.org/replica-type": rtype.lower()},
                "annotations": dict(template["metadata"]["annotations"])}
        # what the Training Operator sets (pkg/controller.v1/pytorch/envvar.go, master.go)
        env = {"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
        out.append((LocalPod(template, docs, root, meta["name"], meta), "pytorch", env))
    return out, name


@pytest.mark.slow
@pytest.mark.parametrize("which", ["indexed-job", "pytorchjob"])
def test_multinode_two_pods_train_together(tmp_path, which):
    port = free_port()
    pods, name = multinode_pods(which, tmp_path, port)
    procs = []
    try:
        # (the init containers' config check is run in tests/infra/test_k8s.py)
        for i, (pod, container, env) in enumerate(pods):
            _, telemetry = metrics_port_override()
            extra = CPU_OVERRIDE + ["train.steps=3"] + telemetry
            log = tmp_path / f"node{i}.log"
            procs.append((start(pod, container, extra, log, env,
                                master_port=port if which == "indexed-job" else None), log))
        for proc, log in procs:
            assert proc.wait(timeout=180) == 0, log.read_text()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run = tmp_path / "pvc" / one(load_docs(K8S / ("multinode/multinode.yaml" if which == "indexed-job"
                                                  else "pytorchjob/pytorchjob.yaml")),
                                 "PersistentVolumeClaim")["metadata"]["name"] / name
    assert (run / "checkpoints" / "step_00000003.pt").is_file(), sorted(run.rglob("*"))
    logs = "".join(log.read_text() for _, log in procs)
    assert "on CPU x 2 process(es)" in logs, logs  # one group over both "nodes"


# torchrun SIGKILLs its workers this long after forwarding SIGTERM (torch's PContext.close default).
TORCHRUN_SIGTERM_TIMEOUT_S = 30


def test_multinode_sigterm_under_torchrun(tmp_path):
    """One multi-node pod (its launcher `python -m job.torchrun`, 2 CPU ranks) gets SIGTERM: the ranks
    checkpoint well inside torchrun's 30 s, and the container exits 75, which the Indexed Job's
    podFailurePolicy ignores (new pods resume). Plain torchrun would exit 1 with a SignalException."""
    docs = load_docs(K8S / "multinode" / "multinode.yaml")
    job = one(docs, "Job")
    template, name = job["spec"]["template"], job["metadata"]["name"]
    meta = {"name": f"{name}-0-sig", "labels": {"batch.kubernetes.io/job-name": name},
            "annotations": {"batch.kubernetes.io/job-completion-index": "0"}}
    pod = LocalPod(template, docs, tmp_path, meta["name"], meta)
    env = {"NNODES": "1", "GPUS_PER_NODE": "2", "MASTER_HOST": "127.0.0.1"}
    log = tmp_path / "node0.log"
    _, telemetry = metrics_port_override()  # never the fixed 9401 on this host: loopback, a free port
    proc = start(pod, "trainer", CPU_OVERRIDE + ["train.steps=100000"] + telemetry, log, env,
                 master_port=free_port())
    try:
        deadline = time.monotonic() + 120
        while "step 2/" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "step 2/" in log.read_text(), log.read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=TORCHRUN_SIGTERM_TIMEOUT_S + 30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    print(f"\nmulti-node container on CPU (job.torchrun, 2 ranks): SIGTERM -> exit {rc} in {took:.2f} s")
    assert rc == 75 and "Traceback" not in text, text[-3000:]
    assert "job.torchrun: torchrun stopped by SIGTERM; local workers' exit codes {0: 75, 1: 75} of 2: exit 75" in text
    from tests._k8s_helpers import pod_failure_action

    assert pod_failure_action(job, {"check-config": 0, "trainer": rc}) == "Ignore", "the Job makes new pods"
    assert took < TORCHRUN_SIGTERM_TIMEOUT_S
    ckpts = sorted((tmp_path / "pvc" / "trainjob-mn-runs" / name / "checkpoints").glob("*.pt"))
    assert ckpts and int(ckpts[-1].stem.split("_")[1]) >= 2, text[-3000:]
