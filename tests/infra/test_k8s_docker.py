"""job.yaml's pod, run in the real image with the pod's restrictions, on a real container engine.

The CPU contract test (test_k8s_contract.py) runs the command line with the checkout's Python;
this one runs it where a cluster would: in the image built from the Dockerfile, as the pod's
securityContext says (uid/gid from runAsUser/runAsGroup/fsGroup, read-only root filesystem, all
capabilities dropped, no-new-privileges), with only the pod's volumes writable (ConfigMap read-only,
the PVC as a host folder owned by fsGroup, emptyDirs as tmpfs) and the pod's env and args as
Kubernetes expands them. `docker stop -t <terminationGracePeriodSeconds>` is what the kubelet does:
SIGTERM, then SIGKILL when the grace period runs out. Network: none (the trainer's metrics port
binds inside the container's own namespace; no traffic leaves it).

The engine and the stand-in base image come from tests/infra/test_docker.py's fixtures (their own dockerd
with a cached data root; no registry is reachable here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._k8s_helpers import ROOT, LocalPod, all_containers, container_env, expand, one, render
from tests.conftest import IN_CI
from tests.infra.test_docker import engine, standin, users_project  # noqa: F401  (module-scoped fixtures, reused)
from tests.infra.test_k8s_contract import CPU_OVERRIDE, job_pod

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def dockerd_on(data_root: str) -> list[str]:
    """Running dockerd processes that use `data_root` (two engines on one data root corrupt it)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"dockerd") and data_root.encode() in argv:
            found.append(proc.name)
    return found


@pytest.fixture(scope="module")
def docker_image(request):
    """(engine, tag): the Dockerfile built on the stand-in base (layers cached from test_docker)."""
    root = os.environ.get("TRAINJOB_DOCKER_ROOT", "/var/tmp/trainjob-docker")
    busy = dockerd_on(root)
    if busy and not IN_CI:  # a developer's other test run holds the engine's data root right now
        pytest.skip(f"dockerd {busy} already uses {root}; run again when it has stopped")
    eng = request.getfixturevalue("engine")
    base, _ = request.getfixturevalue("standin")
    tag = "trainjob:k8s-ci"
    t0 = time.monotonic()
    eng.run("build", "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1", "-t", tag,
               str(ROOT), timeout=900)
    print(f"image {tag} built in {time.monotonic() - t0:.0f} s")
    return eng, tag


def docker_run_args(pod, container: dict) -> list[str]:
    """`docker run` options that give the container what the pod spec gives it."""
    spec = pod.template["spec"]
    psc, sc = spec.get("securityContext", {}), container.get("securityContext", {})
    uid, gid, fs_group = psc["runAsUser"], psc["runAsGroup"], psc.get("fsGroup")
    args = ["--network", "none", "--user", f"{uid}:{gid}", "--ipc", "none"]
    if fs_group is not None:
        args += ["--group-add", str(fs_group)]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("capabilities", {}).get("drop") == ["ALL"]:
        args += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in container.get("volumeMounts", []):
        vol, local = volumes[m["name"]], pod.volume_dirs[m["name"]]
        if "emptyDir" in vol:  # an emptyDir is empty, writable by anyone (0777), and per pod
            size = vol["emptyDir"].get("sizeLimit", "")
            opts = "mode=1777" + (f",size={size[:-1]}" if size.endswith("i") else "")
            args += ["--tmpfs", f"{m['mountPath']}:{opts}"]
        elif "persistentVolumeClaim" in vol and m.get("readOnly"):  # data: mounted as it is, read-only
            args += ["-v", f"{local}:{m['mountPath']}:ro"]
        elif "persistentVolumeClaim" in vol:  # the kubelet chowns the volume to fsGroup, setgid
            os.chown(local, 0, fs_group if fs_group is not None else gid)
            local.chmod(0o2775)
            args += ["-v", f"{local}:{m['mountPath']}"]
        else:
            args += ["-v", f"{local}:{m['mountPath']}:{'ro' if m.get('readOnly') else 'rw'}"]
    for key, value in container_env(container, pod.meta).items():
        args += ["-e", f"{key}={value}"]
    return args


def pod_command(pod, container: dict) -> list[str]:
    """The args after expansion (no command: the image's ENTRYPOINT runs, as in the pod)."""
    env = container_env(container, pod.meta)
    assert "command" not in container
    return [expand(a, env) for a in container["args"]]


def test_job_pod_in_the_image_checkpoints_on_stop_and_resumes(docker_image, tmp_path):
    eng, image = docker_image
    pod, job = job_pod(tmp_path, "trainjob-docker1")
    container = next(c for c in all_containers(pod.template) if c["name"] == "trainer")
    grace = pod.template["spec"]["terminationGracePeriodSeconds"]
    name = f"k8s-pod-{os.getpid()}"
    run_args = docker_run_args(pod, container)
    argv = pod_command(pod, container)
    eng.run("rm", "-f", name, check=False)
    try:
        eng.run("run", "-d", "--name", name, *run_args, image, *argv, *CPU_OVERRIDE, "train.steps=100000")
        deadline, logs = time.monotonic() + 180, ""
        while time.monotonic() < deadline:
            out = eng.run("logs", name, check=False)
            logs = out.stdout + out.stderr
            if re.search(r"^step [2-9]\d*/", logs, re.M):
                break
            state = eng.run("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert state == "true", f"the pod's container stopped early:\n{logs}"
            time.sleep(0.5)
        assert re.search(r"^step [2-9]\d*/", logs, re.M), logs
        t0 = time.monotonic()
        eng.run("stop", "-t", str(grace), name, timeout=grace + 30)  # SIGTERM, SIGKILL after grace
        took = time.monotonic() - t0
        code = eng.run("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        out = eng.run("logs", name, check=False)
        logs = out.stdout + out.stderr
    finally:
        eng.run("rm", "-f", name, check=False)
    print(f"\njob.yaml pod in the image: docker stop -> exit {code} in {took:.2f} s (grace {grace} s)")
    assert code == "75", logs
    assert took < grace / 4, logs
    pvc = pod.volume_dirs["runs"]
    ckpts = sorted((pvc / job["metadata"]["name"] / "checkpoints").glob("*.pt"))
    assert ckpts, logs
    stopped_at = int(ckpts[-1].stem.split("_")[1])
    assert ckpts[-1].stat().st_uid == pod.template["spec"]["securityContext"]["runAsUser"]

    # the Job's next pod: fresh emptyDirs, the same PVC
    pod2, _ = job_pod(tmp_path, "trainjob-docker2")
    rerun = eng.run("run", "--rm", *docker_run_args(pod2, container), image, *pod_command(pod2, container),
                       *CPU_OVERRIDE, f"train.steps={stopped_at + 2}", check=False, timeout=300)
    text = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, text
    assert f"at step {stopped_at}" in text and "resumed from" in text, text
    assert re.findall(r"^step (\d+)/", text, re.M) == [str(stopped_at + 1), str(stopped_at + 2)], text


def test_read_only_root_is_really_read_only(docker_image, tmp_path):
    """The test above can fail: with the same options, writing outside the mounts is refused."""
    eng, image = docker_image
    pod, _ = job_pod(tmp_path, "trainjob-docker3")
    container = next(c for c in all_containers(pod.template) if c["name"] == "trainer")
    args = docker_run_args(pod, container)
    probe = eng.run("run", "--rm", *args, "--entrypoint", "python", image, "-c",
                       "import os, pathlib\n"
                       "for p in ('/workspace/x', '/opt/trainjob/x', '/runs/x', '/tmp/x', '/dev/shm/x'):\n"
                       "    try:\n"
                       "        pathlib.Path(p).write_text('x'); print(p, 'ok')\n"
                       "    except OSError as e:\n"
                       "        print(p, 'refused', e.errno)\n"
                       "print('uid', os.getuid(), 'gid', os.getgid())",
                       check=False, timeout=120)
    lines = dict(line.split(" ", 1) for line in probe.stdout.splitlines())
    assert lines["/workspace/x"].startswith("refused") and lines["/opt/trainjob/x"].startswith("refused"), probe
    assert lines["/runs/x"] == "ok" and lines["/tmp/x"] == "ok" and lines["/dev/shm/x"] == "ok", probe
    sc = pod.template["spec"]["securityContext"]
    assert lines["uid"] == f"{sc['runAsUser']} gid {sc['runAsGroup']}", probe


@pytest.fixture(scope="module")
def user_image(docker_image, tmp_path_factory):
    """(engine, tag): examples/tabular's image (its Dockerfile: FROM ours + its code + one extra package)."""
    eng, base = docker_image
    proj = users_project(tmp_path_factory.mktemp("user"))
    tag = "tabular:k8s-ci"
    eng.run("build", "--build-arg", f"TRAINJOB_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1", "-t", tag, str(proj),
            timeout=900)
    yield eng, tag
    eng.run("rmi", "-f", tag, check=False)


def test_users_job_pod_runs_their_image_on_their_read_only_data(user_image, tmp_path):
    """examples/tabular/k8s rendered (the user's image, k8s/data, the workload in the ConfigMap), its pod run
    in the user's image with the pod's restrictions: the ConfigMap's workload trains on the CSV of the
    read-only data volume, validates, writes its checkpoint to the runs volume as uid 10001 and exits 0."""
    eng, image = user_image
    docs = render(ROOT / "examples" / "tabular" / "k8s")
    job = one(docs, "Job", "trainjob")
    template, name = job["spec"]["template"], job["metadata"]["name"]
    meta = {"name": "trainjob-user1", "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": name},
            "annotations": dict(template["metadata"].get("annotations", {}))}
    pod = LocalPod(template, docs, tmp_path, meta["name"], meta)
    container = next(c for c in all_containers(template) if c["name"] == "trainer")
    data = pod.volume_dirs["data"]
    subprocess.run([sys.executable, str(ROOT / "examples" / "tabular" / "make_data.py"),
                    str(data / "tab.csv"), "600"], check=True, capture_output=True, timeout=60)
    data.chmod(0o755)
    (data / "tab.csv").chmod(0o644)
    run = eng.run("run", "--rm", *docker_run_args(pod, container), image, *pod_command(pod, container),
                  "train.steps=30", "train.batch_size=64", "train.log_every=10", check=False, timeout=300)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "step 30/30" in text and "validation: loss" in text, text[-3000:]
    assert "per-card memory: ddp, task:workload, global batch 64, 30 steps (run trainjob)" in text, text[-3000:]
    ckpt = pod.volume_dirs["runs"] / name / "checkpoints" / "step_00000030.pt"
    assert ckpt.is_file() and ckpt.stat().st_uid == template["spec"]["securityContext"]["runAsUser"]
    assert sorted(p.name for p in data.iterdir()) == ["tab.csv"], "nothing was written to the data volume"
