"""The typed config: schema, presets, loading and validation in one place.

Precedence (lowest first): schema defaults < conf/base.yaml < conf/strategy/<name>.yaml <
conf/workload/<name>.yaml < --config FILE < key=value overrides on the command line.

`strategy=<name>` and `workload=<name>` on the command line (or as plain strings at the top of a
--config file) pick a preset; `strategy.name=...` and `workload.name=...` set the field without
loading a preset. Everything else is an OmegaConf dotlist override, checked against the schema.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from job.errors import UsageError
from job.workload import MAX_PIXELS

CONF_DIR = Path(__file__).parent / "conf"


@dataclass
class StrategyCfg:
    name: str = "ddp"
    """Registered strategy: dp | balanced | ddp | fsdp (`python -m job train --help` lists them)."""
    split: str = "auto"
    """balanced/ddp/fsdp: samples of each micro-batch per card (balanced) or per rank (ddp, fsdp): auto (the
    memory plan: each card's free memory and the job's measured cost per sample; fsdp: even), even, or
    explicit shares in card/rank order like 4,12 (they must sum to the micro-batch)."""
    gpu0_batch: str = "auto"
    """balanced/ddp: card 0's (rank 0's) share alone, the others even: an int (samples; balanced allows 0 =
    GPU 0 only coordinates), a fraction in (0, 1), or auto (follow strategy.split)."""
    nprocs: int = 0
    """ddp/fsdp: processes to start when launched as a plain command (0 = one per visible GPU, 1 on CPU)."""
    backend: str = "auto"
    """ddp/fsdp: process-group backend: auto (nccl on GPUs, gloo on CPU) | nccl | gloo."""
    check_replicas_every: int = 0
    """balanced: every N steps, check that the replicas' weights are still identical (fails loudly if not;
    0: never)."""
    replica_threads: bool = True
    """balanced: run each extra card's forward in a persistent thread of its own (true: the cards start
    together; best when the GPUs, not Python, are the limit), or launch every card's forward from the main
    thread in turn (false: no hand-offs of Python's GIL between threads at every operation; faster when
    the step is short and Python-bound, e.g. deep, narrow LMs: docs/strategies.md)."""
    cuda_graphs: bool = False
    """balanced: capture each card's forward, loss and backward once as CUDA graphs and replay them (one
    launch per card instead of one per kernel: for short, Python-bound steps such as deep, narrow LMs;
    docs/strategies.md). Needs GPUs; not with train.compile."""
    bucket_mb: float = 25.0
    """balanced/ddp: size of the gradient buckets in MiB; each bucket is summed across the cards as soon as
    the backward has produced it, overlapping the rest of the backward."""
    find_unused_parameters: bool = False
    """ddp: let DDP tolerate parameters that get no gradient (slower)."""
    timeout_s: float = 300.0
    """ddp/fsdp: seconds a rank waits for the others (rendezvous, every collective, a checkpoint being written)
    before the job ends with a line naming the rank that did not answer; raise it for checkpoints that take
    longer to write (docs/failures.md)."""


@dataclass
class WorkloadCfg:
    name: str = "tiny"
    """The workload: a built-in (tiny | resnet50 | lm), an import path `module:attribute` of your own
    job.workload.Workload (or `file.py:attribute`), or a name in the `trainjob.workloads` entry-point group.
    The other workload.* keys are that workload's own settings (`workload=NAME --help` lists them)."""


@dataclass
class TrainCfg:
    steps: int = 200
    """Optimizer steps to run in total (a resumed run continues up to this count; one
    whose checkpoint is at or past it has nothing to do, exits 0 and is left untouched)."""
    batch_size: int = 64
    """Global batch per optimizer step, over all cards and micro-steps."""
    accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (DDP all-reduces only on the last)."""
    optimizer: str = "sgd"
    """sgd | adamw (a checkpoint written with the other one is refused on resume)."""
    lr: float = 0.05
    """Learning rate, above 0 and at most 100 (constant after warmup_steps of linear warm-up)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    momentum: float = 0.9
    """sgd momentum, 0 <= m < 1."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw), at least 0, with lr x weight_decay below 1."""
    grad_clip: float = 0.0
    """Clip gradients to this global L2 norm, as one process would, for every strategy (0: off)."""
    amp: str = "off"
    """Mixed precision: off | bf16 | fp16 (fp16 uses a GradScaler)."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward instead of storing them."""
    channels_last: bool = False
    """Image workloads: NHWC memory format for model and inputs."""
    compile: bool = False
    """torch.compile the model before the strategy wraps it."""
    cudnn_benchmark: bool = True
    """Let cuDNN autotune convolutions (dp/balanced turn it off: see their log line)."""
    seed: int = 0
    """Seed for weights and synthetic data."""
    device: str = "auto"
    """auto (all visible GPUs, else CPU) | cuda | cpu."""
    run_dir: str = "runs"
    """Parent folder of run directories."""
    run_id: str = ""
    """Run directory name under run_dir; empty: a new timestamped id. Reuse an id to resume; while a run
    holds its id (a lock in its directory, freed when it ends, even by kill -9), a second one is refused."""
    resume: str = "auto"
    """auto (latest checkpoint of this run id, if any) | never (start from step 0; refused if the run id
    already holds a run) | overwrite (start from step 0, replacing that run's checkpoints and metrics) | path
    to a checkpoint file. Chosen by rank 0 for every rank; loaded as tensors and plain data only (a file
    holding other objects is refused)."""
    checkpoint_every: int = 100
    """Write a checkpoint every N steps (0: only at the end and on interruption). A write that fails
    (disk full) stops the run: exit 75 if an earlier checkpoint is kept, else 1."""
    final_checkpoint: bool = True
    """Write a checkpoint when the run reaches train.steps (false: for measurements, e.g. the largest model
    that trains, that must not spend disk and minutes on one; a stopped run still writes its checkpoint)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run directory (oldest deleted first; at least 1)."""
    log_every: int = 20
    """Print a progress line every N steps."""
    gc_every: int = 50
    """Python's garbage collector while training: the objects made before the first step are frozen
    (gc.freeze) and automatic collection is off; a collection runs every N steps instead, over what the
    steps made since, which is little. What the warm-up steps made (train.compile's graphs) is collected
    and frozen too when warm-up ends. 0: Python collects when it likes: a full collection of a trainer's
    ~330k start-up objects took 200 ms on a 2-core CPU, and it can land in any step."""
    timing_warmup: int = -1
    """Steps left out of the final throughput and the per-card peaks (-1: min(10, a tenth of the run)); a run
    of no more steps than this reports no throughput."""


@dataclass
class DataCfg:
    kind: str = "synthetic"
    """synthetic (random samples from the workload's example_batch, resident on the device), or a kind the
    workload reads from data.path: imagefolder (tiny, resnet50), tokens (lm), or your workload's own kinds."""
    path: str = ""
    """Where the data is: imagefolder: a root with one sub-folder per class; tokens: a flat file of token ids;
    your workload's kinds: whatever its dataset() reads. Checked when the run starts (nothing is written
    before); a file that does not decode later stops the run with a line naming it, exit 2."""
    val_path: str = ""
    """Held-out data of the same kind, evaluated every eval.every steps and at the end (empty: none, unless
    data.val_fraction holds part of data.path out)."""
    val_fraction: float = 0.0
    """Fraction of data.path held out for validation (a fixed seeded choice of samples, never trained on);
    0: none. Not with data.val_path."""
    token_dtype: str = "uint16"
    """tokens: the file's token type, uint16 | uint32 (nanoGPT's train.bin is uint16)."""
    workers: int = 0
    """DataLoader worker processes for data read from files (0: read in the training process)."""
    worker_nice: int = 10
    """How much lower the workers' CPU priority is than the training process's (the nice value they add, 0-19).
    Where the workers keep every core busy, the training process's threads (the one that launches the GPU's
    kernels, the one that pins batches) then still run the moment they are ready. 0: the same priority. On one
    H200 with 16 cores, compiled ResNet-50 from JPEG files with 16 workers ran 6,543 img/s with 10, 4,465-5,937
    with 0 (docs/benchmarks.md)."""
    prefetch: bool = True
    """Data read from files: prepare the next batch while the current one trains: its copy to the GPU (on a side
    CUDA stream) and the dataset's to_device work (data.decode=gpu's decoding) run on a background thread
    (synthetic data lives on the device and has nothing to prepare). false: the training thread does both
    between steps. On one H100 with 16 cores, compiled ResNet-50 with half its JPEGs decoded on the card trained
    5,158 img/s with it and 4,753 without (3 repeats each, docs/benchmarks.md)."""
    prefetch_depth: int = 1
    """With data.prefetch: how many batches that thread prepares ahead (1-4), one after another. Each above 1
    holds one more batch on the device (ResNet-50 at batch 256: 154 MB; the memory plan counts every batch
    ahead in each card's share) and evens out preparations whose time varies from batch to batch. On one H200
    with 16 cores, compiled ResNet-50 from JPEGs trained no faster with 2 than with 1, the card busy between
    steps (docs/benchmarks.md)."""
    decode: str = "auto"
    """imagefolder: where JPEG files are decoded: cpu (the DataLoader workers, libjpeg-turbo), gpu (the
    training GPU, batched nvJPEG; the workers read the files, and decode the part data.gpu_share leaves
    them) or auto (gpu without workers on a CUDA device; with workers, cpu to begin with, and where the
    training loop waits for them, every JPEG moved to the GPU while the run trains, then a share on the GPU of
    what the workers fall short of (or in proportion to what each decoder made, where that is less), each kept
    only where it trained faster (a mix that would lose is
    timed for as long again first), one log line a step; docs/workloads.md). Either way a sample id gets the same crop; pixels differ by the
    decoders' rounding."""
    gpu_share: float = 1.0
    """imagefolder with data.decode=gpu: the fraction of the JPEG samples decoded on the GPU (fixed by sample
    id, spread evenly over every batch); the workers decode the rest at the same time. 1: all on the GPU.
    Where the workers are short of cores, data.decode=auto finds a share by itself: on 8 cores of an H200
    host with 7 workers it chose 0.7 for compiled ResNet-50, 2.5x the workers' rate alone (docs/benchmarks.md)."""
    max_pixels: int = MAX_PIXELS
    """imagefolder: the most pixels an image may have, read from its header before it is decoded (a file of a
    few KB can claim 65,500 x 65,500 pixels: 12.9 GB decoded, in a worker or on the card). A larger one stops
    the run like a damaged file, with a line naming it. The default is Pillow's own limit (537 MB decoded);
    0: no limit. `python -m job.shrink` makes a copy of a folder with every image small."""
    synthetic_pool: int = 64
    """synthetic: distinct samples generated once and cycled."""


@dataclass
class EvalCfg:
    every: int = 0
    """Evaluate the held-out data every N optimizer steps, and at the end (0: only at the end). With
    data.kind=synthetic and N > 0, a held-out pool of random samples is made from another seed."""
    samples: int = 0
    """Most held-out samples per evaluation, the first ones in a fixed order (0: all; synthetic: 256)."""
    batch_size: int = 0
    """Held-out samples per forward over all cards or ranks (0: the training micro-batch)."""


@dataclass
class MemoryCfg:
    margin_gb: float = 1.5
    """Memory plan: GB per card kept free at the predicted peak (fragmentation, cuDNN workspaces, NCCL)."""
    cap_gb: list[float] = field(default_factory=list)
    """GB this job may use per card, e.g. to share a card: [] none, [a] every card, [a, b, ...] one per
    visible card; enforced by the allocator and planned for."""


@dataclass
class TelemetryCfg:
    port: int = 0
    """Serve /metrics and /health on this port while training (0: off)."""
    host: str = "127.0.0.1"
    """Address the metrics server binds to."""
    log_every: int = 0
    """Log the per-card memory line every N steps (0: use train.log_every)."""
    peer_dir: str = ""
    """Where the local ranks register their loopback endpoints for local rank 0's merged /metrics: a
    folder trainjob-telemetry-<run>-<port> with mode 700 is made in it per job (empty: in $TMPDIR; must be
    shared by the ranks of a node)."""
    stall_s: int = 1800
    """/health answers 503 "stalled" when no optimizer step has completed for this many seconds (counted
    from the metrics server's start, so the first step's compile and memory probing count; 0: never)."""


@dataclass
class SubmitCfg:
    executor: str = "auto"
    """auto (slurm when sbatch exists, else local) | slurm | local."""
    nodes: int = 1
    """Slurm nodes (more than 1 needs a multi-process strategy: ddp)."""
    gpus_per_node: int = 2
    """GPUs requested per node (--gpus-per-node; 0: a CPU-only job)."""
    tasks_per_node: int = 0
    """Processes per node; 0: one per GPU for ddp (at least 1), always 1 for dp/balanced."""
    partition: str = ""
    """Slurm partition (empty: the cluster default)."""
    account: str = ""
    """Slurm account (empty: none)."""
    qos: str = ""
    """Slurm QOS (empty: none)."""
    timeout_min: int = 60
    """Wall-clock limit in minutes."""
    cpus_per_task: int = 2
    """CPUs per task."""
    mem_gb: int = 0
    """Memory per node in GB (0: the cluster default)."""
    signal_delay_s: int = 120
    """SIGUSR2 this many seconds before the time limit: checkpoint, then requeue."""
    max_requeues: int = 3
    """Times a preempted or timed-out job is requeued before it ends as failed."""
    folder: str = "runs/submitit/%j"
    """Where submitit writes the job pickles, sbatch script and logs (%j is the job id)."""
    wait: bool = False
    """Follow the job's log and exit with its exit code (0 done, 2 bad input, 75 stopped, 1 failed; job.status)."""
    dry_run: bool = False
    """Print the sbatch script (and Slurm's --test-only verdict when Slurm is here); submit nothing."""
    workdir: str = ""
    """The tasks' working directory (sbatch --chdir; empty: where you submit): the first entry of their Python
    path, so `workload=mymodule:workload` finds mymodule.py there. Must exist; made absolute at submission."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported in the job script before anything starts, taken literally, e.g.
    submit.env.PYTHONPATH=/home/me/proj (sbatch already passes on the environment you submit from)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job script runs before the tasks start, after submit.env, e.g. ["module load cuda/12.4",
    "source /home/me/venv/bin/activate"] (one line each; the tasks still run the Python you submit with)."""


@dataclass
class BenchCfg:
    strategies: list[str] = field(default_factory=lambda: ["dp", "balanced", "ddp"])
    """Strategy presets to compare, each in a fresh `python -m job train` process (unknown: refused)."""
    workloads: list[str] = field(default_factory=list)
    """Workloads to bench, one table each (empty: the config's workload, i.e. workload=...)."""
    steps: int = 50
    """Timed optimizer steps per run."""
    warmup: int = 10
    """Untimed steps before timing (at least 1: the first steps include CUDA/cuDNN start-up)."""
    baseline: str = "ddp"
    """Strategy preset of the 1-card baseline (first visible card, global batch / cards); none: no baseline."""
    cpu_procs: int = 2
    """No GPU visible: the ddp process count, standing in for the card count (dp runs one process)."""
    timeout_min: int = 30
    """Wall-clock limit per run; a run over it is stopped and reported as failed."""
    telemetry_overhead: bool = False
    """Also run bench.telemetry_strategy with telemetry.port off and on (scraped) and compare step time."""
    telemetry_strategy: str = "ddp"
    """Strategy preset of the telemetry on/off comparison."""
    telemetry_repeats: int = 1
    """Off/on pairs of the telemetry comparison (alternating; the medians are compared)."""
    scrape_interval_s: float = 1.0
    """Telemetry comparison: seconds between scrapes of /metrics while the run trains."""
    out: str = ""
    """Output folder (empty: <train.run_dir>/bench-<UTC timestamp>)."""
    mode: str = "compare"
    """compare (strategies side by side) | maxbatch (largest global batch per strategy) | profile (where a
    single-process strategy's step time goes, torch.profiler)."""
    repeats: int = 3
    """compare: runs of every row, the order rotated each repeat; the table shows median and min-max."""
    tenant_gb: float = 0.0
    """GB (1e9 bytes) another process holds on card 0 while the bench runs (the shared-card case); 0: none."""
    imagefolder: bool = False
    """compare: also run each strategy on JPEG files generated on disk (data.kind=imagefolder, DataLoader
    workers, pinned memory, data.prefetch), next to the synthetic rows; needs an image workload."""
    imagefolder_images: int = 5000
    """imagefolder: JPEG files to generate (ImageNet-like: 500 x 333-375 px, about 115 kB, 10 classes)."""
    imagefolder_short_side: int = 0
    """imagefolder: 0: the files are ImageNet-like (above); N (64 to 2048): each is that image resized to a
    short side of N px (bicubic, the same quality), as a folder resized once before training (python -m job.shrink
    makes such a copy of yours): how much smaller files raise the rate where the workers are short of cores."""
    imagefolder_dir: str = ""
    """imagefolder: where the files are generated and reused (empty: <train.run_dir>/bench-images, or
    bench-images-s<N> with bench.imagefolder_short_side=N); a folder holding files the bench did not generate is
    refused, never replaced."""
    imagefolder_variants: list[str] = field(default_factory=list)
    """imagefolder: more rows of each strategy on the same files, each with its own data settings (one string
    of space-separated data.KEY=VALUE, KEY one of decode, gpu_share, workers, worker_nice, prefetch, prefetch_depth), e.g.
    ["data.decode=gpu data.gpu_share=0.5", "data.decode=gpu"]: rows such as
    `ddp+imagefolder[decode=gpu gpu_share=0.5]`, each compared with the synthetic row and the plain
    imagefolder row, over the same steps and repeats: which way of decoding is fastest on this machine. Every
    row that reads files has data.prefetch=true; an entry that changes none of the plain row's data settings
    is refused."""
    auto_settle: bool = True
    """imagefolder on a GPU: rows with data.decode=auto (and workers) first train the steps its choice of decoder
    can take (data.decode=auto's trials, a few hundred steps), then bench.warmup and bench.steps: they time the
    rate a long run sustains; every other row of the workload trains as many steps first, so that all are timed
    over the same steps. false: their timed steps hold the trials, as a short run's do."""
    tokens: bool = False
    """compare: also run each strategy on a token file generated on disk (data.kind=tokens, memory-mapped,
    <train.run_dir>/bench-tokens), next to the synthetic rows; needs a token workload (lm)."""
    reference: bool = False
    """compare: also time a hand-written PyTorch loop of the same model, optimizer, precision, compile
    setting and batch on one card (row `loop`, job/bench/reference.py), the yardstick of one-card rows."""
    maxbatch_key: str = "train.batch_size"
    """maxbatch: what is searched: train.batch_size (the largest global batch) or workload.layers (the
    deepest lm that trains at the configured width and batch: the largest model)."""
    maxbatch_start: int = 0
    """maxbatch: first value tried (0: the config's train.batch_size or workload.layers); doubled until a
    trial does not fit."""
    maxbatch_steps: int = 3
    """maxbatch: optimizer steps per trial (the first is warm-up; peaks are taken over the others)."""
    maxbatch_trials: int = 12
    """maxbatch: most trials per strategy."""
    maxbatch_minutes: float = 30.0
    """maxbatch: most minutes per strategy's search (a trial is stopped when this runs out)."""
    maxbatch_precision: float = 0.05
    """maxbatch: stop bisecting once the gap between fits and too big is at most this fraction of the
    batch that fits (0: down to the granularity)."""
    profile_steps: int = 5
    """profile: steps profiled after bench.warmup."""
    profile_phases: bool = True
    """profile: time each phase of the step between device syncs (the phase table). false: no syncs inside the
    profiled steps, so the data path's thread and the card's streams overlap as when training, and the step
    time and what the card ran beside the model are as in an unprofiled run (no phase table)."""


@dataclass
class Config:
    strategy: StrategyCfg = field(default_factory=StrategyCfg)
    workload: WorkloadCfg = field(default_factory=WorkloadCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    data: DataCfg = field(default_factory=DataCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    memory: MemoryCfg = field(default_factory=MemoryCfg)
    telemetry: TelemetryCfg = field(default_factory=TelemetryCfg)
    submit: SubmitCfg = field(default_factory=SubmitCfg)
    bench: BenchCfg = field(default_factory=BenchCfg)


# Bounds a user does not reach on purpose: a value outside is a typo (an extra zero, a sign) that would
# otherwise fail deep in the run, or train on garbage. Each refusal names the range.
MAX_STEPS = 99_999_999  # checkpoint files are named step_XXXXXXXX.pt: 8 digits
LIMITS: dict[str, tuple[int, int]] = {
    "train.steps": (1, MAX_STEPS),
    "train.batch_size": (1, 2**20),
    "train.accum_steps": (1, 2**20),
    "train.warmup_steps": (0, MAX_STEPS),
    "train.checkpoint_every": (0, MAX_STEPS),
    "train.keep_checkpoints": (1, 1000),
    "train.log_every": (1, MAX_STEPS),
    "train.gc_every": (0, MAX_STEPS),
    "train.timing_warmup": (-1, MAX_STEPS),
    "train.seed": (0, 2**32 - 1),
    "strategy.nprocs": (0, 1024),
    "strategy.check_replicas_every": (0, MAX_STEPS),
    "data.workers": (0, 256),
    "data.worker_nice": (0, 19),
    "data.prefetch_depth": (1, 4),
    "data.max_pixels": (0, 2**40),
    "data.synthetic_pool": (1, 2**20),
    "eval.every": (0, MAX_STEPS),
    "eval.samples": (0, 2**31 - 1),
    "eval.batch_size": (0, 2**20),
    "telemetry.log_every": (0, MAX_STEPS),
    "telemetry.stall_s": (0, 10**7),
}
WHY = {
    "train.steps": " (checkpoint files hold the step in 8 digits)",
    "train.seed": " (a 32-bit seed)",
}

CHOICES = {
    "train.optimizer": ("sgd", "adamw"),
    "train.amp": ("off", "bf16", "fp16"),
    "train.device": ("auto", "cuda", "cpu"),
    "data.token_dtype": ("uint16", "uint32"),
    "data.decode": ("auto", "cpu", "gpu"),
    "strategy.backend": ("auto", "nccl", "gloo"),
    "submit.executor": ("auto", "slurm", "local"),
    "bench.mode": ("compare", "maxbatch", "profile"),
}
# A top-level key some commands accept as shorthand for a nested one.
ALIASES = {"strategies": "bench.strategies"}


def preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / kind).glob("*.yaml"))


# The names job.strategies.REGISTRY registers (a test keeps them equal), written out so that loading a
# config does not import torch: `status`, `submit` and `--help` start in a fraction of a second, and
# `make submit` works on a login node without a GPU build of torch. Workloads are found by job.workload,
# which imports no torch either (a user's own workload module may).
STRATEGY_NAMES = ("balanced", "ddp", "dp", "fsdp")


def _strategy_names() -> list[str]:
    return list(STRATEGY_NAMES)


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(candidates)}"


def all_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted."""
    from omegaconf import OmegaConf

    if node is None:
        node = OmegaConf.structured(Config)
    keys = []
    for k in node.keys():
        child = node[k]
        dotted = f"{prefix}{k}"
        if OmegaConf.is_dict(child):
            keys += all_keys(child, dotted + ".")
        else:
            keys.append(dotted)
    return keys


def _read_yaml(path: Path, what: str):
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not path.is_file():
        raise UsageError(f"{what} {path} does not exist; pass an existing YAML file")
    try:
        node = OmegaConf.load(path)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, OSError) as e:
        raise UsageError(f"{what} {path} is not valid YAML ({_first_line(e)}); fix the file") from None
    if not OmegaConf.is_dict(node):
        raise UsageError(f"{what} {path} must hold a mapping of config sections, not a list or scalar")
    return node


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _merge(base, other, source: str):
    """Merge `other` into the structured `base`, turning OmegaConf's errors into one clear line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = str(e.full_key or e.key or "?")
        if key.startswith("workload."):
            keys = [k for k in base.workload.keys() if k != "name"]
            close = difflib.get_close_matches(key.split(".", 1)[1], keys, n=1, cutoff=0.6)
            hint = f"did you mean `workload.{close[0]}`? " if close else ""
            raise UsageError(f"unknown key `{key}` in {source}: workload `{base.workload.name}` has the keys "
                             f"{', '.join(keys)}; {hint}(its settings dataclass defines them)") from None
        raise UsageError(f"unknown key `{key}` in {source}; {_suggest(key, all_keys(base))}") from None
    except ValidationError as e:
        key = e.full_key or e.key or "?"
        expected = type(OmegaConf.select(base, str(key))).__name__ if OmegaConf.select(base, str(key)) is not None else "?"
        raise UsageError(
            f"`{key}` in {source} has the wrong type ({_first_line(e)}); give a value of type {expected}"
        ) from None
    except OmegaConfBaseException as e:
        raise UsageError(f"cannot apply {source}: {_first_line(e)}") from None


def split_args(argv: list[str]) -> tuple[Path | None, list[str], bool]:
    """--config FILE, key=value overrides, and whether --help was asked for."""
    config_file, overrides, want_help = None, [], False
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            want_help = True
        elif arg == "--config":
            nxt = next(it, None)
            if nxt is None:
                raise UsageError("--config needs a file: --config my.yaml")
            config_file = Path(nxt)
        elif arg.startswith("--config="):
            config_file = Path(arg.split("=", 1)[1])
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise UsageError(f"unexpected argument `{arg}`; give --config FILE and key=value overrides")
    return config_file, overrides, want_help


def load(argv: list[str]):
    """Build, merge and validate the config for one command invocation (argv after the command)."""
    from omegaconf import OmegaConf

    config_file, overrides, _ = split_args(argv)
    user_file = _read_yaml(config_file, "--config file") if config_file else OmegaConf.create({})
    picks, dotlist = _picks(overrides, user_file)

    base = _read_yaml(CONF_DIR / "base.yaml", "preset")
    layers = [(base, "conf/base.yaml")]
    strategy = picks.get("strategy", OmegaConf.select(base, "strategy.name", default="ddp"))
    if strategy not in preset_names("strategy"):
        raise UsageError(f"unknown strategy `{strategy}`; choose one of: {', '.join(preset_names('strategy'))}")
    layers.append((_read_yaml(CONF_DIR / "strategy" / f"{strategy}.yaml", "preset"), f"conf/strategy/{strategy}.yaml"))
    workload = picks.get("workload", OmegaConf.select(base, "workload.name", default="tiny"))
    if workload in preset_names("workload"):
        layers.append((_read_yaml(CONF_DIR / "workload" / f"{workload}.yaml", "preset"),
                       f"conf/workload/{workload}.yaml"))
    else:  # not a preset: the workload itself (built-in, import path, entry point), with its defaults
        layers.append((OmegaConf.create({"workload": {"name": workload}}), f"workload={workload}"))
    name = _workload_name([*layers, (user_file, "")], dotlist)
    if "workload" not in picks and OmegaConf.select(layers[-1][0], "workload.name") != name:
        # The default preset is for another workload than the one --config or workload.name= sets (a spawned
        # rank's resolved config): its keys are not this workload's.
        layers.pop()
    layers.append((user_file, f"--config {config_file}"))
    cfg = OmegaConf.structured(Config)
    cfg.workload = workload_section(name)
    for node, source in layers:
        cfg = _merge(cfg, node, source)
    cfg = _merge(cfg, _parse_dotlist(cfg, dotlist), "command line")
    # YAML 1.1 reads a bare `off`/`no`/`false` as a boolean; for train.amp it can only mean off.
    if cfg.train.amp == "False":
        cfg.train.amp = "off"
    validate(cfg)
    return cfg


def _workload_name(layers, dotlist: list[str]) -> str:
    """workload.name as the merge will leave it: the last layer (or `workload.name=` override) that sets it."""
    from omegaconf import OmegaConf

    name = "tiny"
    for node, _source in layers:
        value = OmegaConf.select(node, "workload.name", default=None)
        if value is not None:
            name = str(value)
    for item in dotlist:
        key, value = item.split("=", 1)
        if key == "workload.name":
            name = value.strip("'\"")
    return name


def workload_section(name: str):
    """The typed `workload` section of the workload called `name`: its `name` and its own settings' fields
    (unknown keys and wrong types are then refused like any other key's)."""
    import dataclasses

    from omegaconf import OmegaConf

    from job import workload as wl

    _refuse_control("workload.name", name)  # before it is imported or named in a message of its own
    resolved = wl.resolve(name)
    cls = WorkloadCfg
    if resolved.workload.settings is not None:
        cls = dataclasses.make_dataclass(f"Workload[{name}]", [], bases=(resolved.workload.settings, WorkloadCfg))
    try:
        section = OmegaConf.structured(cls)
    except Exception as e:  # a settings type OmegaConf cannot hold (e.g. a tensor, an arbitrary class)
        raise UsageError(f"workload `{name}`: its settings cannot be config keys ({_first_line(e)}); use int, "
                         "float, bool, str, lists of those, or enums") from None
    section.name = name
    return section


def workload_of(cfg):
    """The job.workload.Resolved workload of a loaded config."""
    from job import workload as wl

    return wl.resolve(cfg.workload.name)


def workload_settings(cfg):
    """The workload's settings object (its `settings` dataclass filled from workload.*), or None."""
    from job import workload as wl

    return wl.settings_object(workload_of(cfg).workload, cfg.workload)


def _picks(overrides: list[str], user_file) -> tuple[dict[str, str], list[str]]:
    """The presets picked ({"strategy"|"workload": name}: `workload=lm-24x384` on the command line, else a
    plain string at the top of the --config file, which is taken out of it) and the other overrides."""
    picks: dict[str, str] = {}
    dotlist = []
    for item in overrides:
        key, value = item.split("=", 1)
        key = ALIASES.get(key, key)
        if key in ("strategy", "workload"):
            picks[key] = value
        else:
            dotlist.append(f"{key}={value}")
    for kind in ("strategy", "workload"):
        if isinstance(user_file.get(kind), str):
            picks.setdefault(kind, user_file[kind])
            user_file.pop(kind)
    return picks, dotlist


def preset_picks(argv: list[str]) -> dict[str, str]:
    """The presets argv picks by name (see `_picks`); a kind it does not pick is absent. The config itself
    records only what a preset sets (`workload.name` is `lm` for every lm preset)."""
    from omegaconf import OmegaConf

    config_file, overrides, _ = split_args(argv)
    user_file = _read_yaml(config_file, "--config file") if config_file else OmegaConf.create({})
    return _picks(overrides, user_file)[0]


def _parse_dotlist(cfg, dotlist: list[str]):
    """key=value overrides. A value for a string field is taken as written (YAML would turn `off`
    into False and `1e3` into a float); other values are parsed as YAML, as OmegaConf does."""
    from omegaconf import OmegaConf

    parsed, raw = [], {}
    for item in dotlist:
        key, value = item.split("=", 1)
        if isinstance(OmegaConf.select(cfg, key, default=None), str):
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            raw[key] = value
        else:
            parsed.append(item)
    try:
        cli = OmegaConf.from_dotlist(parsed)
    except Exception as e:
        raise UsageError(f"cannot parse overrides {parsed}: {_first_line(e)}; write key=value") from None
    for key, value in raw.items():
        OmegaConf.update(cli, key, value, force_add=True)
    return cli


def validate(cfg) -> None:
    """Checks that need more than the schema's types; each failure names the fix."""
    from omegaconf import OmegaConf

    _check_strings(cfg)  # first: every later check reads values, and an interpolation may not resolve

    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise UsageError(f"`{key}={value}` is not valid; choose one of: {', '.join(choices)}")
    if cfg.strategy.name not in _strategy_names():
        raise UsageError(
            f"unknown strategy `{cfg.strategy.name}`; choose one of: {', '.join(_strategy_names())}"
        )
    t = cfg.train
    for key, (low, high) in LIMITS.items():
        value = OmegaConf.select(cfg, key)
        if not low <= value <= high:
            why = WHY.get(key, "") if value > high else ""
            raise UsageError(f"`{key}={value}` is out of range{why}; use {low:,} to {high:,}")
    _check_floats(cfg)
    if not (0 <= t.grad_clip < float("inf")):
        raise UsageError(f"`train.grad_clip={t.grad_clip}` must be a finite norm >= 0 (0: no clipping)")
    m = cfg.memory
    if not (0 <= m.margin_gb < 1e4):
        raise UsageError(f"`memory.margin_gb={m.margin_gb}` must be between 0 and 10000 (GB kept free per card)")
    if any(not (0 < c < 1e4) for c in m.cap_gb):
        raise UsageError(f"`memory.cap_gb={list(m.cap_gb)}` must hold GB per card, each above 0; [] for no cap")
    if not 0 < cfg.strategy.bucket_mb <= 65536:  # also refuses nan
        raise UsageError(f"`strategy.bucket_mb={cfg.strategy.bucket_mb:g}` must be a size in MiB above 0 and at most "
                         "65536 (25 is DDP's default)")
    if not 0 < cfg.strategy.timeout_s < 1e6:  # also refuses nan
        raise UsageError(f"`strategy.timeout_s={cfg.strategy.timeout_s}` must be a number of seconds above 0")
    _check_cuda_graphs(cfg)
    if cfg.data.prefetch_depth > 1 and not cfg.data.prefetch:
        raise UsageError(f"data.prefetch_depth={cfg.data.prefetch_depth} is how far data.prefetch's thread prepares "
                         "batches ahead, and data.prefetch=false: add data.prefetch=true, or drop data.prefetch_depth")
    if not 0 <= cfg.telemetry.port <= 65535:
        raise UsageError(f"`telemetry.port={cfg.telemetry.port}` is not a TCP port; use 1-65535, or 0 for off")
    if t.batch_size % t.accum_steps:
        raise UsageError(
            f"global batch {t.batch_size} is not a multiple of train.accum_steps={t.accum_steps}; "
            f"use a batch size of {t.accum_steps}·k"
        )
    from job import workload as wl

    resolved = workload_of(cfg)
    wl.check_settings(resolved, cfg.workload)
    _check_data(cfg, resolved)
    if t.run_id and (os.sep in t.run_id or t.run_id in (".", "..")):
        raise UsageError(f"train.run_id `{t.run_id}` must be a plain name, not a path")


def _check_floats(cfg) -> None:
    """NaN, inf and out-of-range rates: they would poison the weights at the first step."""
    t = cfg.train
    floats = {"train.lr": t.lr, "train.momentum": t.momentum, "train.weight_decay": t.weight_decay,
              "data.val_fraction": cfg.data.val_fraction, "data.gpu_share": cfg.data.gpu_share}
    for key, value in floats.items():
        if not math.isfinite(value):
            raise UsageError(f"`{key}={value}` is not a finite number; {FLOAT_RANGES[key]}")
    if not 0 < t.lr <= 100:
        raise UsageError(f"`train.lr={t.lr}` is out of range; {FLOAT_RANGES['train.lr']}")
    if not 0 <= t.momentum < 1:
        raise UsageError(f"`train.momentum={t.momentum}` is out of range; {FLOAT_RANGES['train.momentum']}")
    if not 0 <= cfg.data.val_fraction < 1:
        raise UsageError(f"`data.val_fraction={cfg.data.val_fraction}` is out of range; "
                         f"{FLOAT_RANGES['data.val_fraction']}")
    if not 0 <= cfg.data.gpu_share <= 1:
        raise UsageError(f"`data.gpu_share={cfg.data.gpu_share}` is out of range; {FLOAT_RANGES['data.gpu_share']}")
    if t.weight_decay < 0 or t.lr * t.weight_decay >= 1:
        raise UsageError(
            f"`train.weight_decay={t.weight_decay}` with train.lr={t.lr}: {FLOAT_RANGES['train.weight_decay']} "
            f"(here lr x weight_decay = {t.lr * t.weight_decay:g})"
        )


def _check_cuda_graphs(cfg) -> None:
    if not cfg.strategy.cuda_graphs:
        return
    if cfg.strategy.name != "balanced":
        raise UsageError(f"strategy.cuda_graphs=true is balanced's (one process launching every card's work); "
                         f"strategy={cfg.strategy.name} does not use it: drop it or use strategy=balanced")
    if cfg.train.compile:
        raise UsageError("strategy.cuda_graphs=true and train.compile=true both rebuild the step; keep one of them")
    if cfg.train.device == "cpu":
        raise UsageError("strategy.cuda_graphs=true needs CUDA cards, and train.device=cpu; drop one of them")


FLOAT_RANGES = {
    "train.lr": "give a learning rate above 0 and at most 100, e.g. 0.05",
    "train.momentum": "give a value from 0 up to (not including) 1, e.g. 0.9",
    "train.weight_decay": "weight decay must be at least 0 and lr x weight_decay below 1 (each step scales "
                          "the weights by 1 - lr x weight_decay)",
    "data.val_fraction": "give the fraction of data.path to hold out, from 0 (none) up to (not including) 1",
    "data.gpu_share": "give the fraction of JPEG samples data.decode=gpu decodes on the GPU, from 0 to 1 "
                      "(the workers decode the rest)",
}


def _check_data(cfg, resolved) -> None:
    """data.kind is one the workload reads; data.path is given exactly where the kind reads one."""
    d, name = cfg.data, cfg.workload.name
    kinds = resolved.workload.kinds()
    if d.kind not in kinds:
        if d.kind == "synthetic":
            raise UsageError(f"workload `{name}` has no example_batch, so data.kind=synthetic has nothing to "
                             f"draw from; set data.kind={kinds[0]} data.path=... (it reads: {', '.join(kinds)})")
        raise UsageError(f"`data.kind={d.kind}` is not a kind workload `{name}` reads; choose one of: "
                         f"{', '.join(kinds)}")
    if d.kind == "synthetic":
        for key in ("path", "val_path"):
            if d[key]:
                others = [k for k in kinds if k != "synthetic"]
                fix = (f"set data.kind={'|'.join(others)} to read it" if others else
                       f"workload `{name}` reads no files")
                raise UsageError(f"data.{key}={d[key]} is set, and data.kind=synthetic ignores it: {fix}, or "
                                 f"drop data.{key}")
        if d.val_fraction:
            raise UsageError("data.val_fraction holds part of data.path out, and data.kind=synthetic reads no "
                             "data.path; use eval.every=N for a held-out synthetic pool, or read files")
        return
    if not d.path:
        raise UsageError(f"data.kind={d.kind} reads data.path, which is empty; set data.path=FILE_OR_FOLDER")
    for key in ("path", "val_path"):
        if d[key] and not Path(d[key]).exists():
            raise UsageError(f"data.{key} {d[key]} does not exist (working directory {os.getcwd()}); give an "
                             "existing file or folder")
    if d.val_path and d.val_fraction:
        raise UsageError("data.val_path and data.val_fraction both choose the held-out data; set one of them")


def help_text(argv: list[str] | None = None) -> str:
    """`python -m job train [workload=NAME] --help`: every key, its default and its doc line (the workload's
    own keys for the workload that argv picks)."""

    from job import workload as wl

    docs: dict[str, str] = {}
    for cls in (StrategyCfg, WorkloadCfg, TrainCfg, DataCfg, EvalCfg, MemoryCfg, TelemetryCfg, SubmitCfg, BenchCfg):
        docs.update({f"{cls.__name__}.{k}": v for k, v in wl.settings_docs(cls).items()})
    from omegaconf import OmegaConf

    base = OmegaConf.structured(Config)
    argv = [a for a in (argv or []) if a not in ("-h", "--help")]
    config_file, overrides, _ = split_args(argv)
    user_file = _read_yaml(config_file, "--config file") if config_file else OmegaConf.create({})
    picked = _picks(overrides, user_file)[0].get("workload", "tiny")
    if picked in preset_names("workload"):
        picked = OmegaConf.select(_read_yaml(CONF_DIR / "workload" / f"{picked}.yaml", "preset"), "workload.name")
    base.workload = workload_section(picked)
    settings_cls = wl.resolve(picked).workload.settings
    if settings_cls is not None:
        docs.update({f"WorkloadCfg.{k}": v for k, v in wl.settings_docs(settings_cls).items()})
    sections = {f.name: f.type for f in Config.__dataclass_fields__.values()}
    lines = [
        "usage: python -m job train|bench|export|submit [--config FILE] [key=value ...]",
        "",
        f"presets: strategy=<{'|'.join(preset_names('strategy'))}>  workload=<{'|'.join(preset_names('workload'))}>"
        "  (or workload=module:attribute, your own job.workload.Workload)",
        f"workload.* below: the keys of workload `{picked}` (workload=NAME --help shows another's)",
        "precedence: schema defaults < conf/base.yaml < strategy preset < workload preset < --config < key=value",
        "",
    ]
    for section, cls in sections.items():
        cls_name = cls if isinstance(cls, str) else cls.__name__
        lines.append(f"{section}:")
        for key in base[section].keys():
            default = OmegaConf.to_container(base[section])[key]
            lines.append(f"  {section}.{key}={default}")
            doc = docs.get(f"{cls_name}.{key}")
            bounds = LIMITS.get(f"{section}.{key}")
            if bounds:  # what validate() accepts, so the help and the refusal never disagree
                doc = f"{doc or ''} [accepted: {bounds[0]:,} to {bounds[1]:,}]".strip()
            if doc:
                lines.append(f"      {doc}")
    return "\n".join(lines)


def summary(cfg) -> dict[str, str]:
    """The few fields that identify a run (the info metric, the table header)."""
    return {
        "strategy": cfg.strategy.name,
        "workload": cfg.workload.name,
        "batch_size": str(cfg.train.batch_size),
        "accum_steps": str(cfg.train.accum_steps),
        "amp": cfg.train.amp,
    }


# -- values that reach scripts, file names and labels (docs/security.md) -----------------------------------
# C0 controls, DEL, and what Python's splitlines and YAML also take for a line break: a newline in
# submit.folder wrote lines of its own into the sbatch script; in a run id, a directory named with a newline.
_CONTROL = __import__("re").compile("[\x00-\x1f\x7f\x85\u2028\u2029]")


def _refuse_control(key: str, value: str) -> None:
    if m := _CONTROL.search(value):
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise UsageError(f"`{key}` holds a control character ({m.group()!r} in {shown!r}); it would reach "
                         "a script, a file name or a label: remove it")
NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, NFS)
PATH_MAX = 4096  # bytes in a path (Linux)
# The longest name the trainer makes in a run directory: checkpoints/.step_XXXXXXXX.pt.tmp.<pid>.
_LONGEST_RUN_FILE = len("/checkpoints/.step_00000000.pt.tmp.4194304")


def _check_strings(cfg) -> None:
    """Every value resolves (an interpolation naming a missing key is one line, not OmegaConf's exception);
    no string holds a control character; train.run_id and train.run_dir can be names on disk."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    raw = OmegaConf.to_container(cfg, resolve=False)
    for key in _leaf_keys(raw):
        try:
            value = OmegaConf.select(cfg, key)
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as e:
            written = raw
            for part in key.split("."):
                written = written.get(part) if isinstance(written, dict) else written
            raise UsageError(f"`{key}={written}` cannot be resolved ({_first_line(e)}); write the value itself, or "
                             "interpolate a key that exists, e.g. ${train.run_dir}") from None
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                _refuse_control(key, item)
    _check_run_path(cfg.train.run_dir, cfg.train.run_id)


def _leaf_keys(node: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def _check_run_path(run_dir: str, run_id: str) -> None:
    """The run directory `<run_dir>/<run_id>` can be made: names short enough, no file in the way."""
    if run_id and len(run_id.encode()) > NAME_MAX:
        raise UsageError(f"train.run_id is {len(run_id.encode())} bytes long and a file name holds at most "
                         f"{NAME_MAX}; use a shorter run id")
    path = Path(run_dir).expanduser().absolute()
    for part in path.parts:
        if len(part.encode()) > NAME_MAX:
            raise UsageError(f"train.run_dir has a folder name of {len(part.encode())} bytes (`{part[:40]}...`) and a "
                             f"file name holds at most {NAME_MAX}; use a shorter train.run_dir")
    longest = len(str(path).encode()) + 1 + len((run_id or "x" * 64).encode()) + _LONGEST_RUN_FILE
    if longest > PATH_MAX:
        raise UsageError(f"train.run_dir is {len(str(path).encode())} bytes long: with the run id and "
                         f"`{_LONGEST_RUN_FILE} bytes of checkpoints/...` its files' paths reach {longest} bytes, "
                         f"above the system's {PATH_MAX}; use a shorter train.run_dir")
    target = path / run_id if run_id else None
    if target is not None and target.exists() and not target.is_dir():
        raise UsageError(f"the run directory {target} is a file, not a folder; pick another train.run_id or "
                         "train.run_dir")
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        where = f"{path} is a file" if p == path else f"{path} cannot be made: {p} is a file"
        raise UsageError(f"train.run_dir {where}, not a folder; set train.run_dir to a folder (or a path where one "
                         "can be made)")
