"""A user's workload on a real card (one H200 is enough; skipped without CUDA): the GPT example from its token
file under the memory plan (ddp, one process, memory.cap_gb so the plan has to work) and balanced, validated
at the end; and the token file against synthetic tokens (the throughput figure is reported, not asserted:
the benchmark checks speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, job_cmd, requires_gpus

pytestmark = pytest.mark.gpu
GPT = ROOT / "examples" / "gpt"
SHAPE = ["workload=task:workload", "workload.layers=4", "workload.d_model=256", "workload.heads=4",
         "workload.seq_len=256", "train.amp=bf16", "train.optimizer=adamw", "train.lr=1e-3", "train.log_every=10"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    # Bytes of the repo's own text files: a real corpus, no download.
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    data = np.frombuffer(text * 4, dtype=np.uint8).astype(np.uint16)
    cut = int(len(data) * 0.95)
    data[:cut].tofile(d / "train.bin")
    data[cut:].tofile(d / "val.bin")
    return d


def _train(tmp, run_id, *args):
    p = subprocess.run(job_cmd("train", f"train.run_dir={tmp}", f"train.run_id={run_id}", *args), cwd=tmp,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(GPT), str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert p.returncode == 0, p.stderr[-4000:]
    return p, json.loads((tmp / run_id / "summary.json").read_text())


@requires_gpus(1)
@pytest.mark.parametrize("strategy", ["ddp", "balanced"])
def test_the_gpt_example_under_the_memory_plan(tmp_path, tokens, strategy):
    p, s = _train(tmp_path, strategy, f"strategy={strategy}", "strategy.nprocs=1", *SHAPE, "train.batch_size=64",
                  "train.steps=30", "strategy.split=auto", "memory.cap_gb=[20]", "data.kind=tokens",
                  f"data.path={tokens / 'train.bin'}", f"data.val_path={tokens / 'val.bin'}", "data.workers=2")
    assert "memory plan" in p.stderr, p.stderr[-3000:]
    card = s["cards"][0]
    predicted, measured = card.get("predicted_peak_bytes"), card["peak_allocated_bytes"]
    print(f"{strategy}: predicted {predicted}, measured {measured}, {s['tok_per_s']:,.0f} tok/s")
    assert predicted and abs(measured / predicted - 1) < 0.10, (predicted, measured)
    assert s["validation"]["val_samples"] > 0 and s["validation"]["val_loss"] < 6.0


@requires_gpus(1)
def test_token_file_against_synthetic_tokens(tmp_path, tokens):
    common = ["strategy=ddp", "strategy.nprocs=1", *SHAPE, "train.batch_size=64", "train.steps=60",
              "train.final_checkpoint=false"]
    _, synthetic = _train(tmp_path, "syn", *common)
    _, real = _train(tmp_path, "file", *common, "data.kind=tokens", f"data.path={tokens / 'train.bin'}",
                     "data.workers=2")
    ratio = real["tok_per_s"] / synthetic["tok_per_s"]
    print(f"token file {real['tok_per_s']:,.0f} tok/s, synthetic {synthetic['tok_per_s']:,.0f} tok/s: {ratio:.3f}x",
          file=sys.stderr)
    assert ratio > 0.5  # a reader that starves the card by half is broken; the benchmark checks the target
