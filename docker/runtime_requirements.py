"""Print pyproject.toml's runtime dependencies that the image must install, one per line.

torch and torchvision are left out: the base image provides them (the CUDA build in
pytorch/pytorch, a CPU build in CI's stand-in), and reinstalling them would pull gigabytes.
Used by the Dockerfile and by docker/fetch-wheels.sh, so both read the one list in pyproject.toml.
Usage: python docker/runtime_requirements.py [pyproject.toml]
"""

import re
import sys

import tomllib

FROM_BASE_IMAGE = {"torch", "torchvision"}


def runtime_requirements(pyproject: str) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if re.split(r"[^A-Za-z0-9._-]", d, maxsplit=1)[0].lower() not in FROM_BASE_IMAGE]


if __name__ == "__main__":
    print("\n".join(runtime_requirements(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")))
