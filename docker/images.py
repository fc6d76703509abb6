"""Every third-party image the Dockerfile and compose pull, and whether each is pinned by digest.

    python docker/images.py check    # offline: every reference is NAME:TAG@sha256:<64 hex> (exit 2 if not)
    python docker/images.py verify   # online (= make images-verify): each digest is what the registry
                                     # serves for the tag today (crane digest, else docker buildx)

References: the Dockerfile's `ARG BASE_IMAGE=` default, and each compose `image:` / build arg default
`${VAR:-DEFAULT}` of docker-compose*.yml. The one image not pulled, `trainjob` (compose builds it from
the Dockerfile), is exempt; Kubernetes pins it by digest in k8s/image (k8s/pins.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*?[a-z0-9]):(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"
                    r"@(?P<digest>sha256:[0-9a-f]{64})$")
BUILT_HERE = re.compile(r"^trainjob(:[A-Za-z0-9_.-]+)?$")
_DEFAULT = re.compile(r"^\$\{(?P<var>[A-Z0-9_]+):-(?P<default>[^}]+)\}$")


def references(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, reference) of every image the Dockerfile and the compose files name."""
    import yaml

    out = []
    for line in (root / "Dockerfile").read_text().splitlines():
        m = re.match(r"^\s*ARG\s+BASE_IMAGE=(\S+)\s*$", line)
        if m:
            out.append(("Dockerfile ARG BASE_IMAGE", m.group(1)))
        m = re.match(r"^\s*FROM\s+(\S+)", line)
        if m and m.group(1) != "${BASE_IMAGE}":
            out.append(("Dockerfile FROM", m.group(1)))
    for path in sorted(root.glob("docker-compose*.yml")):
        services = (yaml.safe_load(path.read_text()) or {}).get("services", {})
        for name, svc in services.items():
            values = [("image", svc.get("image"))] + [
                (f"build arg {k}", v) for k, v in ((svc.get("build") or {}).get("args") or {}).items()
                if k.endswith("IMAGE")]
            for what, value in values:
                if value is None:
                    continue
                m = _DEFAULT.match(str(value))
                out.append((f"{path.name} {name} {what}" + (f" (${{{m['var']}}} default)" if m else ""),
                            m["default"] if m else str(value)))
    return out


def problems(refs: list[tuple[str, str]]) -> list[str]:
    return [f"{where}: `{ref}` is not pinned; want NAME:TAG@sha256:<64 hex> (docs/docker.md, \"Pinned images\")"
            for where, ref in refs if not (PINNED.match(ref) or BUILT_HERE.match(ref))]


def registry_digest(ref: str) -> str:
    if shutil.which("crane"):
        cmd = ["crane", "digest", ref]
    elif shutil.which("docker"):
        cmd = ["docker", "buildx", "imagetools", "inspect", "--format", "{{.Manifest.Digest}}", ref]
    else:
        raise RuntimeError("neither crane nor docker is installed")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(((out.stderr or out.stdout).strip().splitlines() or ["no output"])[0][:300])
    return out.stdout.strip()


def main(argv: list[str]) -> int:
    refs = references()
    if argv == ["check"]:
        bad = problems(refs)
        for b in bad:
            print(f"error: {b}", file=sys.stderr)
        if not bad:
            print(f"{len(refs)} image references, every pulled one pinned by digest")
        return 2 if bad else 0
    if argv == ["verify"]:
        rc = 0
        for where, ref in refs:
            m = PINNED.match(ref)
            if not m:
                continue
            try:
                now = registry_digest(f"{m['name']}:{m['tag']}")
            except RuntimeError as e:
                print(f"error: {where}: cannot ask the registry about {m['name']}:{m['tag']}: {e}", file=sys.stderr)
                rc = 1
                continue
            same = now == m["digest"]
            rc |= not same
            print(f"{'ok  ' if same else 'DIFF'} {where}: {m['name']}:{m['tag']} pinned {m['digest']}"
                  + ("" if same else f", registry serves {now}"))
        return rc
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
