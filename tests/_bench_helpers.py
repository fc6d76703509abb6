"""The helpers the bench's tests share (tests/unit/test_bench_rules.py, tests/e2e/test_bench.py, tests/gpu/).
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:  # a test dependency (pyproject [test]); the GPU machine may run the GPU test without it
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

from job import bench
from job.datasets import PNG_MAGIC


def validate(doc: dict, *, required: bool = True) -> None:
    if jsonschema is None:
        if required:
            pytest.fail("jsonschema is missing: pip install -e '.[test]'")
        return
    jsonschema.Draft202012Validator.check_schema(bench.RESULT_SCHEMA)
    jsonschema.Draft202012Validator(bench.RESULT_SCHEMA).validate(doc)


def assert_png(path: Path) -> None:
    from matplotlib import image

    assert path.stat().st_size > 10_000, path.stat().st_size  # a real chart, not an empty canvas
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 0.01  # something is drawn on it


def runs_by_name(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["workloads"][0]["runs"]}
