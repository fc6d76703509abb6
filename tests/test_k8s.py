"""k8s/: renders, passes the API schemas strictly, and says what the project's contracts say.

No API server runs here (DESIGN.md), so every check is offline: `kubectl kustomize` renders,
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
        f"resources:\n  - {rel}\ncomponents:\n  - {rel}/exporter\n"
    )
    return render(overlay)


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
        assert one(rendered, doc["kind"], doc["metadata"]["name"]) == doc
    # namespace-agnostic: `kubectl apply -n X` / kustomize `namespace:` decide
    assert all("namespace" not in d["metadata"] for d in rendered)


@pytest.mark.parametrize("path", [MULTINODE, PYTORCHJOB], ids=["multinode", "pytorchjob"])
def test_multinode_kustomizations_add_only_monitoring(path, rendered):
    """`kubectl apply -k k8s/<variant>` = the variant's file as is + the monitoring objects."""
    out = render(path.parent)
    monitoring = [d for d in rendered if d["apiVersion"].startswith("monitoring.coreos.com/")
                  or d["metadata"].get("labels", {}).get("grafana_dashboard")]
    raw = load_docs(path)
    assert len(out) == len(raw) + len(monitoring)
    for doc in raw + monitoring:
        assert one(out, doc["kind"], doc["metadata"]["name"]) == doc


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


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_pass_strict_schemas(rendered_with_exporter, tmp_path, version):
    """kubernetes-validate --strict (unknown fields rejected) on every built-in object, and on the
    pod templates inside the PyTorchJob (as PodTemplate objects: the same PodSpec schema)."""
    docs = [d for _, d in every_doc(rendered_with_exporter) if is_builtin(d)]
    for d in load_docs(PYTORCHJOB):
        for where, template in pod_templates(d):
            docs.append({"apiVersion": "v1", "kind": "PodTemplate",
                         "metadata": {"name": where.split("/")[-1].lower()}, "template": template})
    assert len(docs) >= 12
    path = tmp_path / "builtin.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(exe), "--strict", "--quiet", "-k", version, str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


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
    docs = every_doc(rendered_with_exporter)
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
    for _where, d in every_doc(rendered_with_exporter):
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


def test_job_failure_policy_and_retries():
    """Config errors (exit 2) end the Job; preemption/eviction retries without counting."""
    for path in (JOB, MULTINODE):
        job = one(load_docs(path), "Job")
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy Never"
        assert spec["backoffLimit"] >= 1
        # the replacement waits for the old pod's SIGTERM checkpoint to finish (one writer at a time)
        assert spec["podReplacementPolicy"] == "Failed"
        rules = spec["podFailurePolicy"]["rules"]
        names = {c["name"] for c in all_containers(job["spec"]["template"])}
        for rule in rules:
            assert rule["action"] in ("FailJob", "Ignore", "Count", "FailIndex")
            if "onExitCodes" in rule:
                assert rule["onExitCodes"].get("containerName", next(iter(names))) in names
                assert 0 not in rule["onExitCodes"]["values"]
        fail = [r for r in rules if r["action"] == "FailJob"]
        assert len(fail) == 1 and fail[0]["onExitCodes"] == {
            "containerName": fail[0]["onExitCodes"]["containerName"], "operator": "In", "values": [2]}
        assert rules[0] is fail[0], "the config-error rule must come first (first match wins)"
        ignore = [r for r in rules if r["action"] == "Ignore"]
        assert ignore and ignore[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
        # exit 75 (checkpointed on SIGTERM) is never a permanent failure
        assert not any(75 in r.get("onExitCodes", {}).get("values", []) and r["action"] == "FailJob" for r in rules)
        # the container the FailJob rule watches is the one that runs the config check
        watched = next(c for c in all_containers(job["spec"]["template"])
                       if c["name"] == fail[0]["onExitCodes"]["containerName"])
        assert "train" in watched["args"]


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
        c = s["template"]["spec"]["containers"][0]
        # the operator finds the master port by this name
        assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in c["ports"]
        assert ptj["spec"]["nprocPerNode"] == c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["command"] == ["python", "-m", "torch.distributed.run"]
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
