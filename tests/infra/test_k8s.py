"""k8s/: renders, passes the API schemas strictly, and says what the project's contracts say.

No API server runs here, so every check is offline: `kubectl kustomize` renders,
kubernetes-validate --strict checks built-in objects against the oldest and newest supported
Kubernetes schemas, the CRD objects go through their operators' published models (a round-trip
diff catches unknown keys), and the rest are the semantic rules an API server or controller
would enforce later, at the worst time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests._k8s_helpers import (
    DNS_1123_LABEL,
    K8S,
    K8S_VERSIONS,
    QUANTITY,
    ROOT,
    all_containers,
    group,
    is_builtin,
    load_docs,
    one,
    pod_templates,
    references,
    render,
    roundtrip_kubeflow,
    roundtrip_prometheus_operator,
)

JOB = K8S / "job.yaml"
MULTINODE = K8S / "multinode" / "multinode.yaml"
PYTORCHJOB = K8S / "pytorchjob" / "pytorchjob.yaml"
MANIFESTS = [JOB, MULTINODE, PYTORCHJOB]
METRICS_PORT = 9401
EXPORTER_PORT = 9400
# Volume kinds the PodSecurity "restricted" profile allows.
PSA_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                          "projected", "secret"}
TRAINER_LABELS = {"app.kubernetes.io/name": "trainjob", "app.kubernetes.io/component": "trainer"}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render(K8S)


@pytest.fixture(scope="module")
def rendered_with_exporter(tmp_path_factory) -> list[dict]:
    """k8s plus the optional exporter component, as a user's overlay would enable it."""
    overlay = tmp_path_factory.mktemp("overlay")
    rel = os.path.relpath(K8S, overlay)
    (overlay / "kustomization.yaml").write_text(
        f"resources:\n  - {rel}\ncomponents:\n  - {rel}/exporter\n  - {rel}/image\n"
    )
    return render(overlay)


def without_images(doc: dict) -> dict:
    """The object with every container image blanked (the k8s/image component rewrites them) and no
    namespace (the kustomizations set one; the plain files do not)."""
    doc = json.loads(json.dumps(doc))
    doc["metadata"].pop("namespace", None)
    for _, template in pod_templates(doc):
        for c in all_containers(template):
            c["image"] = ""
    return doc


def every_doc(rendered_with_exporter) -> list[tuple[str, dict]]:
    docs = [("kubectl kustomize k8s (+exporter)", d) for d in rendered_with_exporter]
    for path in MANIFESTS[1:]:
        docs += [(str(path.relative_to(ROOT)), d) for d in load_docs(path)]
    return docs


# ---------------------------------------------------------------- render + schemas


def test_kustomization_renders_job_and_monitoring(rendered):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    assert ("Job", "trainjob") in kinds and ("PodMonitor", "trainjob") in kinds
    assert ("ConfigMap", "trainjob-config") in kinds and ("PersistentVolumeClaim", "trainjob-runs") in kinds
    # job.yaml is applied as is, and the kustomization renders exactly the same objects from it
    for doc in load_docs(JOB):
        assert without_images(one(rendered, doc["kind"], doc["metadata"]["name"])) == without_images(doc)
    # never silently in `default`: the kustomization puts everything in its own namespace, which it
    # creates with PodSecurity admission enforcing "restricted"; the plain files stay namespace-free (-n)
    ns = one(rendered, "Namespace")
    assert all(d["metadata"].get("namespace") == ns["metadata"]["name"] != "default"
               for d in rendered if d["kind"] != "Namespace")
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"
    assert all("namespace" not in d["metadata"] for p in MANIFESTS for d in load_docs(p))


@pytest.mark.parametrize("path", [MULTINODE, PYTORCHJOB], ids=["multinode", "pytorchjob"])
def test_multinode_kustomizations_add_only_monitoring(path, rendered):
    """`kubectl apply -k k8s/<variant>` = the variant's file as is + the monitoring objects."""
    out = render(path.parent)
    monitoring = [d for d in rendered if d["apiVersion"].startswith("monitoring.coreos.com/")
                  or d["metadata"].get("labels", {}).get("grafana_dashboard")]
    raw = load_docs(path)
    assert len(out) == len(raw) + len(monitoring) + 1  # + the Namespace
    assert one(out, "Namespace") == one(rendered, "Namespace")
    for doc in raw + monitoring:
        assert without_images(one(out, doc["kind"], doc["metadata"]["name"])) == without_images(doc)


def test_exporter_component_is_optional(rendered, rendered_with_exporter):
    assert not [d for d in rendered if d["kind"] == "DaemonSet"]
    ds = one(rendered_with_exporter, "DaemonSet", "trainjob-exporter")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "export"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), "the exporter must not take a card"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"exporter": EXPORTER_PORT}
    assert f"--port={EXPORTER_PORT}" in c["args"] and "--host=0.0.0.0" in c["args"]
    pm = one(rendered_with_exporter, "PodMonitor", "trainjob-exporter")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "exporter"


def validate_strict(docs: list[dict], path: Path, version: str) -> None:
    """kubernetes-validate --strict (unknown fields rejected) on the built-in objects of `docs`, and on the pod
    templates inside any PyTorchJob (as PodTemplate objects: the same PodSpec schema)."""
    builtin = [d for d in docs if is_builtin(d)]
    for d in docs:
        if d["kind"] == "PyTorchJob":
            for where, template in pod_templates(d):
                builtin.append({"apiVersion": "v1", "kind": "PodTemplate",
                                "metadata": {"name": where.split("/")[-1].lower()}, "template": template})
    path.write_text(yaml.safe_dump_all(builtin))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(exe), "--strict", "--quiet", "-k", version, str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_pass_strict_schemas(rendered_with_exporter, tmp_path, version):
    """kubernetes-validate --strict on every built-in object, and on the PyTorchJob's pod templates."""
    docs = [d for _, d in every_doc(rendered_with_exporter)]
    assert len([d for d in docs if is_builtin(d)]) + 2 >= 12
    validate_strict(docs, tmp_path / "builtin.yaml", version)


def test_strict_schema_rejects_an_unknown_field(tmp_path):
    """The schema check above can fail: a misspelt field in the Job is refused."""
    job = one(load_docs(JOB), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(job))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(exe), "--strict", "-k", K8S_VERSIONS[-1], str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "readOnlyRootFilesytem" in out.stdout + out.stderr


def test_crd_objects_roundtrip_through_their_models(rendered_with_exporter):
    crds = [(w, d) for w, d in every_doc(rendered_with_exporter) if not is_builtin(d)]
    kinds = {d["kind"] for _, d in crds}
    assert {"PodMonitor", "PyTorchJob"} <= kinds
    for where, doc in crds:
        if group(doc) == "monitoring.coreos.com":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            problems = roundtrip_prometheus_operator(doc)
        elif group(doc) == "kubeflow.org":
            assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
            problems = roundtrip_kubeflow(doc)
        else:
            raise AssertionError(f"{where}: no model for {doc['apiVersion']}")
        assert not problems, f"{where} {doc['kind']}/{doc['metadata']['name']}: {problems}"


def test_roundtrip_catches_unknown_keys():
    pm = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    pm["spec"]["podMetricsEndpoints"][0]["scrapeIntervall"] = "15s"
    assert roundtrip_prometheus_operator(pm) == [
        ".spec.podMetricsEndpoints[0].scrapeIntervall: unknown to the schema (dropped by the model)"
    ]
    # the models carry the CRDs' enums and patterns too
    pm = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "replaced"
    with pytest.raises(ValueError, match="relabelings.0.action"):
        roundtrip_prometheus_operator(pm)
    rule = yaml.safe_load(next((K8S / "monitoring" / "rules").glob("*.yaml")).read_text())
    alerting = next(r for g in rule["spec"]["groups"] for r in g["rules"] if "for" in r)
    alerting["for"] = "5 minutes"
    with pytest.raises(ValueError, match="string_pattern_mismatch"):
        roundtrip_prometheus_operator(rule)
    ptj = one(load_docs(PYTORCHJOB), "PyTorchJob")
    ptj["spec"]["runPolicy"]["backofLimit"] = 3
    assert ".spec.runPolicy.backofLimit: unknown to the schema (dropped by the model)" in roundtrip_kubeflow(ptj)


# ---------------------------------------------------------------- semantics an API server checks later


def test_names_quantities_ports_and_references(rendered_with_exporter):
    check_names_quantities_ports_and_references(every_doc(rendered_with_exporter))


def check_names_quantities_ports_and_references(docs: list[tuple[str, dict]]) -> None:
    for where, d in docs:
        name = d["metadata"]["name"]
        assert DNS_1123_LABEL.match(name) and len(name) <= 63, f"{where}: bad name {name}"
    for where, d in docs:
        for tw, template in pod_templates(d):
            spec = template["spec"]
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            siblings = [x for w, x in docs if w == where]
            for v in volumes.values():
                if "configMap" in v:
                    one(siblings, "ConfigMap", v["configMap"]["name"])
                if "persistentVolumeClaim" in v:
                    one(siblings, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
                size = v.get("emptyDir", {}).get("sizeLimit")
                assert size is None or QUANTITY.match(str(size)), f"{tw}: sizeLimit {size}"
            for c in all_containers(template):
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, f"{tw}/{c['name']}: mount of unknown volume {m['name']}"
                for p in c.get("ports", []):
                    assert len(p["name"]) <= 15 and DNS_1123_LABEL.match(p["name"]), p
                for kind in ("requests", "limits"):
                    for res, q in c.get("resources", {}).get(kind, {}).items():
                        assert QUANTITY.match(str(q)), f"{tw}/{c['name']}: {kind}.{res}={q!r}"
                defined = {e["name"] for e in c.get("env", [])}
                for arg in c.get("command", []) + c.get("args", []):
                    missing = references(arg) - defined
                    assert not missing, f"{tw}/{c['name']}: `{arg}` refers to undefined env {missing}"
        if d["kind"] == "PersistentVolumeClaim":
            assert QUANTITY.match(d["spec"]["resources"]["requests"]["storage"])


def test_security_context_is_restricted(rendered_with_exporter):
    check_restricted(every_doc(rendered_with_exporter))


def check_restricted(docs: list[tuple[str, dict]]) -> None:
    for _where, d in docs:
        for tw, template in pod_templates(d):
            spec = template["spec"]
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, tw
            assert psc["seccompProfile"]["type"] == "RuntimeDefault", tw
            assert spec.get("automountServiceAccountToken") is False, tw
            # the PodSecurity "restricted" profile's pod-level rules
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), tw
            for v in spec.get("volumes", []):
                kinds = set(v) - {"name"}
                assert kinds <= PSA_RESTRICTED_VOLUMES, f"{tw}: volume {v['name']} of kind {kinds}"
            for c in all_containers(template):
                assert not any("hostPort" in p for p in c.get("ports", [])), f"{tw}/{c['name']}"
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, f"{tw}/{c['name']}"
                assert sc.get("privileged", False) is False, f"{tw}/{c['name']}"
                assert sc["readOnlyRootFilesystem"] is True, f"{tw}/{c['name']}"
                assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), tw
                # a read-only root: everything the process writes must be a writable mount
                writable = [m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")]
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                for key in ("HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                    if env.get(key):
                        assert any(env[key] == w or env[key].startswith(w + "/") for w in writable), (
                            f"{tw}/{c['name']}: {key}={env[key]} is not on a writable mount {writable}"
                        )
                for arg in c.get("args", []):
                    if arg.startswith("train.run_dir=") and c in spec["containers"]:  # not the config check
                        assert arg.split("=", 1)[1] in writable, f"{tw}: run_dir is not a writable mount"


def trainer_containers(docs) -> list[tuple[str, dict, dict]]:
    out = []
    for _where, d in docs:
        for tw, template in pod_templates(d):
            for c in template["spec"]["containers"]:
                if "train" in c.get("args", []):
                    out.append((tw, template, c))
    return out


def test_trainer_pods_gpus_ports_and_run_id(rendered_with_exporter):
    trainers = trainer_containers(every_doc(rendered_with_exporter))
    assert {tw.split("/")[0] for tw, _, _ in trainers} == {"Job", "PyTorchJob"}
    assert len(trainers) == 4  # job.yaml, multinode, PyTorchJob Master + Worker
    for tw, template, c in trainers:
        env = {e["name"]: e for e in c["env"]}
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        gpus = int(limits["nvidia.com/gpu"])
        assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"], tw
        # inside the pod the granted cards count from 0
        assert env["CUDA_VISIBLE_DEVICES"]["value"] == ",".join(str(i) for i in range(gpus)), tw
        assert env["CUDA_DEVICE_ORDER"]["value"] == "PCI_BUS_ID", tw
        # metrics: the port the trainer serves is the named, annotated one
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == METRICS_PORT, tw
        assert f"telemetry.port={METRICS_PORT}" in c["args"] and "telemetry.host=0.0.0.0" in c["args"], tw
        ann = template["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(METRICS_PORT), tw
        assert TRAINER_LABELS.items() <= template["metadata"]["labels"].items(), tw
        # a stable run id: the controller's job-name label, so a new pod resumes the same run
        assert "train.run_id=$(JOB_NAME)" in c["args"], tw
        label = env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        expected = "training.kubeflow.org/job-name" if tw.startswith("PyTorchJob") else "batch.kubernetes.io/job-name"
        assert label == f"metadata.labels['{expected}']", tw
        # /dev/shm sized for DataLoader workers
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory" and volumes[shm["name"]]["emptyDir"]["sizeLimit"]
        assert template["spec"]["terminationGracePeriodSeconds"] >= 60, tw
        # multi-node: torchrun's process count follows the card count
        if "GPUS_PER_NODE" in env:
            assert env["GPUS_PER_NODE"]["value"] == str(gpus), tw
        if tw.startswith("PyTorchJob"):
            assert c["name"] == "pytorch"


def test_podmonitor_selects_every_trainer_pod(rendered, rendered_with_exporter):
    pm = one(rendered, "PodMonitor", "trainjob")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = pm["spec"]["selector"]["matchLabels"]
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    for tw, template, c in trainer_containers(every_doc(rendered_with_exporter)):
        assert selector.items() <= template["metadata"]["labels"].items(), tw
        assert port in {p["name"] for p in c["ports"]}, tw
    # job="trainjob", as in the compose/bare-metal Prometheus, so rules and dashboards match
    assert pm["spec"]["jobLabel"] == "app.kubernetes.io/name" and selector["app.kubernetes.io/name"] == "trainjob"


# What each exit code does, per workload (docs/kubernetes.md, "Exit codes"). Keys: (container exit codes,
# pod conditions); values: the Job controller's action. `trainer` is the main container, `check-config`
# the multi-node config check. 0: done; 2: bad input; 75: interrupted after a checkpoint; else a crash.
JOB_EXITS = {
    (("trainer", 2),): "FailJob",                         # bad input: never retried
    (("trainer", 75),): "Ignore",                         # checkpointed on SIGTERM: next pod resumes, not counted
    (("trainer", 75), "DisruptionTarget"): "Ignore",      # preempted/evicted
    (("trainer", 1),): "Count",                           # crash: retried from the checkpoint, counted
    (("trainer", 137),): "Count",                         # OOM kill / SIGKILL after the grace period
}
MULTINODE_EXITS = {
    (("check-config", 2),): "FailJob",                    # bad input caught before any rank starts
    (("check-config", 0), ("trainer", 75)): "Ignore",     # the group stopped after a checkpoint: new pods resume
    (("check-config", 0), ("trainer", 2)): "FailJob",     # bad input found by the ranks (job.torchrun: 2)
    (("check-config", 0), ("trainer", 1)): "FailJob",     # a rank crashed (job.torchrun: 1): the whole Job ends
    (("check-config", 0), ("trainer", 137)): "FailJob",   # killed (liveness probe, OOM): the whole Job ends
    (("check-config", 0), ("trainer", 143), "DisruptionTarget"): "Ignore",  # preempted: a new pod, not counted
    (("check-config", 1),): "Count",                      # the check itself crashed: retried
}


def test_job_failure_policy_exit_codes():
    """The podFailurePolicy as the API server validates it and as the Job controller applies it."""
    from tests._k8s_helpers import pod_failure_action, pod_failure_policy_problems

    for path, table in ((JOB, JOB_EXITS), (MULTINODE, MULTINODE_EXITS)):
        job = one(load_docs(path), "Job")
        spec = job["spec"]
        assert not pod_failure_policy_problems(job), (path.name, pod_failure_policy_problems(job))
        assert spec["backoffLimit"] >= 1
        # the replacement waits for the old pod's SIGTERM checkpoint to finish (one writer at a time)
        assert spec["podReplacementPolicy"] == "Failed"
        for key, want in table.items():
            codes = dict(k for k in key if isinstance(k, tuple))
            conditions = tuple(k for k in key if isinstance(k, str))
            assert pod_failure_action(job, codes, conditions) == want, (path.name, key)
        # exit 75 (checkpointed on SIGTERM) is never a permanent failure, 0 never matches a rule
        for rule in spec["podFailurePolicy"]["rules"]:
            values = rule.get("onExitCodes", {}).get("values", [])
            assert not (rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "In" and 75 in values)


def test_failure_policy_checks_can_fail():
    """The validator and the simulation above see a broken policy."""
    from tests._k8s_helpers import pod_failure_action, pod_failure_policy_problems

    job = one(load_docs(MULTINODE), "Job")
    job["spec"]["podFailurePolicy"]["rules"][-1]["onExitCodes"]["containerName"] = "trainr"
    assert pod_failure_policy_problems(job) == ["rule 3: no container trainr"]
    assert pod_failure_action(job, {"trainer": 1}) == "Count"  # a crash would no longer end the Job
    job = one(load_docs(JOB), "Job")
    job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] = [0, 2]
    assert "rule 0: 0 with operator In" in pod_failure_policy_problems(job)
    job["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert "podFailurePolicy needs restartPolicy Never" in pod_failure_policy_problems(job)


def test_pytorchjob_exit_codes_end_the_whole_job():
    """Kubeflow's ExitCode policy: 1-127 fail the job (1 when a rank crashed; the config check's 2; 75
    after a checkpoint: re-applied to resume), 128-255 (killed by a signal) restart the pod; cleanPodPolicy Running then deletes the
    pods still running, so one failed node ends them all."""
    ptj = one(load_docs(PYTORCHJOB), "PyTorchJob")
    for rtype, s in ptj["spec"]["pytorchReplicaSpecs"].items():
        assert s["restartPolicy"] == "ExitCode", rtype
    assert ptj["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert ptj["spec"]["runPolicy"]["backoffLimit"] >= 1


def test_deadlines_ttl_and_liveness_probes(tmp_path):
    """Every Job and the PyTorchJob ends after activeDeadlineSeconds and is cleaned up after
    ttlSecondsAfterFinished; trainer pods probe /health leniently (longer than telemetry.stall_s, and
    the startup probe covers the first steps' compile and memory probing); a kustomize patch changes
    the deadline."""
    specs = {"job": one(load_docs(JOB), "Job")["spec"], "multinode": one(load_docs(MULTINODE), "Job")["spec"],
             "pytorchjob": one(load_docs(PYTORCHJOB), "PyTorchJob")["spec"]["runPolicy"]}
    for name, spec in specs.items():
        assert 3600 <= spec["activeDeadlineSeconds"] <= 30 * 86400, name
        assert 3600 <= spec["ttlSecondsAfterFinished"] <= 30 * 86400, name
    for tw, _template, c in trainer_containers([("", d) for p in MANIFESTS for d in load_docs(p)]):
        args = c["args"]
        stall = int(next(a for a in args if a.startswith("telemetry.stall_s=")).split("=")[1])
        assert stall >= 600, tw
        live, start = c["livenessProbe"], c["startupProbe"]
        for probe in (live, start):
            assert probe["httpGet"] == {"path": "/health", "port": "metrics"}, tw
            assert probe["timeoutSeconds"] >= 5, tw
        # the startup probe waits at least 10 min for the metrics server (model build, first compile)
        assert start["periodSeconds"] * start["failureThreshold"] >= 600, tw
        # a stall is only declared by /health itself (after stall_s); the probe then tolerates minutes
        assert live["periodSeconds"] * live["failureThreshold"] >= 180, tw
        assert "initialDelaySeconds" not in live, f"{tw}: the startup probe holds the liveness probe back"
    # configurable through kustomize, as docs/kubernetes.md shows
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = os.path.relpath(K8S, overlay)
    (overlay / "kustomization.yaml").write_text(
        f"resources:\n  - {rel}\n"
        "patches:\n"
        "  - target: {kind: Job, name: trainjob}\n"
        "    patch: |\n"
        "      - {op: replace, path: /spec/activeDeadlineSeconds, value: 7200}\n")
    assert one(render(overlay), "Job", "trainjob")["spec"]["activeDeadlineSeconds"] == 7200


def test_liveness_probe_against_a_hung_rank(tmp_path):
    """The probe's request against job.yaml's trainer (2 CPU ranks): 200 while it trains; rank 1 stopped
    (SIGSTOP), rank 0 waits in the all-reduce and /health answers 503 "stalled" after telemetry.stall_s;
    rank 1 continued, it is healthy again; SIGTERM still checkpoints and exits 75."""
    import signal
    import urllib.error
    import urllib.request

    from tests.infra.test_k8s_contract import CPU_OVERRIDE, job_pod, metrics_port_override, start

    pod, _ = job_pod(tmp_path, "trainjob-live1")
    path = pod.container("trainer")["livenessProbe"]["httpGet"]["path"]
    port, telemetry = metrics_port_override()
    peers = tmp_path / "peers"
    log = tmp_path / "pod.log"
    proc = start(pod, "trainer", CPU_OVERRIDE + ["strategy.nprocs=2", "train.steps=100000", "telemetry.stall_s=2",
                                                  f"telemetry.peer_dir={peers}"] + telemetry, log)

    def health() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
        except OSError:
            return 0, {}

    def wait(pred, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            got = health()
            if pred(*got):
                return got
            time.sleep(0.3)
        raise AssertionError(f"{health()}\n{log.read_text()[-2000:]}")

    rank1 = None
    try:
        wait(lambda code, h: code == 200 and h.get("steps", 0) >= 2, 120)
        (registration,) = peers.glob("trainjob-telemetry-*/local_rank-1.json")  # the job's own folder
        rank1 = json.loads(registration.read_text())["pid"]
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        _, body = wait(lambda code, h: code == 503, 30)
        took = time.monotonic() - t0
        assert body["status"] == "stalled" and body["stall_s"] == 2 and body["seconds_since_step"] > 2, body
        os.kill(rank1, signal.SIGCONT)
        wait(lambda code, h: code == 200, 30)
    finally:
        if rank1:
            os.kill(rank1, signal.SIGCONT)
        proc.terminate()
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    print(f"\nhung rank -> /health 503 after {took:.1f} s (stall_s=2)")
    assert took < 15 and rc == 75, log.read_text()[-2000:]


def test_multinode_indexed_job_and_headless_service():
    docs = load_docs(MULTINODE)
    job, svc, pvc = one(docs, "Job"), one(docs, "Service"), one(docs, "PersistentVolumeClaim")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    env = {e["name"]: e for e in trainer["env"]}
    nnodes = int(env["NNODES"]["value"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nnodes >= 2
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    # pod 0's DNS name through the headless Service, on the port torchrun listens on
    assert env["MASTER_HOST"]["value"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    port = next(a for a in trainer["args"] if a.startswith("--master-port=")).split("=")[1]
    assert svc["spec"]["ports"][0]["port"] == int(port) == svc["spec"]["ports"][0]["targetPort"]
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert "--node-rank=$(NODE_RANK)" in trainer["args"] and "--nnodes=$(NNODES)" in trainer["args"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("path", [MULTINODE, PYTORCHJOB], ids=["multinode", "pytorchjob"])
def test_config_check_runs_the_trainers_args(path):
    """The init container validates exactly the args the trainer gets (after torchrun's `-m job`)."""
    for d in load_docs(path):
        for tw, template in pod_templates(d):
            init = one([{"kind": "C", "metadata": {"name": c["name"]}, **c}
                        for c in template["spec"]["initContainers"]], "C", "check-config")
            trainer = template["spec"]["containers"][0]
            args = trainer["args"]
            after = args[args.index("-m") + 2:]
            assert args[args.index("-m") + 1] == "job"
            assert init["args"] == after, tw
            init_env = {e["name"]: e for e in init["env"]}
            trainer_env = {e["name"]: e for e in trainer["env"]}
            assert init_env["JOB_NAME"] == trainer_env["JOB_NAME"], tw
            assert init["image"] == trainer["image"], tw
            assert [m for m in init["volumeMounts"] if m["name"] == "config"] == [
                m for m in trainer["volumeMounts"] if m["name"] == "config"]


def test_pytorchjob_shape():
    ptj = one(load_docs(PYTORCHJOB), "PyTorchJob")
    specs = ptj["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    for s in specs.values():
        assert s["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        assert s["template"]["metadata"]["labels"].items() >= TRAINER_LABELS.items()
        c = s["template"]["spec"]["containers"][0]
        # the operator finds the master port by this name
        assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in c["ports"]
        assert ptj["spec"]["nprocPerNode"] == c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["command"] == ["python", "-m", "job.torchrun"]
    assert ptj["spec"]["runPolicy"]["cleanPodPolicy"] in ("All", "Running", "None")


@pytest.mark.parametrize("path", [MULTINODE, PYTORCHJOB], ids=["multinode", "pytorchjob"])
def test_check_config_init_container_runs(tmp_path, path):
    """The init container, run as the kubelet would (its ConfigMap mounted, $(VARs) expanded):
    exit 0 on the manifest's config; exit 2 and one `error:` line on a misspelt key."""
    from tests._k8s_helpers import LocalPod

    docs = load_docs(path)
    where, template = next(t for d in docs for t in pod_templates(d))
    name = "trainjob-x"
    meta = {"name": "pod", "annotations": {},
            "labels": {"batch.kubernetes.io/job-name": name, "training.kubeflow.org/job-name": name}}
    pod = LocalPod(template, docs, tmp_path, "pod", meta)
    argv, env = pod.command("check-config", [])
    good = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0 and good.stdout.strip() == "config ok", good.stderr
    bad = subprocess.run(argv + ["train.stepz=3"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("error: unknown key `train.stepz`") and "Traceback" not in bad.stderr


def test_image_entrypoint_is_the_project_cli():
    """No `command` in job.yaml: the image's ENTRYPOINT must be `python -m job`."""
    from tests._k8s_helpers import dockerfile_entrypoint

    c = one(load_docs(JOB), "Job")["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in c and c["args"][0] == "train"
    entry = dockerfile_entrypoint()
    if entry is None:
        pytest.skip("no Dockerfile yet (the Docker helper's area)")
    assert entry == ["python", "-m", "job"]


def test_pods_run_as_the_images_user(rendered_with_exporter):
    """runAsUser/runAsGroup are the Dockerfile's USER uid:gid (the image's files are set up for it)."""
    from tests._k8s_helpers import dockerfile_user

    user = dockerfile_user()
    if user is None:
        pytest.skip("no Dockerfile yet (the Docker helper's area)")
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), f"Dockerfile USER {user} should be numeric for runAsNonRoot"
    for _where, d in every_doc(rendered_with_exporter):
        for tw, template in pod_templates(d):
            psc = template["spec"]["securityContext"]
            assert str(psc["runAsUser"]) == uid and str(psc["runAsGroup"]) == (gid or uid), tw
            if "fsGroup" in psc:
                assert str(psc["fsGroup"]) == (gid or uid), tw


# ---------------------------------------------------------------- one source of truth


def test_generated_monitoring_files_are_fresh():
    out = subprocess.run([sys.executable, str(K8S / "sync.py"), "--check"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_rules_equal_monitoring(rendered):
    sources = sorted((ROOT / "monitoring" / "prometheus" / "rules").glob("*.y*ml"))
    rules = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "PrometheusRule"}
    assert len(rules) == len(sources)
    for src in sources:
        want = yaml.safe_load(src.read_text())
        matches = [r for r in rules.values() if r["spec"] == want]
        assert len(matches) == 1, f"no PrometheusRule's spec equals {src.relative_to(ROOT)}: run make k8s-sync"
        assert matches[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert not roundtrip_prometheus_operator(matches[0])


def test_dashboards_equal_monitoring(rendered):
    sources = sorted((ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json"))
    maps = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert len(maps) == len(sources)
    by_key = {k: (cm, v) for cm in maps for k, v in cm["data"].items()}
    for src in sources:
        cm, text = by_key[src.name]
        assert text == src.read_text(), f"{src.name} differs from its ConfigMap: run make k8s-sync"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        json.loads(text)
        # client-side `kubectl apply` copies the object into an annotation limited to 256 KiB
        size = len(json.dumps(cm))
        assert size < 256 * 1024, f"{cm['metadata']['name']} is {size} bytes: too big for kubectl apply"


def datasource_refs(node) -> list:
    if isinstance(node, dict):
        out = [node["datasource"]] if "datasource" in node else []
        return out + [r for k, v in node.items() if k != "datasource" for r in datasource_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in datasource_refs(v)]
    return []


def test_dashboards_load_through_the_grafana_sidecar(rendered):
    """The sidecar copies the JSON into Grafana as is: no import-time `${DS_...}` inputs, every data
    source is picked by a `datasource` variable (kube-prometheus-stack names its own), and uids
    are unique (Grafana keys dashboards by uid)."""
    maps = [d for d in rendered if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    uids = []
    for cm in maps:
        for key, text in cm["data"].items():
            dash = json.loads(text)
            assert "__inputs" not in dash, f"{key}: exported for sharing; the sidecar cannot fill __inputs"
            uids.append(dash["uid"])
            variables = {v["name"] for v in dash.get("templating", {}).get("list", []) if v["type"] == "datasource"}
            refs = datasource_refs(dash.get("panels", [])) + datasource_refs(dash.get("templating", {}))
            for ref in refs:
                uid = ref.get("uid") if isinstance(ref, dict) else ref
                if isinstance(ref, dict) and ref.get("type") not in (None, "prometheus"):
                    continue  # Grafana's built-in annotation source etc.
                name = str(uid).strip("${}")
                assert name in variables, f"{key}: data source {ref!r} is not a datasource variable {variables}"
    assert len(uids) == len(set(uids))


def test_sync_check_fails_on_drift(tmp_path, monkeypatch):
    """The freshness check can fail: a changed copy is reported with the refresh command."""
    sys.path.insert(0, str(K8S))
    try:
        import sync
    finally:
        sys.path.remove(str(K8S))
    out = tmp_path / "monitoring"
    monkeypatch.setattr(sync, "OUT", out)
    sync.write()
    assert sync.stale() == []
    kust = out / "kustomization.yaml"
    kust.write_text(kust.read_text() + "# edited by hand\n")
    (out / "rules").mkdir(exist_ok=True)
    (out / "rules" / "orphan.yaml").write_text("x: 1\n")
    problems = sync.stale()
    assert any("kustomization.yaml" in p for p in problems)
    assert any("orphan.yaml (no source)" in p for p in problems)


# ---------------------------------------------------------------- network policies


NAMESPACE = {"namespace": "team", "ns_labels": {"kubernetes.io/metadata.name": "team"}}
PROMETHEUS = {"namespace": "monitoring", "ns_labels": {"kubernetes.io/metadata.name": "monitoring"},
              # what the Prometheus Operator puts on kube-prometheus-stack's Prometheus pods
              "labels": {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus-stack-prometheus",
                         "operator.prometheus.io/name": "kube-prometheus-stack-prometheus"}, "ports": {}}
NCCL_PORT = 45123  # NCCL and gloo connect on ephemeral ports


def controller_pods(doc: dict) -> list[dict]:
    """The pods the Job controller / Training Operator / DaemonSet controller create from a workload,
    with the labels those controllers add (kubernetes/pkg/controller/job, training-operator v1)."""
    name, kind = doc["metadata"]["name"], doc["kind"]
    out = []
    for where, template in pod_templates(doc):
        labels = dict(template["metadata"].get("labels", {}))
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        if kind == "Job":
            n = doc["spec"].get("completions", 1) if doc["spec"].get("completionMode") == "Indexed" else 1
            for i in range(n):
                extra = {"batch.kubernetes.io/job-name": name, "job-name": name,
                         "batch.kubernetes.io/controller-uid": "uid-1", "controller-uid": "uid-1"}
                if doc["spec"].get("completionMode") == "Indexed":
                    extra["batch.kubernetes.io/job-completion-index"] = str(i)
                out.append({**NAMESPACE, "name": f"{name}-{i}", "labels": {**labels, **extra}, "ports": ports})
        elif kind == "PyTorchJob":
            rtype = where.split("/")[-1]
            spec = doc["spec"]["pytorchReplicaSpecs"][rtype]
            for i in range(spec.get("replicas", 1)):
                extra = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name": "pytorchjob-controller",
                         "training.kubeflow.org/replica-type": rtype.lower(), "training.kubeflow.org/replica-index": str(i)}
                if rtype == "Master":
                    extra["training.kubeflow.org/job-role"] = "master"
                out.append({**NAMESPACE, "name": f"{name}-{rtype.lower()}-{i}", "labels": {**labels, **extra},
                            "ports": ports})
        elif kind == "DaemonSet":
            out.append({**NAMESPACE, "name": f"{name}-abcde", "labels": {**labels, "controller-revision-hash": "1"},
                        "ports": ports})
    return out


def policy_problems(docs: list[dict]) -> list[str]:
    """Every workload pod is isolated by a policy that admits exactly: Prometheus on the metrics port
    (the port the PodMonitor scrapes), the workload's own other pods on every port when it has several
    (rendezvous, NCCL), and nobody else: not another trainjob workload's pods (same labels but
    app.kubernetes.io/instance), not a pod labelled `prometheus` outside the monitoring namespace."""
    from tests._k8s_helpers import ingress_allowed

    policies = [{**d, "metadata": {**d["metadata"], "namespace": "team"}} for d in docs if d["kind"] == "NetworkPolicy"]
    workloads = [d for d in docs if pod_templates(d)]
    pods = {d["metadata"]["name"]: controller_pods(d) for d in workloads}
    impostors = [
        {**NAMESPACE, "name": "curious", "labels": {"app": "notebook"}, "ports": {}},
        {**NAMESPACE, "name": "fake-prometheus", "labels": dict(PROMETHEUS["labels"]), "ports": {}},
        {"namespace": "other", "ns_labels": {"kubernetes.io/metadata.name": "other"}, "name": "x",
         "labels": {"app.kubernetes.io/name": "trainjob", "app.kubernetes.io/component": "trainer"}, "ports": {}},
    ]
    out = []
    for wname, wpods in pods.items():
        for pod in wpods:
            metrics = pod["ports"].get("metrics", pod["ports"].get("exporter"))
            ports = sorted(set(pod["ports"].values()) | {NCCL_PORT, 29500, 23456})
            own = [p for p in wpods if p is not pod]
            others = [p for n, ps in pods.items() if n != wname for p in ps] + impostors
            for port in ports:
                if ingress_allowed(policies, pod, PROMETHEUS, port) != (port == metrics):
                    out.append(f"{pod['name']}: Prometheus on {port}: {'admitted' if port != metrics else 'refused'}")
                for peer in own:
                    if not ingress_allowed(policies, pod, peer, port):
                        out.append(f"{pod['name']}: own pod {peer['name']} refused on {port}")
                for peer in others:
                    if ingress_allowed(policies, pod, peer, port):
                        out.append(f"{pod['name']}: {peer['name']} ({peer['namespace']}) admitted on {port}")
    return out


@pytest.mark.parametrize("source", ["kustomize k8s (+exporter)", "multinode", "pytorchjob"])
def test_network_policies_admit_exactly_the_intended_peers(source, rendered_with_exporter):
    docs = {"multinode": lambda: render(MULTINODE.parent), "pytorchjob": lambda: render(PYTORCHJOB.parent)}.get(
        source, lambda: rendered_with_exporter)()
    workloads = [d for d in docs if pod_templates(d)]
    assert workloads and all(controller_pods(d) for d in workloads)
    assert policy_problems(docs) == []
    # each NetworkPolicy selects pods of exactly one workload: none is dead weight
    from tests._k8s_helpers import selects

    for pol in (d for d in docs if d["kind"] == "NetworkPolicy"):
        hit = {w["metadata"]["name"] for w in workloads for p in controller_pods(w)
               if selects(pol["spec"]["podSelector"], p["labels"])}
        assert len(hit) == 1, (pol["metadata"]["name"], hit)


DNS_POD = {"namespace": "kube-system", "ns_labels": {"kubernetes.io/metadata.name": "kube-system"},
           "name": "coredns-1", "labels": {"k8s-app": "kube-dns"}, "ports": {}}
OUTSIDE = {"cloud metadata endpoint": ({"ip": "169.254.169.254"}, 80), "API server": ({"ip": "10.96.0.1"}, 443),
           "internet": ({"ip": "93.184.216.34"}, 443), "node": ({"ip": "10.0.0.12"}, 10250)}


def egress_problems(docs: list[dict]) -> list[str]:
    """Every workload pod may reach the cluster's DNS (UDP and TCP 53) and, when it has several pods, its
    own other pods on every port; nothing else: not the metadata endpoint, the API server, the internet, a
    node, another namespace's pod, DNS on another port."""
    from tests._k8s_helpers import egress_allowed

    policies = [{**d, "metadata": {**d["metadata"], "namespace": "team"}} for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {d["metadata"]["name"]: controller_pods(d) for d in docs if pod_templates(d)}
    stranger = {"namespace": "other", "ns_labels": {"kubernetes.io/metadata.name": "other"}, "name": "x",
                "labels": {"app.kubernetes.io/name": "trainjob"}, "ports": {}}
    out = []
    for wpods in pods.values():
        for pod in wpods:
            for proto in ("UDP", "TCP"):
                if not egress_allowed(policies, pod, DNS_POD, 53, proto):
                    out.append(f"{pod['name']}: DNS over {proto} refused")
            if egress_allowed(policies, pod, DNS_POD, 8080):
                out.append(f"{pod['name']}: kube-dns admitted on 8080")
            for what, (dest, port) in OUTSIDE.items():
                if egress_allowed(policies, pod, dest, port):
                    out.append(f"{pod['name']}: the {what} is reachable")
            if egress_allowed(policies, pod, stranger, NCCL_PORT):
                out.append(f"{pod['name']}: a pod of another namespace is reachable")
            for peer in (p for p in wpods if p is not pod):
                if not egress_allowed(policies, pod, peer, NCCL_PORT):
                    out.append(f"{pod['name']}: own pod {peer['name']} unreachable on {NCCL_PORT}")
    return out


@pytest.mark.parametrize("source", ["kustomize k8s (+exporter)", "multinode", "pytorchjob"])
def test_network_policies_let_pods_out_only_to_dns_and_their_own_pods(source, rendered_with_exporter):
    docs = {"multinode": lambda: render(MULTINODE.parent), "pytorchjob": lambda: render(PYTORCHJOB.parent)}.get(
        source, lambda: rendered_with_exporter)()
    assert egress_problems(docs) == []
    # The check can fail: without the Egress type (the policies before), everything is reachable.
    for pol in (d for d in docs if d["kind"] == "NetworkPolicy"):
        pol["spec"]["policyTypes"] = ["Ingress"]
    assert any("metadata endpoint is reachable" in p for p in egress_problems(docs))


def test_network_policy_check_fails_when_a_label_drifts():
    """Renaming the Job without its policy, or a policy admitting everyone, is caught."""
    docs = load_docs(MULTINODE)
    job = one(docs, "Job")
    job["metadata"]["name"] = "trainjob-mn2"  # the controller's job-name label follows; the policy does not
    problems = policy_problems(docs)
    assert any("Prometheus on 29500: admitted" in p for p in problems), problems  # not isolated any more
    docs = load_docs(PYTORCHJOB)
    pol = one(docs, "NetworkPolicy")
    pol["spec"]["ingress"][0]["from"][0]["podSelector"] = {"matchLabels": {"app.kubernetes.io/name": "trainjob"}}
    assert any("admitted" in p for p in policy_problems(docs + load_docs(MULTINODE)))
    docs = load_docs(JOB)
    one(docs, "NetworkPolicy")["spec"]["ingress"][0]["ports"][0]["port"] = 9400
    assert any("Prometheus on 9401: refused" in p for p in policy_problems(docs))


# ---------------------------------------------------------------- the image, pinned by digest


def _pins():
    sys.path.insert(0, str(K8S))
    try:
        import pins
    finally:
        sys.path.remove(str(K8S))
    return pins


def test_every_image_goes_through_the_one_pin(tmp_path):
    """Shipped: every container of every kustomization is `trainjob:<tag>` without digest (the user's
    build, unknown here) and the check refuses each one by name. Pinned once in a copy of k8s/image,
    every reference in every kustomization (the exporter too) carries that digest."""
    pins = _pins()
    digest = "sha256:" + "0123456789abcdef" * 4
    ref = f"registry.example.com/team/trainjob:0.1.0@{digest}"
    shipped = pins.images(render(K8S)) + pins.images(render(MULTINODE.parent)) + pins.images(render(PYTORCHJOB.parent))
    assert len(shipped) == 7 and {img for _, img in shipped} == {"trainjob:0.1.0"}
    out = subprocess.run([sys.executable, str(K8S / "pins.py"), "check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("is not pinned by digest") == 7, out.stderr
    # a copy of k8s/ with the pin written by `pins.py set`, as `make k8s-pin` does
    import shutil

    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    out = subprocess.run([sys.executable, str(copy / "pins.py"), "set", ref], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    overlay = tmp_path / "with-exporter"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text("resources:\n  - ../k8s\ncomponents:\n  - ../k8s/exporter\n"
                                                "  - ../k8s/image\n")
    for d in (copy, copy / "multinode", copy / "pytorchjob", overlay):
        docs = render(d)
        assert pins.problems(docs) == [], d
        assert {img for _, img in pins.images(docs)} == {ref}, d
    assert subprocess.run([sys.executable, str(copy / "pins.py"), "check", str(copy), str(overlay)],
                          capture_output=True, timeout=120).returncode == 0


@pytest.mark.parametrize("ref", [
    "trainjob:0.1.0",                                       # no digest
    "registry/trainjob@sha256:" + "a" * 64,                 # no tag (keep it readable)
    "registry/trainjob:0.1.0@sha256:" + "a" * 63,           # short digest
    "registry/trainjob:0.1.0@sha256:" + "A" * 64,           # upper case
    "registry/trainjob:0.1.0@sha512:" + "a" * 64,           # other algorithm
])
def test_pin_refuses_malformed_references(ref, tmp_path):
    pins = _pins()
    component = tmp_path / "kustomization.yaml"
    component.write_text((K8S / "image" / "kustomization.yaml").read_text())
    with pytest.raises(pins.PinError, match="is not NAME:TAG@sha256"):
        pins.set_ref(ref, component)
    assert not pins.PINNED.match(ref)
    assert component.read_text() == (K8S / "image" / "kustomization.yaml").read_text()
    out = subprocess.run([sys.executable, str(K8S / "pins.py"), "set", ref], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


# ---------------------------------------------------------------- the user's image, data and workload

EXAMPLE = ROOT / "examples" / "tabular" / "k8s"
USER_IMAGE = "registry.example.com/team/tabular:0.1.0"
CONFIG_MAPS = {"job": "trainjob-config", "multinode": "trainjob-mn-config", "pytorchjob": "trainjob-ptj-config"}


@pytest.fixture(scope="module")
def user_renders(tmp_path_factory) -> dict[str, list[dict]]:
    """A user's overlays: examples/tabular/k8s (the single-node Job with the user's image, k8s/data and the
    workload in the ConfigMap), and the same overlay over k8s/multinode and k8s/pytorchjob."""
    out = {"job": render(EXAMPLE)}
    patch = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    for variant in ("multinode", "pytorchjob"):
        d = tmp_path_factory.mktemp(variant)
        rel = os.path.relpath(K8S, d)
        (d / "config.yaml").write_text(yaml.safe_dump({**patch, "metadata": {"name": CONFIG_MAPS[variant]}}))
        kust = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
        kust.update(resources=[f"{rel}/{variant}"], components=[f"{rel}/data"])
        (d / "kustomization.yaml").write_text(yaml.safe_dump(kust))
        out[variant] = render(d)
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_users_overlays_pass_strict_schemas(user_renders, tmp_path, version):
    for variant, docs in user_renders.items():
        validate_strict(docs, tmp_path / f"{variant}.yaml", version)
    validate_strict(load_docs(K8S / "data" / "pv-example.yaml"), tmp_path / "pv.yaml", version)


def test_users_overlays_take_the_image_the_data_and_the_workload(user_renders):
    """Every container runs the user's image; every trainer and config check mounts the claim trainjob-data
    read-only at /data (the pods stay restricted: a PVC, no hostPath); the ConfigMap picks the workload."""
    for variant, docs in user_renders.items():
        where = [(f"{variant} overlay", d) for d in docs]
        check_names_quantities_ports_and_references(where)
        check_restricted(where)
        claim = one(docs, "PersistentVolumeClaim", "trainjob-data")
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"] and claim["spec"]["storageClassName"] == ""
        assert claim["metadata"]["namespace"] == "trainjob"
        workloads = [(tw, t) for d in docs for tw, t in pod_templates(d) if d["kind"] in ("Job", "PyTorchJob")]
        assert len(workloads) == (2 if variant == "pytorchjob" else 1), variant
        for tw, template in workloads:
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "trainjob-data",
                                                                                 "readOnly": True}}, tw
            for c in all_containers(template):
                assert c["image"] == USER_IMAGE, (tw, c["name"])
                assert {"name": "data", "mountPath": "/data", "readOnly": True} in c["volumeMounts"], (tw, c["name"])
        for d in docs:
            if d["kind"] == "PyTorchJob":
                assert not roundtrip_kubeflow(d), roundtrip_kubeflow(d)
        config = yaml.safe_load(one(docs, "ConfigMap", CONFIG_MAPS[variant])["data"]["config.yaml"])
        assert config["workload"]["name"] == "task:workload" and config["data"]["path"].startswith("/data/"), config
    pv = one(load_docs(K8S / "data" / "pv-example.yaml"), "PersistentVolume")
    assert pv["spec"]["claimRef"] == {"namespace": "trainjob", "name": "trainjob-data"}
    assert pv["spec"]["nodeAffinity"], "a hostPath volume is one node's: the example pins its pods there"


def test_users_config_check_imports_the_workload_from_the_configmap(user_renders, tmp_path):
    """The multi-node config check, run as the kubelet would with the user's ConfigMap: the workload named
    there is imported (the image's PYTHONPATH holds the user's code: here examples/tabular) and checked."""
    from tests._k8s_helpers import LocalPod

    docs = user_renders["multinode"]
    job = one(docs, "Job", "trainjob-mn")
    meta = {"name": "pod", "annotations": {}, "labels": {"batch.kubernetes.io/job-name": "trainjob-mn"}}
    pod = LocalPod(job["spec"]["template"], docs, tmp_path, "pod", meta)
    csv = pod.volume_dirs["data"] / "tab.csv"
    subprocess.run([sys.executable, str(ROOT / "examples" / "tabular" / "make_data.py"), str(csv), "50"], check=True,
                   capture_output=True, timeout=60)
    argv, env = pod.command("check-config", [])
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "examples" / "tabular")
    # /data/tab.csv of the ConfigMap is the data volume's file; here that volume is a local folder
    good = subprocess.run([*argv, f"data.path={csv}"], capture_output=True, text=True, env=env, timeout=120)
    assert good.returncode == 0 and good.stdout.strip() == "config ok", good.stderr
    bad = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)  # no /data on this host
    assert bad.returncode == 2 and bad.stderr.startswith("error: data.path /data/tab.csv does not exist"), bad.stderr
