"""Config: precedence, presets, and every kind of bad input as one line + exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, job_cmd

from job import config
from job.errors import UsageError
from job.strategies import REGISTRY


def test_registry_is_pinned():
    assert sorted(REGISTRY) == ["balanced", "ddp", "dp", "fsdp"]
    assert config.preset_names("strategy") == ["accum", "balanced", "balanced-graphs", "ddp", "dp", "fsdp"]
    assert config.preset_names("workload") == ["lm", "lm-12x512", "lm-1b3", "lm-24x384", "resnet50", "tiny"]


def test_workload_presets_of_one_model_and_which_preset_a_command_picked(tmp_path):
    shapes = {"lm-12x512": (12, 512, 8, 32000, 512, 24), "lm-24x384": (24, 384, 6, 8192, 512, 32),
              "lm-1b3": (24, 2048, 16, 50304, 1024, 8)}
    for preset, shape in shapes.items():
        cfg = config.load([f"workload={preset}", "train.amp=bf16"])
        w = cfg.workload
        assert w.name == "lm" and (w.layers, w.d_model, w.heads, w.vocab, w.seq_len, cfg.train.batch_size) == shape
        assert w.d_model % w.heads == 0 and cfg.train.optimizer == "adamw"
    assert config.load(["workload=lm-1b3"]).train.activation_checkpointing
    # The config records what a preset sets (workload.name is lm), not its name: the picks say which one.
    assert config.preset_picks(["workload=lm-24x384", "strategy=ddp", "train.steps=3"]) == {
        "workload": "lm-24x384", "strategy": "ddp"}
    assert config.preset_picks(["train.steps=3"]) == {}
    f = tmp_path / "c.yaml"
    f.write_text("workload: lm-12x512\ntrain:\n  steps: 3\n")
    assert config.preset_picks(["--config", str(f)]) == {"workload": "lm-12x512"}
    assert config.preset_picks(["--config", str(f), "workload=lm"]) == {"workload": "lm"}  # command line wins


def test_precedence_schema_base_presets_file_cli(tmp_path):
    cfg = config.load([])
    assert cfg.train.optimizer == "sgd"  # schema default, untouched by base.yaml
    assert cfg.train.steps == 200  # base.yaml
    assert cfg.strategy.name == "ddp"

    cfg = config.load(["strategy=accum"])  # strategy preset over base
    assert cfg.train.accum_steps == 4 and cfg.strategy.name == "ddp"

    cfg = config.load(["workload=lm"])  # workload preset over base
    assert (cfg.workload.vocab, cfg.train.batch_size, cfg.train.optimizer) == (50304, 16, "adamw")

    user = tmp_path / "my.yaml"
    user.write_text("workload: resnet50\ntrain:\n  batch_size: 512\n  steps: 7\n")
    cfg = config.load(["--config", str(user)])  # file over presets; a plain string picks a preset
    assert (cfg.workload.name, cfg.workload.image_size, cfg.train.batch_size) == ("resnet50", 224, 512)

    cfg = config.load(["--config", str(user), "train.batch_size=128"])  # CLI over file
    assert (cfg.train.batch_size, cfg.train.steps) == (128, 7)

    cfg = config.load(["--config", str(user), "workload=tiny"])  # CLI preset pick over the file's pick
    assert cfg.workload.name == "tiny" and cfg.train.batch_size == 512


def test_workload_preset_wins_over_strategy_preset():
    cfg = config.load(["strategy=accum", "workload=lm"])
    assert cfg.train.accum_steps == 4 and cfg.train.batch_size == 16


def test_yaml_booleans_do_not_eat_string_values(tmp_path):
    assert config.load(["train.amp=off"]).train.amp == "off"  # YAML 1.1 would read False
    assert config.load(["train.amp='off'"]).train.amp == "off"
    assert config.load(["train.run_id=1e3", "strategy.gpu0_batch=0.25"]).train.run_id == "1e3"
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  amp: off\n")
    assert config.load(["--config", str(f)]).train.amp == "off"
    assert config.load(["train.steps=7"]).train.steps == 7  # non-strings still parse as YAML


def test_bench_strategies_alias():
    cfg = config.load(["strategies=[dp,ddp]"])
    assert list(cfg.bench.strategies) == ["dp", "ddp"]


BAD = [
    (["strategy.gpu0_bs=3"], "unknown key `strategy.gpu0_bs` in command line; did you mean `strategy.gpu0_batch`?"),
    (["train.batch_sise=3"], "did you mean `train.batch_size`"),
    (["train.steps=many"], "`train.steps`"),
    (["strategy=zero3"], "unknown strategy `zero3`; choose one of: accum, balanced, balanced-graphs, ddp, dp, fsdp"),
    (["strategy.name=zero3"], "unknown strategy `zero3`; choose one of: balanced, ddp, dp, fsdp"),
    (["workload=gpt5"], "unknown workload `gpt5`; choose one of: lm, lm-12x512, lm-1b3, lm-24x384, resnet50, tiny, or "
                        "give an import path"),
    (["train.batch_size=250", "train.accum_steps=64"], "global batch 250 is not a multiple of train.accum_steps=64"),
    (["train.amp=fp8"], "`train.amp=fp8` is not valid; choose one of: off, bf16, fp16"),
    (["data.kind=imagefolder", "data.path=/does/not/exist"], "data.path /does/not/exist does not exist"),
    (["train.steps=0"], "`train.steps=0` is out of range; use 1 to 99,999,999"),
    (["train.steps=100000000"], "`train.steps=100000000` is out of range (checkpoint files hold the step in 8 digits)"),
    (["train.lr=nan"], "`train.lr=nan` is not a finite number"),
    (["train.lr=inf"], "`train.lr=inf` is not a finite number"),
    (["train.lr=-0.1"], "`train.lr=-0.1` is out of range; give a learning rate above 0 and at most 100"),
    (["train.lr=0"], "`train.lr=0.0` is out of range"),
    (["train.lr=1e6"], "`train.lr=1000000.0` is out of range"),
    (["train.momentum=1"], "`train.momentum=1.0` is out of range"),
    (["train.momentum=-0.5"], "`train.momentum=-0.5` is out of range"),
    (["train.weight_decay=-1"], "`train.weight_decay=-1.0` with train.lr=0.05"),
    (["train.weight_decay=20"], "(here lr x weight_decay = 1)"),
    (["train.weight_decay=nan"], "`train.weight_decay=nan` is not a finite number"),
    (["workload=lm", "workload.dropout=1"], "`workload.dropout=1.0` is out of range"),
    (["train.seed=-1"], "`train.seed=-1` is out of range; use 0 to 4,294,967,295"),
    (["train.seed=4294967296"], "`train.seed=4294967296` is out of range (a 32-bit seed)"),
    (["train.batch_size=0"], "`train.batch_size=0` is out of range; use 1 to 1,048,576"),
    (["train.batch_size=2097152"], "`train.batch_size=2097152` is out of range"),
    (["workload.image_size=4"], "`workload.image_size=4` is out of range; use 8 to 8,192"),
    (["workload=lm", "workload.vocab=1"], "`workload.vocab=1` is out of range"),
    (["workload=lm", "workload.seq_len=0"], "`workload.seq_len=0` is out of range"),
    (["workload=lm", "workload.heads=0"], "`workload.heads=0` is out of range"),
    (["workload=lm", "workload.d_model=0"], "`workload.d_model=0` is out of range"),
    (["workload=lm", "workload.layers=0"], "`workload.layers=0` is out of range"),
    (["workload.width=0"], "`workload.width=0` is out of range"),
    (["data.workers=1000"], "`data.workers=1000` is out of range; use 0 to 256"),
    (["data.prefetch=true", "data.prefetch_depth=0"], "`data.prefetch_depth=0` is out of range; use 1 to 4"),
    (["data.max_pixels=-1"], "`data.max_pixels=-1` is out of range; use 0 to 1,099,511,627,776"),
    (["data.prefetch=false", "data.prefetch_depth=2"],
     "data.prefetch_depth=2 is how far data.prefetch's thread prepares batches ahead, and data.prefetch=false: "
     "add data.prefetch=true, or drop data.prefetch_depth"),
    (["train.keep_checkpoints=0"], "`train.keep_checkpoints=0` is out of range"),
    (["telemetry.port=70000"], "is not a TCP port"),
    (["workload=lm", "workload.heads=7"], "workload.d_model=768 is not a multiple of workload.heads=7"),
    (["--config", "/nope.yaml"], "--config file /nope.yaml does not exist"),
    (["workload.vocab=5"], "unknown key `workload.vocab` in command line: workload `tiny` has the keys image_size, "
                           "num_classes, width, augment"),
    (["workload=lm", "workload.layer=5"], "did you mean `workload.layers`?"),
    (["workload=nosuchmodule:workload"], "no module `nosuchmodule` on the Python path"),
    (["workload=job.workloads.tiny:nope"], "job.workloads.tiny (job/workloads/tiny.py) has no attribute `nope`; it "
                                           "defines the Workload workload"),
    (["workload=job.workloads.tiny:Settings"], "is a type, not a job.workload.Workload"),
    (["workload=nosuchname"], "unknown workload `nosuchname`"),
    (["workload=lm", "data.kind=imagefolder"], "`data.kind=imagefolder` is not a kind workload `lm` reads; choose "
                                               "one of: synthetic, tokens"),
    (["data.path=/tmp"], "data.path=/tmp is set, and data.kind=synthetic ignores it: set data.kind=imagefolder"),
    (["workload=lm", "data.kind=tokens"], "data.kind=tokens reads data.path, which is empty"),
    (["workload=lm", "data.kind=tokens", "data.path=/nonexistent.bin"], "data.path /nonexistent.bin does not exist"),
    (["data.val_fraction=0.1"], "data.val_fraction holds part of data.path out, and data.kind=synthetic"),
    (["data.val_fraction=1.5"], "`data.val_fraction=1.5` is out of range"),
    (["train.gc_every=-1"], "`train.gc_every=-1` is out of range"),
    (["data.gpu_share=-0.2"], "`data.gpu_share=-0.2` is out of range; give the fraction of JPEG samples"),
    (["eval.every=-1"], "`eval.every=-1` is out of range"),
    (["stray"], "unexpected argument `stray`"),
]


@pytest.mark.parametrize("argv,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_clear_error(argv, expected):
    with pytest.raises(UsageError) as e:
        config.load(argv)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: [unclosed\n")
    with pytest.raises(UsageError, match="is not valid YAML"):
        config.load(["--config", str(f)])
    f.write_text("train:\n  stepz: 3\n")
    with pytest.raises(UsageError, match="unknown key `train.stepz`"):
        config.load(["--config", str(f)])


@pytest.mark.parametrize("argv,expected", [
    (["train", "train.batch_size=abc"], "error: `train.batch_size`"),
    (["train", "strategy=nope"], "error: unknown strategy `nope`"),
    (["frobnicate"], "error: unknown command `frobnicate`"),
    (["train", "strategy=ddp", "strategy.nprocs=3", "train.batch_size=2", "train.device=cpu"],
     "ddp: micro-batch 2 (train.batch_size / train.accum_steps) cannot give each of 3 ranks a sample"),
])
def test_cli_exit_2_one_line_no_traceback(argv, expected, tmp_path):
    p = subprocess.run(job_cmd(*argv, f"train.run_dir={tmp_path}") if argv[0] == "train" else job_cmd(*argv),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], p.stderr


def test_help_lists_every_key():
    p = subprocess.run(job_cmd("train", "--help"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for key in config.all_keys():
        assert f"{key}=" in p.stdout, key
    assert "Global batch per optimizer step" in p.stdout


def test_the_names_config_checks_are_the_registered_ones():
    """config.load checks strategy names without importing torch; they must be the registry's."""
    assert config.STRATEGY_NAMES == tuple(sorted(REGISTRY)), "add the new strategy to config.STRATEGY_NAMES"


def test_loading_a_config_does_not_import_torch():
    code = ("import sys; from job import config; config.load(['strategy=balanced', 'workload=lm']); "
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr
