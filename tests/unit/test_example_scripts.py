"""The examples' data scripts are what a user runs first: `--help` prints usage and writes nothing, a bad
argument or an unwritable output is one line and a non-zero exit, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {"vision": EXAMPLES / "vision" / "make_images.py", "tabular": EXAMPLES / "tabular" / "make_data.py",
           "gpt": EXAMPLES / "gpt" / "prepare.py"}


def run(script, *args, cwd):
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_writes_nothing(name, tmp_path):
    r = run(SCRIPTS[name], "--help", cwd=tmp_path)
    assert r.returncode == 0 and "usage: python examples/" in r.stdout
    assert list(tmp_path.iterdir()) == []  # an earlier version made a folder named --help


@pytest.mark.parametrize("name", ["vision", "tabular"])
@pytest.mark.parametrize("count", ["0", "lots"])
def test_bad_count_is_one_line(name, count, tmp_path):
    r = run(SCRIPTS[name], tmp_path / "out", count, cwd=tmp_path)
    assert r.returncode == 2 and "invalid positive value" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_unwritable_output_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a folder is asked for
    for script, out in ((SCRIPTS["vision"], blocker / "shapes"), (SCRIPTS["tabular"], blocker / "t.csv")):
        r = run(script, out, "3", cwd=tmp_path)
        assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr
    text = tmp_path / "in.txt"
    text.write_text("hello token files " * 100)
    r = run(SCRIPTS["gpt"], text, blocker / "gpt", cwd=tmp_path)
    assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prepare_refuses_a_missing_or_tiny_text(tmp_path):
    r = run(SCRIPTS["gpt"], tmp_path / "missing.txt", tmp_path / "gpt", cwd=tmp_path)
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "tiny.txt").write_text("hi")
    r = run(SCRIPTS["gpt"], tmp_path / "tiny.txt", tmp_path / "gpt", cwd=tmp_path)
    assert r.returncode == 2 and "has 2 bytes" in r.stderr
    assert not (tmp_path / "gpt").exists()


def test_each_writes_its_data(tmp_path):
    assert run(SCRIPTS["vision"], tmp_path / "shapes", "2", cwd=tmp_path).returncode == 0
    assert len(list((tmp_path / "shapes").rglob("*.png"))) == 6
    assert run(SCRIPTS["tabular"], tmp_path / "t.csv", "5", cwd=tmp_path).returncode == 0
    assert len((tmp_path / "t.csv").read_text().splitlines()) == 6
    (tmp_path / "in.txt").write_text("x" * 100)
    assert run(SCRIPTS["gpt"], tmp_path / "in.txt", tmp_path / "gpt", cwd=tmp_path).returncode == 0
    assert (tmp_path / "gpt" / "train.bin").stat().st_size == 180 and (tmp_path / "gpt" / "val.bin").stat().st_size == 20
