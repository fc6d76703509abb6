"""The public workload interface (job.workload) as a user meets it: the examples in examples/ under every
strategy, validation, interruption and resume, the data readers' bad files, and the errors in a user's code.
Every run goes through the real entry point, from a folder outside the package, with the user's folder on
PYTHONPATH as the docs say."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import assert_same_weights, final_model, wait_for_step
from conftest import ROOT, job_cmd

EXAMPLES = ROOT / "examples"
FIXTURES = Path(__file__).parent.parent / "fixtures"
CPU = ["train.device=cpu", "train.log_every=2", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The examples' own data, made by their own scripts."""
    d = tmp_path_factory.mktemp("data")
    py = sys.executable
    for cmd in ([py, EXAMPLES / "gpt" / "prepare.py", ROOT / "README.md", d / "gpt"],
                [py, EXAMPLES / "tabular" / "make_data.py", d / "tab.csv", "600"],
                [py, EXAMPLES / "vision" / "make_images.py", d / "shapes", "8"]):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=60)
    return d


def example_args(name: str, d: Path) -> list[str]:
    return {
        "gpt": ["workload=task:workload", "data.kind=tokens", f"data.path={d / 'gpt' / 'train.bin'}",
                f"data.val_path={d / 'gpt' / 'val.bin'}", "train.batch_size=8", "train.optimizer=adamw",
                "train.lr=1e-3"],
        "tabular": ["workload=task:workload", "data.kind=csv", f"data.path={d / 'tab.csv'}",
                    "data.val_fraction=0.1", "train.batch_size=32", "workload.hidden=32"],
        "vision": ["workload=task:workload", "data.kind=imagefolder", f"data.path={d / 'shapes'}",
                   "data.val_fraction=0.25", "train.batch_size=8", "workload.image_size=32"],
    }[name]


def run(tmp: Path, example: str | None, *args: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python -m job train ...` from `tmp` (not the repo), with the example's folder on PYTHONPATH."""
    path = [str(EXAMPLES / example)] if example else [str(FIXTURES)]
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join([*path, *([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else [])])
    return subprocess.run(job_cmd("train", f"train.run_dir={tmp / 'runs'}", *args), cwd=tmp, capture_output=True,
                          text=True, timeout=timeout, env=environ)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


STRATEGIES = {"dp": ["strategy=dp"], "balanced": ["strategy=balanced"], "ddp": ["strategy=ddp", "strategy.nprocs=2"],
              "fsdp": ["strategy=fsdp", "strategy.nprocs=2"]}


# Every example under fsdp (its own blocks are the sharding units), and each under one other strategy, so that
# every strategy trains a user's workload (the strategies' equality with one process is tests/e2e/test_train.py's).
PAIRS = [("gpt", "fsdp"), ("tabular", "fsdp"), ("vision", "fsdp"), ("gpt", "ddp"), ("tabular", "balanced"),
         ("vision", "dp")]


@pytest.mark.parametrize("example,strategy", PAIRS, ids=[f"{e}-{s}" for e, s in PAIRS])
def test_example_trains_and_validates_under_every_strategy(tmp_path, data, example, strategy):
    p = run(tmp_path, example, *example_args(example, data), *STRATEGIES[strategy], *CPU, "train.steps=4",
            "eval.every=2", "train.run_id=r")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    val = summary["validation"]
    assert val["step"] == 4 and val["val_samples"] > 0 and np.isfinite(val["val_loss"])
    assert 0 <= val["val_accuracy"] <= 1
    records = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert "validation: loss" in p.stderr
    if strategy == "fsdp":  # the example's own blocks are the sharding units
        blocks = {"gpt": 2, "tabular": 2, "vision": 4}[example]
        assert f"fsdp: {blocks} sharding units + the root" in p.stderr, p.stderr


def test_the_resolved_config_names_the_users_workload(tmp_path, data):
    p = run(tmp_path, "tabular", *example_args("tabular", data), "strategy=dp", *CPU, "train.steps=1",
            "train.run_id=c", "workload.depth=3")
    assert p.returncode == 0, p.stderr
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(tmp_path / "runs" / "c" / "config.yaml")
    assert cfg.workload.name == "task:workload" and cfg.workload.depth == 3 and cfg.workload.hidden == 32


def test_a_file_path_needs_no_pythonpath_even_for_spawned_ranks(tmp_path, data):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "task.py").write_text((EXAMPLES / "tabular" / "task.py").read_text())
    args = [a for a in example_args("tabular", data) if not a.startswith("workload=")]
    p = subprocess.run(job_cmd("train", "workload=mine/task.py:workload", *args, "strategy=ddp", "strategy.nprocs=2",
                               *CPU, "train.steps=2", f"train.run_dir={tmp_path / 'runs'}"),
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ddp: started 2 ranks" in p.stderr


@pytest.mark.parametrize("strategy", ["ddp", "balanced"])
def test_validation_leaves_the_weights_unchanged(tmp_path, data, strategy):
    """ResNet-18 (BatchNorm: eval mode must not move its statistics) with and without held-out data."""
    common = [a for a in example_args("vision", data) if not a.startswith("data.val")]
    common += [*STRATEGIES[strategy], *CPU, "train.steps=4", "data.workers=1"]
    assert run(tmp_path, "vision", *common, "train.run_id=plain").returncode == 0
    p = run(tmp_path, "vision", *common, "train.run_id=val", f"data.val_path={data / 'shapes'}", "eval.every=1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("validation: loss") == 4
    assert_same_weights(final_model(tmp_path / "runs", "plain")["model"], final_model(tmp_path / "runs", "val")["model"],
                        exact=True)


def test_sigterm_and_resume_equal_an_uninterrupted_run(tmp_path, data):
    """The GPT on its token file, 2 ddp ranks, DataLoader workers: stopped by SIGTERM, resumed, bit for bit."""
    args = [*example_args("gpt", data), *STRATEGIES["ddp"], "train.device=cpu", "train.log_every=1",
            "train.checkpoint_every=0", "train.steps=30", "data.workers=1", "eval.every=10"]
    assert run(tmp_path, "gpt", *args, "train.run_id=full").returncode == 0
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES / "gpt")}
    proc = subprocess.Popen(job_cmd("train", f"train.run_dir={tmp_path / 'runs'}", *args, "train.run_id=cut"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_step(tmp_path / "runs" / "cut" / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert 5 <= final_model(tmp_path / "runs", "cut")["step"] < 30
    p = run(tmp_path, "gpt", *args, "train.run_id=cut")
    assert p.returncode == 0 and "resumed from" in p.stderr, p.stderr[-3000:]
    assert_same_weights(final_model(tmp_path / "runs", "full")["model"], final_model(tmp_path / "runs", "cut")["model"],
                        exact=True)
    full = json.loads((tmp_path / "runs" / "full" / "summary.json").read_text())["validation"]
    cut = json.loads((tmp_path / "runs" / "cut" / "summary.json").read_text())["validation"]
    assert full == cut


def test_help_lists_the_workloads_own_keys(tmp_path):
    p = subprocess.run(job_cmd("train", "workload=task:workload", "--help"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(EXAMPLES / "tabular")})
    assert p.returncode == 0, p.stderr
    assert "workload.hidden=64" in p.stdout and "Width of the hidden layers." in p.stdout
    assert "workload.vocab" not in p.stdout


def test_an_entry_point_names_a_workload(tmp_path, data):
    """An installed package's `trainjob.workloads` entry point (a dist-info on the path is what pip leaves)."""
    site = tmp_path / "site"
    (site / "tabtask-1.0.dist-info").mkdir(parents=True)
    (site / "tabtask-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tabtask\nVersion: 1.0\n")
    (site / "tabtask-1.0.dist-info" / "entry_points.txt").write_text("[trainjob.workloads]\ntabular = tabtask:workload\n")
    (site / "tabtask.py").write_text((EXAMPLES / "tabular" / "task.py").read_text())
    args = [a for a in example_args("tabular", data) if not a.startswith("workload=")]
    p = run(tmp_path, None, "workload=tabular", *args, "strategy=dp", *CPU, "train.steps=2", "train.run_id=ep",
            env={"PYTHONPATH": str(site)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "tabtask:workload" not in errors(p.stderr)


# -- errors in the user's code: one line naming the user's object, exit 2, nothing written -----------------
USER_ERRORS = [
    ("badtask:not_a_module", "workload `badtask:not_a_module`: model() returned a int, not a torch.nn.Module"),
    ("badtask:wrong_output", "workload `badtask:wrong_output`: loss(output of shape (3, 2), target of shape (3,)): "
                             "RuntimeError: The size of tensor a (2) must match"),
    ("badtask:sum_of_elements", "reduction=sum gave"),
    ("badtask:vector_loss", "with reduction=mean gave (3,), not a floating-point scalar"),
    ("badtask:forward_raises", "RuntimeError: the user's forward is broken (at "),
    ("badtask:bad_batch", "workload `badtask:bad_batch`: example_batch gave Tensor, not an (x, y) pair of tensors"),
    ("badtask:builder_raises", "workload `badtask:builder_raises`: model(): ZeroDivisionError: division by zero (at "),
    ("badtask:not_a_workload", "badtask:not_a_workload is a dict, not a job.workload.Workload"),
    ("badtask:missing", "fixtures/badtask.py) has no attribute `missing`; it defines the Workload"),
    ("brokenimport:workload", "importing brokenimport failed: NameError: name 'undefined_builder' is not defined "
                              "(at "),
]


# Every mistake under dp; under ddp, where the spawned ranks find the mistake too and rank 0 says it once, one
# of each place it is found (the model's build, its forward, the loss): the rest are refused by config.load or
# by the same check on rank 0.
DDP_ERRORS = ("badtask:builder_raises", "badtask:forward_raises", "badtask:wrong_output")


CASES = [(n, e, "dp") for n, e in USER_ERRORS] + [(n, e, "ddp") for n, e in USER_ERRORS if n in DDP_ERRORS]


@pytest.mark.parametrize("name,expected,strategy", CASES, ids=[f"{s}-{n}" for n, _, s in CASES])
def test_a_mistake_in_the_users_code_is_one_line(tmp_path, name, expected, strategy):
    p = run(tmp_path, None, f"workload={name}", *STRATEGIES[strategy], *CPU, "train.steps=2", "train.run_id=x")
    assert p.returncode == 2, p.stderr[-2000:]
    lines = errors(p.stderr)
    assert len(lines) == 1 and expected in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    if "(at " in expected:  # the user's own file and line
        assert "badtask.py:" in lines[0] or "brokenimport.py:" in lines[0]
    assert not (tmp_path / "runs" / "x").exists() or not any((tmp_path / "runs" / "x").iterdir())


# -- the token file reader ---------------------------------------------------------------------------
def test_bad_token_files_are_one_line(tmp_path):
    lm = ["workload=lm", "workload.layers=1", "workload.d_model=16", "workload.heads=2", "workload.vocab=300",
          "workload.seq_len=8", "strategy=dp", *CPU, "train.steps=1", "train.batch_size=2", "data.kind=tokens"]
    cases = {
        "empty.bin": (b"", "is empty"),
        "odd.bin": (b"\x01\x02\x03", "has 3 bytes, not a whole number of uint16 tokens"),
        "short.bin": (np.arange(5, dtype=np.uint16).tobytes(), "holds 5 tokens, fewer than one sample"),
        "vocab.bin": (np.array([1, 2, 70000 % 65536, 299, 300, 5] * 4, dtype=np.uint16).tobytes(),
                      "holds token id 4,464, and workload.vocab=300"),
    }
    for i, (fname, (content, expected)) in enumerate(cases.items()):
        (tmp_path / fname).write_bytes(content)
        p = run(tmp_path, None, *lm, f"data.path={tmp_path / fname}", f"train.run_id=t{i}")
        lines = errors(p.stderr)
        assert p.returncode == 2 and len(lines) == 1 and expected in lines[0], (fname, p.stderr[-2000:])
        assert not (tmp_path / "runs" / f"t{i}").exists() or not any((tmp_path / "runs" / f"t{i}").iterdir())


def test_token_windows_follow_the_sample_ids(tmp_path):
    """Any split of a micro-batch (offset, count) reads the same windows as the whole; uint32 files too."""
    from job import config
    from job.data import Data

    ids = np.arange(10_000, dtype=np.uint32) % 1024
    ids.tofile(tmp_path / "t.bin")
    cfg = config.load(["workload=lm", "workload.seq_len=16", "workload.vocab=1024", "data.kind=tokens",
                       f"data.path={tmp_path / 't.bin'}", "data.token_dtype=uint32"])
    d = Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=3)
    cpu = torch.device("cpu")
    whole = d.batches(micro_batch=6, start=12, offset=0, count=6, device=cpu, channels_last=False, prefetch=False)
    a = d.batches(micro_batch=6, start=12, offset=0, count=2, device=cpu, channels_last=False, prefetch=False)
    b = d.batches(micro_batch=6, start=12, offset=2, count=4, device=cpu, channels_last=False, prefetch=False)
    for _ in range(3):
        x, y = next(whole)
        xa, ya = next(a)
        xb, yb = next(b)
        assert torch.equal(x, torch.cat([xa, xb])) and torch.equal(y, torch.cat([ya, yb]))
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        starts = x[:, 0].tolist()
        assert all(s % 16 == 0 for s in starts)  # windows start at multiples of seq_len


def test_the_readmes_bring_your_own_model_runs_as_written(tmp_path, data):
    """The README's mytask.py and its command, copied out of the README (steps cut to 4)."""
    import re
    import shlex

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Bring your own model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```\n(PYTHONPATH=\. python -m job train .*?)```", section, re.S).group(1)
    (tmp_path / "mytask.py").write_text(code)
    (tmp_path / "rows.csv").write_text((data / "tab.csv").read_text())
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:5] == ["PYTHONPATH=.", "python", "-m", "job", "train"], argv
    p = subprocess.run(job_cmd(*argv[4:], "train.steps=4", "train.device=cpu", "strategy.nprocs=2",
                               f"train.run_dir={tmp_path / 'runs'}", "train.run_id=readme"), cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": "."})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "runs" / "readme" / "summary.json").read_text())["validation"]["val_samples"] == 60


@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_an_exception_in_the_users_code_mid_run_names_their_line_once(tmp_path, strategy):
    p = run(tmp_path, None, "workload=badtask:fails_later", *STRATEGIES[strategy], *CPU, "train.steps=5",
            "train.run_id=x", "train.batch_size=8")
    assert p.returncode == 1, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if "step three is where the user's bug is" in x]
    assert len(lines) == 1, p.stderr[-2000:]
    assert "ValueError: step three is where the user's bug is (at " in lines[0] and "badtask.py:" in lines[0]
    assert "in forward" in lines[0]
