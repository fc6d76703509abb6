"""The trainer, top to bottom: pick devices → build model, optimizer, strategy → resume → loop → close.

Everything strategy-specific sits behind job.strategies (setup / loss / backward_sync); the loop below
is the same for all of them. Interruptions (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) set a flag; the current step
finishes, every rank agrees to stop, a checkpoint is written, and the process exits 75 (a second Ctrl-C
stops at once, exit 130). A batch that cannot be made (a file that does not decode) stops every rank at the
last whole step with a checkpoint of it, exit 2. A rank that fails otherwise leaves through job.failure (one
line, no collective, abort); a loss or weights that stop being finite end the run without a checkpoint over the
last finite one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from job import breakdown, config, failure, launch, memplan, phases, recompute, report, rundir
from job import checkpoint as ckpt
from job import workload as wl
from job.cardgaps import CardGaps, Reading, idle_share
from job.config import summary
from job.data import BatchFailed, Data, SplitTuner, per_second, process_cpu_s, take_or_stop, thread_sched_s
from job.devices import usable_cores
from job.errors import EXIT_INTERRUPTED, EXIT_OK, PeerUsageError, UsageError
from job.evaluate import Evaluator
from job.models import human, param_count
from job.precision import Precision
from job.strategies import REGISTRY, graphs
from job.strategies import build as build_strategy

log = logging.getLogger("job")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# A log line names the share of its window the loop waited for batches from this much on (5 %): below it the
# wait is noise of the clock and the queue; above it the data path, not the model, sets the speed.
DATA_WAIT_SHOWN = 0.05
# The card idle between steps less than this share of the timed steps (and less than half the loop's wait): the
# card's queued work covered the loop's wait for data (CardGaps).
CARD_IDLE_SHOWN = 0.02
CORE_WAIT_SHOWN = 0.05  # the training thread ready to run but waiting for a core this share of the timed steps: said
_stop = threading.Event()
_stop_signal: list[int | None] = [None]


def request_stop(reason: str = "requested", signum: int | None = None) -> None:
    """Ask the running loop to finish its step, checkpoint and return 75 (signal handlers call this)."""
    if not _stop.is_set():
        log.warning("stop requested (%s): finishing the current step, then checkpointing", reason)
        _stop_signal[0] = signum
    _stop.set()


def stop_signal() -> int | None:
    """The signal that stopped the last run() (None if it ran to the end or was stopped by request_stop).

    job.submit uses it to requeue only on Slurm's preemption/time-limit signal (SIGUSR2), not on scancel.
    """
    return _stop_signal[0]


def _on_signal(signum, _frame) -> None:
    if signum == signal.SIGINT and _stop_signal[0] == signal.SIGINT:
        # The second Ctrl-C: the user does not want to wait for the step and the checkpoint.
        failure.stop_now("second Ctrl-C: stopped at once, without a checkpoint (the last one is kept)")
    if signum == signal.SIGINT and not _stop.is_set():
        log.info("Ctrl-C: press it again to stop at once, without a checkpoint")
    request_stop(signal.Signals(signum).name, signum)


def run(cfg) -> int:
    """Train per `cfg`; returns the process exit code (0, 75 after an interruption)."""
    env = launch.dist_env()
    if env is not None and env.world_size > 1 and not REGISTRY[cfg.strategy.name].multi_process:
        raise UsageError(
            f"strategy={cfg.strategy.name} runs one process that drives every card, but this process was started "
            f"as rank {env.rank} of WORLD_SIZE={env.world_size}: each rank would train on its own; start it once "
            "(torchrun --nproc-per-node=1, srun --ntasks=1) or use strategy=ddp"
        )
    if env is None and REGISTRY[cfg.strategy.name].multi_process:
        n = launch.nprocs_for(cfg, torch.cuda.device_count() if cfg.train.device != "cpu" else 0)
        if n > 1:
            # Refuse a batch that cannot be split before starting n processes that would each refuse it.
            build_strategy(cfg.strategy.name, strategy_cfg=cfg.strategy, devices=[torch.device("cpu")],
                           world_size=n, precision=Precision(cfg.train.amp)).check(micro_batch=cfg.train.batch_size // cfg.train.accum_steps)
            cfg.train.run_id = cfg.train.run_id or _new_run_id(cfg)
            return launch.spawn(cfg, n)
    env = env or launch.DistEnv(0, 1, 0)
    if env.world_size == 1:
        trainer = Trainer(cfg, env)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    # One of several ranks: an exception anywhere (building, training, the orderly close) ends this rank
    # through failure.fail: one line, no collective, abort, exit; the launcher and the peers do the rest.
    launch.die_with_launcher()
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        code = trainer.fit()
        trainer.close()
        return code
    except BaseException as e:
        failure.fail(e, env=env, device=trainer.device if trainer else _chosen_device(),
                     timeout_s=cfg.strategy.timeout_s,
                     cleanup=trainer.telemetry.close if trainer and trainer.telemetry else None,
                     log_dir=trainer.run_dir if trainer else None)


def _chosen_device():
    """The card this process set as current, if CUDA has started (a failure while the trainer is built)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if not torch.cuda.is_available() else None


def _new_run_id(cfg) -> str:
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy.name}-{wl.short_name(cfg.workload.name)}"
    run_id, n = base, 1
    while (Path(cfg.train.run_dir) / run_id).exists():
        n += 1
        run_id = f"{base}-{n}"
    return run_id


def _pick_devices(cfg, env: launch.DistEnv, multi_process: bool) -> list[torch.device]:
    want = cfg.train.device
    have = torch.cuda.is_available()
    if want == "cuda" and not have:
        raise UsageError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if want == "cpu" or not have:
        return [torch.device("cpu")]
    from job import devices

    devices.assert_cuda_env_unchanged()
    count = torch.cuda.device_count()
    if multi_process:
        index = env.local_rank if count > 1 else 0
        if index >= count:
            raise UsageError(
                f"LOCAL_RANK={env.local_rank} but only {count} CUDA device(s) are visible; start one rank per "
                "card or widen CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_device(index)
        picked = [torch.device("cuda", index)]
    else:
        picked = [torch.device("cuda", i) for i in range(count)]
    _cap_memory(cfg.memory.cap_gb, picked, count)
    return picked


def _cap_memory(cap_gb, picked: list[torch.device], count: int) -> None:
    """memory.cap_gb: the allocator refuses to grow past the cap on each card (the plan plans within it)."""
    if not cap_gb:
        return
    if len(cap_gb) not in (1, count):
        raise UsageError(f"memory.cap_gb has {len(cap_gb)} values for {count} visible card(s); give one for "
                         f"every card or one per card")
    for d in picked:
        cap = cap_gb[0] if len(cap_gb) == 1 else cap_gb[d.index]
        total = torch.cuda.get_device_properties(d).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total), d)


class Trainer:
    """One process's part of a training run (every rank builds one; `fit` trains it).

    Built in this order, each step needing the ones before: the workload and the devices, the process group
    and the strategy, the run id (rank 0's) and the run directory's handle, the model, the start-up checks
    (rank 0 takes the run's lock, picks the checkpoint to resume and checks it and the data; every rank gets
    its verdict), the strategy's wrapping and the optimizer, the resumed state, the memory plan, the batch
    stream, validation, the timing clock, the memory breakdown and telemetry. Nothing is written to the run
    directory before `fit` starts: a refused start leaves an existing run as it was.

    `fit` runs `_loop` (one step: `_step`; the measured window: `_Window`; logging and validation:
    `_log_if_due`; periodic checkpoints: `save_checkpoint`) and writes the summary; `step_hooks` are called
    with the step number after every optimizer step.
    """

    def __init__(self, cfg, env: launch.DistEnv):
        self.cfg, self.env = cfg, env
        t = cfg.train
        # The workload (job.workload): the user's code or a built-in, found by the name in the config.
        self.resolved = config.workload_of(cfg)
        self.workload, self.settings = self.resolved.workload, config.workload_settings(cfg)
        multi = REGISTRY[cfg.strategy.name].multi_process
        self.devices = _pick_devices(cfg, env, multi)
        self.device = self.devices[0]
        self.precision = Precision(t.amp, self.device.type)  # train.amp: autocast, loss scaler, fsdp's policy
        self.data = Data(self.resolved, self.settings, cfg.data, seed=t.seed, device=self.device)
        # Called with the step number after each optimizer step (and the strategy's on_step_end): the public
        # seam for code that watches training from the same process, e.g. bench.mode=profile's window.
        self.step_hooks: list = []
        if multi and env.world_size > 1:
            backend = cfg.strategy.backend
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            launch.init_group(env, backend=backend, device=self.device, timeout_s=cfg.strategy.timeout_s)
        self.strategy = build_strategy(cfg.strategy.name, strategy_cfg=cfg.strategy, devices=self.devices,
                                       rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                                       precision=self.precision)
        self.micro_batch = t.batch_size // t.accum_steps
        self.strategy.check(micro_batch=self.micro_batch)
        self.is_main = self.strategy.is_main
        if not self.is_main:
            log.setLevel(logging.WARNING)

        # Every rank needs the same run id: rank 0's wins.
        run_id = t.run_id or _new_run_id(cfg)
        self.run_id = self._from_rank0(run_id)
        cfg.train.run_id = self.run_id
        self.run_dir = Path(t.run_dir) / self.run_id
        self.ckpt_dir = self.run_dir / "checkpoints"
        # Rank 0's handle on the run directory; nothing on disk yet (_startup_checks takes its lock, and only
        # start-up that passes every check writes into it).
        self.rundir = rundir.RunDir(self.run_dir) if self.is_main else None

        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = t.cudnn_benchmark
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(_cpu_threads())
        if self.device.type == "cpu":
            self._check_host_memory()
        torch.manual_seed(t.seed)  # same initial weights on every rank
        model = self._build_model()
        self.blocks = self._blocks(model)
        if t.activation_checkpointing:
            recompute.checkpoint_blocks(self.blocks)
        if t.channels_last:  # only 4-D (convolution) weights change layout
            model = model.to(memory_format=torch.channels_last)
        self.model = self.strategy.to_device(model)
        self.step, self.sample_position = 0, 0  # samples consumed: the data stream's position
        self._saved_step = -1
        self._faults = failure.faults()  # the JOB_FAULT test hook; empty unless set
        self._loss_sum = torch.zeros((), device=self.device)  # this rank's loss since the last log line
        self._data_wait = 0.0  # seconds the loop waited for its next batch since the last log line
        self._ahead = None  # the next step's first micro-batch, taken before the stop vote (_fetch_ahead)
        self._bad_loss = False  # this rank has seen a loss that is not finite
        self._nonfinite: str | None = None  # why the run ended without a checkpoint over the last finite one
        self._finite_at = 0  # the last step whose loss was seen finite (every step on CPU, each log step on GPUs)
        # Weights are restored before the strategy wraps or replicates the model, the optimizer after
        # (its shape may depend on the strategy), RNG last.
        state, resume_path = self._startup_checks()
        self.resumed = resume_path is not None
        self.strategy.setup(self.model, self.workload.loss, compile=t.compile, blocks=self.blocks)
        self.optimizer = self.strategy.build_optimizer(self._optimizer)
        if state is not None:
            self._resume(state, resume_path)
        else:  # per-rank stream for dropout etc.; a resumed run restores its own
            torch.manual_seed(t.seed + 1 + env.rank)
        try:
            self.plan = self._plan_memory()
        except UsageError:  # no split fits: refused like any bad input, the run directory untouched
            if self.rundir is not None:
                self.rundir.refused()
            raise
        self.batches = _batches(self)
        self._stream_from = self.step  # the step the training stream started at (a resumed run's)
        self._workers_mark = _workers_cpu(self.batches)  # the log line's cores figure: _workers_cpu's mark
        self.evaluator = Evaluator(self.data, self.resolved, cfg.eval, strategy=self.strategy, device=self.device,
                                   micro_batch=self.micro_batch, channels_last=t.channels_last,
                                   precision=self.precision, steps=t.steps)
        self.gaps = CardGaps(self.device)  # the card's idle time between steps
        self._gaps_mark = self.gaps.read()  # the log line's card idle figure: CardGaps.read() at the last line
        if self.gaps.on and hasattr(self.batches, "watch_card"):  # data.decode=auto's lines say it too
            self.batches.watch_card(self.gaps.read)
        self.clock = _Clock(self.gaps)
        self.clock.on_pause = getattr(self.batches, "exclude", None)
        self.peaks_from = 0  # the per-card peaks cover the steps after this one (set by the loop)
        report.card_rows(self.devices, rank=env.rank)  # NVML start-up and card mapping, before any timing
        self.memory = breakdown.Memory(self.strategy, self.optimizer, rank=env.rank)  # every rank: gathers pids
        self.telemetry = None
        if cfg.telemetry.port:
            self.telemetry = self._start_telemetry()

    # -- building -------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        name = self.resolved.name
        model = wl.call(f"workload `{name}`: model()", self.workload.model, self.settings)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"workload `{name}`: model() returned a {type(model).__name__}, not a torch.nn.Module; "
                             "return the model itself")
        if not any(True for _ in model.parameters()):
            raise UsageError(f"workload `{name}`: model() returned a {type(model).__name__} with no parameters; "
                             "there is nothing to train")
        return model

    def _blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The workload's repeated blocks: fsdp's sharding units and what activation checkpointing wraps."""
        name = self.resolved.name
        if self.workload.blocks is None:
            if self.cfg.train.activation_checkpointing:
                raise UsageError(f"train.activation_checkpointing=true recomputes the workload's blocks, and workload "
                                 f"`{name}` names none; give Workload(blocks=lambda model: [...]) or drop it")
            return []
        blocks = list(wl.call(f"workload `{name}`: blocks()", self.workload.blocks, model))
        mine = {id(m) for m in model.modules()}
        bad = [b for b in blocks if not isinstance(b, torch.nn.Module) or id(b) not in mine]
        if bad:
            raise UsageError(f"workload `{name}`: blocks() returned {type(bad[0]).__name__} objects that are not "
                             "sub-modules of the model it was given; return the model's own blocks (e.g. "
                             "list(model.layers))")
        return blocks

    def _optimizer(self, params) -> torch.optim.Optimizer:
        t = self.cfg.train
        if t.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay,
                                     fused=self.device.type == "cuda")
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def _plan_memory(self) -> memplan.Plan:
        """Split each micro-batch over the cards from their free memory and the job's measured cost."""
        c, t = self.cfg, self.cfg.train
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None)
        planning = memplan.Context(
            micro_batch=self.micro_batch, accum_steps=t.accum_steps, margin_gb=c.memory.margin_gb,
            cap_gb=list(c.memory.cap_gb), loss_fn=self.workload.loss, precision=self.precision,
            run_dir=self.run_dir, make_batch=lambda b, d: self.data.probe_batch(b, d, channels_last=t.channels_last),
            optimizer_bytes=(lambda params: 0) if self.optimizer.state else
            (lambda params: memplan.optimizer_state_bytes(params, t.optimizer, t.momentum)),
            batches_ahead=_batches_ahead(c), key=_plan_key(c, self.env.world_size, self.micro_batch),
        )
        plan = self.strategy.plan_memory(planning)
        # Probes draw random inputs: the training stream must not depend on whether they ran.
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        how = "reused from " + str(self.run_dir / memplan.CACHE_NAME) if plan.reused else plan.mode
        if any(card.total for card in plan.cards):
            log.info("memory plan (%s): samples per micro-batch %s of %d\n%s", how, plan.sizes, self.micro_batch,
                     plan.table())
        elif len(plan.cards) > 1:
            log.info("memory plan (%s): samples per micro-batch %s of %d", how, plan.sizes, self.micro_batch)
        return plan

    def _check_plan(self) -> None:
        """After the first steps: each card's measured peak next to the prediction, logged and cached."""
        peaks = [torch.cuda.max_memory_allocated(d) + graphs.held_bytes(d.index) if d.type == "cuda" else None
                 for d in self.devices]
        # Every process's devices in rank order are the plan's cards in order (one per ddp rank, all of
        # balanced's in its one process).
        measured = [p for per_rank in self.strategy.all_gather_object(peaks) for p in per_rank]
        for card, peak in zip(self.plan.cards, measured, strict=True):
            card.measured_peak = peak
        if not self.is_main or not any(c.measured for c in self.plan.cards):
            return
        errors = [f"{c.label} {c.measured_peak / 1e9:.2f} GB measured / {c.predicted_peak / 1e9:.2f} predicted "
                  f"({(c.measured_peak / c.predicted_peak - 1) * 100:+.1f} %)"
                  for c in self.plan.cards if c.measured_peak is not None and c.predicted_peak]
        log.info("memory plan check after step %d: %s", self.step, "; ".join(errors))
        if self.plan.mode == "auto" or self.plan.reused:
            memplan.write_cache(self.run_dir, self.plan)

    def _start_telemetry(self):
        from job import telemetry

        tel = telemetry.TrainingTelemetry(
            self.cfg.telemetry, run=self.run_id, strategy=self.cfg.strategy.name, rank=self.env.rank,
            local_rank=self.env.local_rank, world_size=self.env.world_size, info=summary(self.cfg),
            device=self.device if self.device.type == "cuda" else None,
            plan=list(zip(self.devices, self.strategy.local_cards(self.plan))), memory=self.memory,
        )
        try:
            tel.start()
        except OSError as e:
            raise UsageError(
                f"cannot serve metrics on {self.cfg.telemetry.host}:{self.cfg.telemetry.port} ({e.strerror}); "
                "pick a free telemetry.port or 0 to turn it off"
            ) from None
        return tel

    # -- rank 0 decides -----------------------------------------------------------------------------
    def _from_rank0(self, value):
        """Rank 0's `value` on every rank (one all-gather, which every rank must reach; the others' values
        are not used)."""
        return self.strategy.all_gather_object(value)[0]

    def _refuse_on_every_rank(self, error: str | None) -> None:
        """Rank 0's refusal (from `_from_rank0`), or None: every rank stops with it, printed once (rank 0 raises
        UsageError, the others PeerUsageError). Every rank is here, so the group closes cleanly, no abort."""
        if error:
            launch.destroy_group()
            raise (UsageError if self.is_main else PeerUsageError)(error)

    def _check_host_memory(self) -> None:
        """Before a CPU run builds its model: refuse in one line, on every rank, a model whose weights,
        gradients and optimizer state alone exceed the host memory available (counted on the meta device,
        for every process on rank 0's host)."""
        c = self.cfg
        hosts = self.strategy.all_gather_object(socket.gethostname())
        error = None
        if self.is_main:
            with torch.device("meta"):
                params = param_count(self._build_model())
            error = memplan.host_shortfall(
                params=params, optimizer=c.train.optimizer, momentum=c.train.momentum, procs=hosts.count(hosts[0]),
                shards=self.env.world_size if c.strategy.name == "fsdp" else 1,
                available=memplan.available_host_bytes())
        self._refuse_on_every_rank(self._from_rank0(error))

    def _startup_checks(self) -> tuple[dict | None, Path | None]:
        """Rank 0 takes the run's lock, picks the checkpoint to resume and checks it and the data; every
        rank gets its verdict: one refusal printed once, and the same checkpoint loaded everywhere (ranks
        searching on their own could pick different ones). Nothing is written here: a refused command
        leaves an existing run as it was."""
        state, verdict = None, {"error": None, "path": None}
        if self.is_main:
            try:
                self.rundir.acquire()
                path = ckpt.find_resume(self.cfg.train.resume, self.ckpt_dir)
                if path is not None:
                    state = ckpt.load(path)
                    ckpt.check_fits(state, path, self.cfg)
                    ckpt.restore_model(self.model, state, path, self.cfg.workload.name)
                    verdict["path"] = str(path.absolute())  # ranks may run in other directories
                self.data.check()  # builds the data sets and reads a sample of each
                self._check_fit()
            except UsageError as e:
                verdict["error"] = str(e)
                self.rundir.refused()
        verdict = self._from_rank0(verdict)
        self._refuse_on_every_rank(verdict["error"])
        path = Path(verdict["path"]) if verdict["path"] else None
        if path is not None and not self.is_main:
            if not path.is_file():
                raise UsageError(
                    f"cannot see checkpoint {path}, which rank 0 resumes from; put train.run_dir on storage "
                    "that every node shares"
                )
            state = ckpt.load(path)
            ckpt.restore_model(self.model, state, path, self.cfg.workload.name)
        return state, path

    def _check_fit(self) -> None:
        """The model's output on three samples fits the workload's loss (and accuracy), and the loss's "sum" is
        3 x its "mean" (what makes every split exact): one line naming the workload if not, before anything is
        written. Eval mode and no gradients: no statistic, no RNG moves."""
        name, w, n = self.resolved.name, self.workload, 3
        device = next(self.model.parameters()).device  # fsdp's model is still on the CPU here
        x, y = self.data.probe_batch(n, device, channels_last=self.cfg.train.channels_last)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = wl.call(f"workload `{name}`: the model's forward on x of shape {tuple(x.shape)}", self.model, x)
                shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
                what = f"workload `{name}`: loss(output of shape {shape}, target of shape {tuple(y.shape)})"
                values = {}
                for reduction in ("mean", "sum"):
                    value = wl.call(f"{what}", w.loss, out, y, reduction=reduction)
                    if not (torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point()):
                        raise UsageError(f"{what} with reduction={reduction} gave "
                                         f"{tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}, "
                                         "not a floating-point scalar; reduce the per-sample losses to one number")
                    values[reduction] = float(value)
                if not math.isclose(values["sum"], n * values["mean"], rel_tol=1e-3, abs_tol=1e-6):
                    raise UsageError(f"{what}: reduction=sum gave {values['sum']:.6g} and reduction=mean "
                                     f"{values['mean']:.6g} for {n} samples; sum must be {n} x mean (one loss per "
                                     "sample, then their sum or mean): does the output's shape fit the target's?")
                if w.accuracy is not None:
                    pair = wl.call(f"workload `{name}`: accuracy(output, target)", w.accuracy, out, y)
                    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                        raise UsageError(f"workload `{name}`: accuracy(output, target) gave {type(pair).__name__}, "
                                         "not a pair (correct, counted)")
        finally:
            self.model.train(was_training)

    def _resume(self, state: dict, path: Path) -> None:
        try:
            self.strategy.load_optimizer_state_dict(self.optimizer, state["optimizer"])
        except (ValueError, KeyError) as e:
            raise UsageError(
                f"checkpoint {path} has optimizer state that does not fit train.optimizer="
                f"{self.cfg.train.optimizer} ({e}); keep the optimizer or set train.resume=overwrite"
            ) from None
        self.precision.load_state_dict(state.get("scaler"))
        t = self.cfg.train
        self.step = int(state["step"])
        if "sample_position" in state:
            self.sample_position = int(state["sample_position"])
        else:  # older checkpoints count micro-batches of the run that wrote them
            saved = state.get("config", {}).get("train", {})
            micro = int(saved.get("batch_size", t.batch_size)) // int(saved.get("accum_steps", t.accum_steps))
            self.sample_position = int(state["data_position"]) * micro
        rngs = state.get("rng") or []
        if len(rngs) == self.env.world_size:
            ckpt.set_rng_state(rngs[self.env.rank])
        else:
            torch.manual_seed(self.cfg.train.seed + 1 + self.env.rank + self.step)
        log.info("resumed from %s at step %d (sample %d)", path, self.step, self.sample_position)
        was, now = state.get("train_samples"), self._train_samples()
        if was is not None and now is not None and was != now:
            log.warning("data: the training set holds %s samples, and %s when %s was written: from here on the run "
                        "reads other samples than it would have (each epoch is a permutation of the set, and a file "
                        "added or removed moves the ids of the files after it)", f"{now:,}", f"{was:,}", path.name)

    def _train_samples(self) -> int | None:
        """The training set's size (None for synthetic data): a checkpoint keeps it, a resume compares."""
        return None if self.data.synthetic else len(self.data.train_set()[1])

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        if self.step >= t.steps:  # before any write: the finished run stays as it was
            log.info("run %s already finished: its checkpoint is at step %d, train.steps=%d; nothing to do",
                     self.run_id, self.step, t.steps)
            return EXIT_OK
        if self.is_main:  # the first write into the run directory: every check has passed
            from omegaconf import OmegaConf

            self.rundir.start_writing(resumed_step=self.step if self.resumed else None)
            self.rundir.write_text("config.yaml", OmegaConf.to_yaml(cfg))
        self.strategy.barrier()
        log.info("run %s: %s on %s, %s params, global batch %d (%d x %d micro-steps), %d steps -> %s",
                 self.run_id, cfg.strategy.name, _where(self.devices, self.env.world_size),
                 human(param_count(self.model)), t.batch_size, self.micro_batch, t.accum_steps, t.steps,
                 self.run_dir)

        handlers = _install_signal_handlers()
        try:
            try:
                with _collecting_every(t.gc_every) as settle:
                    stopped = self._loop(settle)
                if stopped or t.final_checkpoint or self._bad_loss:  # a bad loss is reported there, not written
                    self.save_checkpoint()  # still ours: a second Ctrl-C during the write leaves at once
            finally:
                _restore_signal_handlers(handlers)
        except ckpt.WriteFailed as e:
            return self._checkpoint_lost(e)
        if self._nonfinite:
            return self._report_nonfinite()
        if stopped:
            log.warning("stopped at step %d; checkpoint written; exit %d", self.step, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        self._finish()
        return EXIT_OK

    def _loop(self, settle) -> bool:
        """Train to train.steps, or until a rank is stopped (SIGTERM/SIGUSR1, a loss that is not finite): True
        when stopped early. One step: the arithmetic (`_step`), the window's bookkeeping, a log line (and
        validation) when due, telemetry, a periodic checkpoint when due, and the stop vote. `settle`: called
        once warm-up is over (_collecting_every's)."""
        t = self._train = _plain(self.cfg.train)
        window = _Window(self, warmup=t.timing_warmup, settle=settle)
        rank_samples = self.strategy.share(self.micro_batch)[1] * t.accum_steps
        self._logged_at, self._logged_step, self._last_loss = time.perf_counter(), self.step, float("nan")
        self._finite_at = self.step
        step_start = time.perf_counter()  # a step's time counts its wait for data (_fetch_ahead's too)
        while self.step < t.steps:
            try:
                self._step(poison=self._faults and failure.inject(self._faults, rank=self.env.rank,
                                                                  step=self.step + 1))
            except BatchFailed as f:  # every rank is here (a later micro-batch's vote), or there is one
                self._stop_on_data_error(f.error)
            self.gaps.ended()
            window.after_step(self.step)
            # Not finite: known for free on CPU, and after a device sync (log steps) on GPUs; every save
            # checks again with all ranks before writing.
            bad = self.device.type == "cpu" and not math.isfinite(self._loss_sum.item())
            if self.device.type == "cpu" and not bad:
                self._finite_at = self.step
            try:
                bad = self._log_if_due() or bad
            except BatchFailed as f:  # a held-out batch (Evaluator.run): every rank is here
                self._stop_on_data_error(f.error)
            self._bad_loss = self._bad_loss or bad
            if self.telemetry is not None:  # samples this rank trained on, so a sum over ranks is right
                self.telemetry.observe_step(time.perf_counter() - step_start, rank_samples, self._last_loss,
                                            self.gaps.so_far() if self.gaps.on else None)
            if t.gc_every and self.step % t.gc_every == 0:
                gc.collect()  # automatic collection is off in the loop (_collecting_every)
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.steps:
                self._sync()
                with self.clock.paused():
                    self.save_checkpoint()
                if self._nonfinite:
                    return True
            # The next step's first batch before the vote: a file that does not decode there stops every rank
            # at this step, with a checkpoint, instead of one rank failing alone inside the next step.
            step_start = time.perf_counter()
            failed = self._fetch_ahead() if self.step < t.steps else None
            if failed is None:
                self.gaps.started()
            # One collective per step: stop if any rank was asked to, saw a loss that is not finite (which of
            # the two, every rank learns in save_checkpoint), or could not read its next batch.
            if self.strategy.any(_stop.is_set() or bad or failed is not None):
                if self.strategy.any(failed is not None):
                    self._stop_on_data_error(failed)
                return self.step < t.steps
        return False

    def _next_batch(self):
        """This rank's next micro-batch (the one _fetch_ahead took, if any), its wait counted as the loop's."""
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
            return batch
        with phases.mark("data"):
            waiting = time.perf_counter()
            batch = next(self.batches)
            waited = time.perf_counter() - waiting
        self._data_wait += waited
        self.clock.add_wait(waited)
        return batch

    def _fetch_ahead(self) -> BaseException | None:
        """Take the next step's first micro-batch now (at the end of a step, before the stop vote); the
        exception that taking it raised, or None."""
        try:
            self._ahead = self._next_batch()
        except Exception as e:
            return e
        return None

    def _stop_on_data_error(self, error: BaseException | None) -> None:
        """A batch could not be made (a file that does not decode, the dataset's own error) on this rank, or
        (None) on another: every rank is here, after a whole step. Checkpoint that step, then stop with the
        failing rank's line plus where the run resumes; the other ranks stop quietly."""
        kept = None
        try:
            self.save_checkpoint()
        except ckpt.WriteFailed as e:
            kept = str(e)
        except Exception as e:  # the card itself failed (the batch's error may be the card's): say the first
            kept = f"{type(e).__name__}: {failure.first_line(e)}"
        again = f"the same command with train.run_id={self.run_id}"
        if self._saved_step == self.step:
            where = f"the run stopped at step {self.step} with a checkpoint there: {again} resumes from it"
        else:
            why = kept or (f"the loss on {self._nonfinite} is not finite" if self._nonfinite else "not written")
            last = ckpt.list_checkpoints(self.ckpt_dir)
            where = (f"the run stopped at step {self.step}, its checkpoint there not written ({why}): {again} "
                     f"resumes from {last[-1] if last else 'the start'}")
        if self.env.world_size > 1:
            launch.destroy_group()  # every rank got here together: the group closes cleanly, no abort
        if error is None:
            raise PeerUsageError(where)
        if isinstance(error, UsageError):
            raise UsageError(f"{error}; {where}") from None
        log.error("%s; the error follows", where)
        raise error

    def _step(self, *, poison: bool) -> None:
        """One optimizer step over train.accum_steps micro-batches (`poison`: a fault test's NaN loss); the loss
        is added to the sum since the last log line, and the step hooks are called."""
        t = self._train
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        # A micro-batch that cannot be made stops the run at the last whole step (_loop checkpoints it): the
        # weights are still those, and the random state is put back to the step's start (the micro-batches
        # before drew from it). Under several ranks every later micro-batch is voted on, so all stop together.
        rng = ckpt.rng_state() if t.accum_steps > 1 else None
        for micro in range(t.accum_steps):
            try:
                x, y = take_or_stop(self._next_batch, self.strategy, vote=micro > 0)
            except BatchFailed:
                if rng is not None:
                    ckpt.set_rng_state(rng)
                raise
            with self.strategy.backward_sync(micro == t.accum_steps - 1):
                with self.precision.autocast():
                    with phases.mark("forward+loss"):
                        loss = self.strategy.loss(x, y)
                    if poison:
                        loss = loss * float("nan")
                with phases.mark("backward"):
                    self.precision.backward(loss / t.accum_steps)
            self._loss_sum += loss.detach() / t.accum_steps
        if t.grad_clip:
            self.precision.unscale(self.optimizer)
            self.strategy.clip_grad_norm(t.grad_clip)
        with phases.mark("optimizer"):
            self.precision.step(self.optimizer)
        self.step += 1
        self.strategy.on_step_end(self.step)
        self.sample_position += t.batch_size
        for hook in self.step_hooks:
            hook(self.step)

    def _log_if_due(self) -> bool:
        """At a log step (train.log_every, the last step, an evaluation): the mean loss over the ranks since the
        last line, the throughput, validation when due, the log line; True when that loss is not finite."""
        t = self._train
        evaluating = self.evaluator.due(self.step)
        if not (self.step % t.log_every == 0 or self.step == t.steps or evaluating):
            return False
        # The cards' rows before the sync, while the card still runs the step: the host's allocator counts and
        # NVML already hold the step's memory, and the 1-2 ms they take on an H200's host overlap the card's
        # work instead of idling it. The loss and the rate need the sync.
        memory = self._memory_rows()
        self._sync()
        now = time.perf_counter()
        with self.clock.paused():
            steps = self.step - self._logged_step
            self._last_loss = self.strategy.mean(self._loss_sum.item() / steps)
            elapsed = now - self._logged_at
            rate, wait = steps * t.batch_size / elapsed, self._data_wait / elapsed
            val = self.evaluator.run(self.step) if evaluating else None  # weights and RNG left as they were
            card_every = self.cfg.telemetry.log_every or t.log_every
            self._log_step(self._last_loss, rate, wait, memory,
                           cards=self.step % card_every == 0 or self.step == t.steps, steps=steps, seconds=elapsed,
                           val=val)
        self._loss_sum.zero_()
        self._data_wait = 0.0
        self._logged_at, self._logged_step = time.perf_counter(), self.step
        if math.isfinite(self._last_loss):
            self._finite_at = self.step
            return False
        return True

    def _set_lr(self) -> None:
        t = self._train
        scale = min(1.0, (self.step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * scale

    def _sync(self) -> None:
        self.gaps.void()  # the card idles until the next step because of this sync, not for lack of input
        if self.device.type == "cuda":
            for d in self.devices:
                torch.cuda.synchronize(d)

    def _memory_rows(self) -> tuple[list[dict], list[dict]]:
        """Every rank's per-card rows and memory by kind, in rank order (one collective: every rank calls it)."""
        cards = report.card_rows(self.devices, rank=self.env.rank, plan_cards=self.strategy.local_cards(self.plan))
        ranks = self.strategy.all_gather_object((cards, self.memory.measure(peak=True)))
        return [r for mine, _ in ranks for r in mine], [r for _, kinds in ranks for r in kinds]

    def _log_step(self, loss: float, rate: float, wait: float, memory: tuple[list[dict], list[dict]], *, cards: bool,
                  steps: int, seconds: float, val: dict | None = None) -> None:
        """`wait`: the share of the window (`steps` steps, `seconds` long) this rank's loop spent waiting for its
        next batch (from DataLoader workers, the pinning thread, a file): the line says it from DATA_WAIT_SHOWN on,
        with the card's idle share between steps (CardGaps), metrics.jsonl always. `memory`: `_memory_rows()` at
        this step."""
        rows, kinds = memory
        if val is not None and self.telemetry is not None:
            self.telemetry.observe_validation(val)
        if not self.is_main:
            return
        unit = self.workload.unit
        k = self.workload.units(self.settings)
        counts = getattr(self.batches, "counts", None)  # a stream with DataLoader workers (job.data.Stream)
        made, taken = counts() if counts is not None else (None, None)
        mark, self._workers_mark = self._workers_mark, _workers_cpu(self.batches)
        busy = per_second(mark, self._workers_mark, 1)  # the workers' cores since the last line
        gaps, self._gaps_mark = self._gaps_mark, self.gaps.read()
        idle = idle_share(gaps, self._gaps_mark, steps=steps, seconds=seconds) if self.gaps.on else None
        waited = ""
        if wait >= DATA_WAIT_SHOWN:
            waited = f"  waited for data {wait:.0%}" + (f" (the card idle between steps {idle:.0%})" if idle is not None
                                                        else "")
            if busy is not None:  # all of them: the host's cores are the limit; fewer: the workers wait on something
                who, n = "its" if self.env.world_size == 1 else "rank 0's", self.batches.workers
                waited += f", {who} {n} worker{'s' if n != 1 else ''} busy on {busy:.1f} of {usable_cores()} cores"
        log.info("step %d/%d  loss %.4f  %s %s/s%s", self.step, self.cfg.train.steps, loss, f"{rate * k:,.0f}", unit,
                 waited)
        if cards and rows:
            log.info("%s", report.card_line(self.step, rows))
        if val is not None:
            log.info("%s", self.evaluator.line(val))
        record = {"step": self.step, "loss": loss, "samples_per_s": rate, f"{unit}_per_s": rate * k,
                  "data_wait": wait, "data_made": made, "data_taken": taken,
                  "data_gpu_share": getattr(self.batches, "gpu_share", None),
                  "data_cpu_s": self._workers_mark[1] if self._workers_mark is not None else None,
                  "train_thread_s": thread_sched_s(),  # [on a core, waiting for one], seconds so far (this thread's)
                  # the card's idle seconds between steps so far, and the steps they were measured on (CardGaps)
                  **(dict(card_idle_s=self._gaps_mark.seconds, card_gaps=self._gaps_mark.gaps) if self.gaps.on else {}),
                  "time": time.time(), "cards": rows, "memory_breakdown": kinds, **(val or {})}
        self.rundir.append_line("metrics.jsonl", json.dumps(record))

    def save_checkpoint(self) -> None:
        """Rank 0 writes; every rank learns whether it could (ckpt.WriteFailed on all ranks if not)."""
        if self._saved_step == self.step or self._nonfinite:  # nothing new, or nothing worth keeping
            return
        # Every rank says whether its loss and weights are finite in the gather the save needs anyway: a NaN
        # on any rank keeps the last finite checkpoint instead of writing over it.
        gathered = self.strategy.all_gather_object((ckpt.rng_state(), self._finite()))
        rngs = [rng for rng, _ in gathered]
        bad = [rank for rank, (_, ok) in enumerate(gathered) if not ok]
        if bad:
            self._nonfinite = f"rank {', '.join(map(str, bad))}"
            return
        failed = None
        full = self.strategy.checkpoint_state(self.optimizer)  # every rank: a sharded strategy gathers here
        if self.is_main:
            from omegaconf import OmegaConf

            state = {
                "model": full[0],
                "optimizer": full[1],
                "scaler": self.precision.state_dict(),
                "step": self.step,
                "sample_position": self.sample_position,
                "data_position": self.sample_position // self.micro_batch,  # micro-batches, for older readers
                "rng": rngs,
                "world_size": self.env.world_size,
                "train_samples": self._train_samples(),
                "config": OmegaConf.to_container(self.cfg),
            }
            try:
                path = ckpt.save(self.ckpt_dir, self.step, state, keep=self.cfg.train.keep_checkpoints)
                log.info("checkpoint %s", path)
            except ckpt.WriteFailed as e:
                failed = str(e)
        failed = self._from_rank0(failed)  # also the barrier: all ranks wait for the write
        if failed:
            raise ckpt.WriteFailed(failed)
        self._saved_step = self.step

    def _checkpoint_lost(self, e: Exception) -> int:
        """A checkpoint write failed (disk full...): stop, and say what is kept and what is lost.

        75 (try again) when an earlier checkpoint of this run exists: the same command resumes from it
        once there is space; 1 when there is none, as every step trained so far is lost."""
        kept = ckpt.list_checkpoints(self.ckpt_dir)
        if kept:
            since = ckpt.step_of(kept[-1])
            if self.is_main:
                log.error("error: %s; the run stopped at step %d and resumes from %s: steps %d-%d will be "
                          "trained again. Free space, then run the same command with train.run_id=%s; exit %d", e,
                          self.step, kept[-1], since + 1, self.step, self.run_id, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        if self.is_main:
            log.error("error: %s; no checkpoint of this run was kept, so the %d steps trained are lost. Free "
                      "space and start again; exit 1", e, self.step)
        return 1

    def _finite(self) -> bool:
        self._sync()
        if self._bad_loss or not math.isfinite(self._loss_sum.item()):
            return False
        with torch.no_grad():
            return bool(torch.stack([torch.isfinite(p).all() for p in self.strategy.local_parameters()]).all())

    def _report_nonfinite(self) -> int:
        if self.is_main:
            kept = ckpt.list_checkpoints(self.ckpt_dir)
            what = f"kept the last finite checkpoint {kept[-1]}" if kept else "no checkpoint was written"
            amp = " or train.amp=bf16 instead of fp16" if self.cfg.train.amp == "fp16" else ""
            # On GPUs the loss is read at log steps only: say where it was last seen finite.
            seen = (f"; last seen finite at step {self._finite_at}: a GPU run reads the loss every "
                    f"train.log_every={self.cfg.train.log_every} steps" if self._finite_at < self.step - 1 else "")
            log.error("error: the loss or the weights are no longer finite at step %d (%s%s); %s; lower train.lr "
                      "(now %g) or add train.warmup_steps%s, then run the same command with train.run_id=%s to "
                      "resume", self.step, self._nonfinite, seen, what, self.cfg.train.lr, amp, self.run_id)
        return failure.EXIT_CRASH

    def _restart_peaks(self) -> None:
        """The per-card peaks cover the steps after this one from here on."""
        _reset_peaks(self.devices)
        self.peaks_from = self.step

    def _finish(self) -> None:
        self._sync()
        t = self.cfg.train
        throughput = self.clock.rate(t.batch_size)
        rows, kinds = self._memory_rows()
        if not self.is_main:
            return
        k = self.workload.units(self.settings)
        rate = throughput * k if throughput is not None else None  # units/s
        unit = self.workload.unit
        wait, busy, own, split = self.clock.inputs()
        ran, waited = self.clock.host()
        card_idle = self.clock.card_idle()
        gpu_share = getattr(self.batches, "gpu_share", None)  # data.decode=auto's choice, at the end
        settled = getattr(self.batches, "settled_batch", None)  # None: no choice to make, or still choosing
        # every step after settled_step took only batches of the choice (a step takes accum_steps batches)
        settled_step = None if settled is None else self._stream_from + -(-settled // self._train.accum_steps)
        summary_doc = {
            "run_id": self.run_id, "steps": self.step, "strategy": self.cfg.strategy.name,
            "workload": self.cfg.workload.name, "world_size": self.env.world_size,
            "samples_per_s": throughput, f"{unit}_per_s": rate,
            "imbalance": report.imbalance(rows), "params": param_count(self.model),
            "peak_window": [self.peaks_from, self.step],  # peaks: steps after peaks_from up to here
            "validation": self.evaluator.last,  # the last evaluation's val_loss, val_accuracy, val_samples
            "data_wait": wait, "data_worker_cores": busy, "process_cores": own,  # rank 0's, over the timed steps
            # ... and where the wait went (InputTimings; shares of the timed steps' wall time)
            **dict(zip(("data_take", "data_move_wait", "data_move_busy"), split or (None, None, None))),
            "data_gpu_share": gpu_share, "data_auto_settled_step": settled_step,
            # rank 0's training thread over the timed steps: the share it ran on a core, and it waited for one
            "train_thread_on_core": ran, "train_thread_waited_for_core": waited,
            "card_idle_between_steps": card_idle,  # rank 0's card had nothing to run between steps (CardGaps)
            "cards": rows, "memory_breakdown": kinds,
        }
        self.rundir.write_text("summary.json", json.dumps(summary_doc, indent=2) + "\n")
        title = (f"per-card memory: {self.cfg.strategy.name}, {self.cfg.workload.name}, global batch "
                 f"{t.batch_size}, {self.step} steps (run {self.run_id}); peaks over steps {self.peaks_from + 1}-{self.step}")
        untimed = ("n/a (every step of this run was warm-up, which the throughput leaves out: run more steps, or "
                   "lower train.timing_warmup)")
        print(report.table(rows, throughput=untimed if rate is None else rate, unit=unit, title=title), flush=True)
        print(breakdown.table(kinds, title=f"memory by kind, GB (10^9 bytes), at the peak of steps "
                                           f"{self.peaks_from + 1}-{self.step} (docs/memory-breakdown.md)"), flush=True)
        if wait is not None and wait >= DATA_WAIT_SHOWN and not self.data.synthetic:
            # (synthetic samples are resident on the device: no reader to change, whatever the loop's own pace)
            log.info("%s", input_verdict(wait, busy, own, workers=getattr(self.batches, "workers", 0),
                                         cores=usable_cores(), ranks=self.env.world_size,
                                         gpu_share=gpu_share, choosing=gpu_share is not None and settled is None,
                                         split=split, prefetch=bool(self.cfg.data.prefetch), card_idle=card_idle,
                                         decode=self._decode()))
        if waited is not None and waited >= CORE_WAIT_SHOWN:
            log.info("%s", host_verdict(waited, ran, workers=getattr(self.batches, "workers", 0),
                                        nice=int(self.cfg.data.worker_nice), cores=usable_cores(),
                                        ranks=self.env.world_size))

    def _decode(self) -> tuple[str, float] | None:
        """data.decode and data.gpu_share where the run reads a folder of JPEGs on a GPU (the input line's
        advice offers the GPU decoder from them), else None."""
        if self.cfg.data.kind != "imagefolder" or self.device.type != "cuda":
            return None
        return str(self.cfg.data.decode), float(self.cfg.data.gpu_share)

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        self.strategy.teardown()
        self.data.close()
        stop = getattr(self.batches, "close", None)  # the training stream's workers (a generator's close: ends it)
        if stop is not None:
            stop()
        # This order exits cleanly; others aborted at exit in 4 runs of 10 (two gloo ranks, measured).
        del self.model, self.optimizer, self.batches
        gc.collect()
        launch.destroy_group()


def _plain(section):
    """A config section as a plain object for the training loop's reads: an OmegaConf attribute read costs
    about 12 µs on the 2-core development machine, and the loop made 17.5 of them a step (about 0.2 ms; on
    one H200's host the trainer's step was 0.1-0.2 ms longer than the hand-written loop's on `lm` and
    ResNet-50)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    return SimpleNamespace(**OmegaConf.to_container(section, resolve=True))


@contextlib.contextmanager
def _collecting_every(steps: int):
    """The training loop's garbage collection (train.gc_every): what start-up made is frozen and automatic
    collection is off, so no full collection of it lands in a step; the loop collects every `steps` steps.
    Yields `settle`, which the loop calls once its warm-up steps are done (a no-op with `steps` 0).
    Measured on a 2-core CPU (lm, 24 blocks, 1,490 steps): the trainer's one automatic full collection inside
    the timed steps took 198-225 ms; a hand-written loop, with fewer objects made per step, had none."""
    if not steps:
        yield lambda: None
        return

    def settle() -> None:
        """Collect once, then freeze what is left: at the loop's start (start-up's objects), and again when
        warm-up is over (what it made: torch.compile's graphs and guards, autotuning, CUDA graphs' records), so
        the loop's collections walk only what later steps make.
        Measured, compiled ResNet-18 on the 2-core development machine (cold compile cache): the first full
        collection after compiling took 751 ms, and each later one 282 ms (213k objects walked every time);
        after this, 0 ms. On one H200, compiled ResNet-50's 10-step window holding the loop's collection
        ran at a third of the others' speed after a cold compile, 6 % slower after a warm one."""
        gc.collect()
        gc.freeze()

    settle()
    was = gc.isenabled()
    gc.disable()
    try:
        yield settle
    finally:
        if was:
            gc.enable()
        gc.unfreeze()


class _Window:
    """The measured window of a run, decided step by step: where the per-card peaks restart, when the memory
    plan is checked, when the throughput clock starts and stops (what `after_step` does, each on its step).

    Peaks are reported over the steps after `trainer.peaks_from`: from the loop's start (not the memory plan's
    probes or the model's build), then over the timed steps, the same window for every strategy. The plan's
    check reads the peaks of steps 2-3 (the first step allocates and autotunes once) when the timed window
    starts later; else, and in a one-step run, of every step. A run whose steps are all warm-up keeps its
    peaks of every step and has no throughput. At the last warm-up step (the first step without warm-up),
    `settle` (train.gc_every's) collects and freezes what the steps so far made."""

    def __init__(self, trainer: Trainer, *, warmup: int, settle):
        self.tr, first, last = trainer, trainer.step, trainer.cfg.train.steps
        self.last, self.settle = last, settle
        self.warm = warmup if warmup >= 0 else min(10, max(1, (last - first) // 10))
        self.plan_reset, self.plan_check, self.warm_step = first + 1, first + 3, first + self.warm
        self.settle_step = self.warm_step if self.warm else first + 1  # compiling is done by then
        trainer._restart_peaks()
        if self.warm == 0:
            trainer.clock.start(first, _workers_cpu(trainer.batches))

    def after_step(self, step: int) -> None:
        tr = self.tr
        if step == self.plan_reset and self.warm and step < self.last:
            tr._restart_peaks()
        if step == self.plan_check or (step == self.last and step < self.plan_check):
            with tr.clock.paused():
                tr._check_plan()
        if step == self.settle_step and step < self.last:
            with tr.clock.paused():  # before the clock starts, unless there is no warm-up
                self.settle()
        if self.warm and step == self.warm_step and step < self.last:
            tr._sync()
            tr._restart_peaks()
            tr.clock.start(step, _workers_cpu(tr.batches))
        if step == self.last:
            tr._sync()
            tr.clock.stop(step, _workers_cpu(tr.batches))


class _Clock:
    """Training seconds between warm-up and the last step, minus logging and checkpoint writes (after a
    device sync, so no GPU work is left out): what the final throughput divides by. `gaps` (CardGaps) is read at
    its start and stop, and voided by its pauses."""

    def __init__(self, gaps: CardGaps | None = None):
        self.gaps = gaps
        self.card: list = [None, None]  # gaps.read() at start, stop (on a GPU)
        self.start_step = self.end_step = None
        self.t0 = self.t1 = self.excluded = 0.0
        self.waited = 0.0  # seconds the loop waited for batches in the timed steps
        self.workers: list = [None, None]  # _workers_cpu's marks (time, CPU seconds, InputTimings) at start, stop
        self.thread: list = [None, None]  # _thread_mark's (time, seconds on a core, seconds waiting for one)
        self.on_pause = None  # told the seconds of each pause (Stream.exclude: data.decode=auto's windows leave them out)

    def start(self, step: int, workers: tuple | None = None) -> None:
        self.start_step, self.t0 = step, time.perf_counter()
        self.workers[0], self.thread[0] = workers, _thread_mark()
        self.card[0] = self._card()

    def stop(self, step: int, workers: tuple | None = None) -> None:
        if self.start_step is not None:
            self.end_step, self.t1 = step, time.perf_counter()
            self.workers[1], self.thread[1] = workers, _thread_mark()
            self.card[1] = self._card()

    def _card(self) -> Reading | None:
        return self.gaps.read() if self.gaps is not None and self.gaps.on else None

    def add_wait(self, seconds: float) -> None:
        if self.start_step is not None and self.end_step is None:
            self.waited += seconds

    def inputs(self) -> tuple[float | None, float | None, float | None, tuple | None]:
        """(the share of the timed steps' seconds the loop waited for data, the cores the workers kept busy
        meanwhile, the cores this process did, and the shares of the timed steps' wall time spent taking batches
        from the workers, waiting for `move` and running it (InputTimings)); None where nothing was timed, or
        there are no CPU times or timings."""
        if self.start_step is None or self.end_step is None:
            return None, None, None, None
        seconds = self.t1 - self.t0 - self.excluded
        wait = self.waited / seconds if seconds > 0 else None
        a, b = self.workers
        split = tuple(per_second(a, b, k) for k in (3, 4, 5))
        return wait, per_second(a, b, 1), per_second(a, b, 2), None if None in split else split

    def host(self) -> tuple[float | None, float | None]:
        """(the share of the timed steps the training thread ran on a core, the share it was ready to run but
        waited for one: the host's other work had the cores); None without the kernel's scheduler statistics.
        Over the steps' wall time, pauses included (marks are taken on the training thread)."""
        a, b = self.thread
        return per_second(a, b, 1), per_second(a, b, 2)

    def card_idle(self) -> float | None:
        """The share of the timed steps the card had nothing to run between steps (CardGaps); None on a CPU, or
        where no step between log steps was timed."""
        if self.start_step is None or self.end_step is None:
            return None
        return idle_share(*self.card, steps=self.end_step - self.start_step, seconds=self.t1 - self.t0 - self.excluded)

    @contextlib.contextmanager
    def paused(self):
        if self.gaps is not None:
            self.gaps.void()
        t = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t
            if self.start_step is not None and self.end_step is None:
                self.excluded += seconds
            if self.on_pause is not None:
                self.on_pause(seconds)

    def rate(self, samples_per_step: int) -> float | None:
        """Samples per second over the timed steps; None when no step was timed (all were warm-up)."""
        if self.start_step is None or self.end_step is None or self.end_step <= self.start_step:
            return None
        seconds = self.t1 - self.t0 - self.excluded
        return (self.end_step - self.start_step) * samples_per_step / seconds if seconds > 0 else None


def host_verdict(waited: float, ran: float | None, *, workers: int, nice: int, cores: int, ranks: int = 1) -> str:
    """The run's line when its training thread (rank 0's) was ready to run but waited for a core `waited` of
    the timed steps (and ran `ran`): the thread that launches the model's kernels, or computes them on a CPU,
    lost that time to other work on the `cores` it may use: what that can be, and what gives the time back."""
    who = "the" if ranks == 1 else "rank 0's"
    line = (f"host: {who} training thread waited for a free core {waited:.0%} of the timed steps (ready to run, "
            f"not running)" + (f" and ran {ran:.0%}" if ran is not None else "")
            + f", on the {cores} core{'s' if cores != 1 else ''} it may use: other work there took its turns")
    if workers:
        return line + (f" (this process's other threads, its {workers} DataLoader worker{'s' if workers != 1 else ''}"
                       f" at nice {nice}, other processes); fewer workers (data.workers), a higher "
                       f"data.worker_nice, or more cores for the run (its CPU limit, Slurm's cpus-per-task) give "
                       f"it back")
    return line + " (this process's other threads, other processes); give the run cores of its own"


def input_verdict(wait: float, busy: float | None, own: float | None, *, workers: int, cores: int,
                  ranks: int = 1, gpu_share: float | None = None, choosing: bool = False,
                  split: tuple[float, float, float] | None = None, prefetch: bool = False,
                  card_idle: float | None = None, decode: tuple[str, float] | None = None) -> str:
    """The run's last line when its loop waited for data: rank 0's `wait` (a share of the timed steps), the
    cores its `workers` kept busy (`busy`) and its own process did (`own`), of the `cores` it may use (every
    rank taken to load the host as rank 0 does), and the share of the JPEGs data.decode=auto moved to the GPU
    (`gpu_share`; `choosing`: it was still trying shares when the run ended): what held the input up, and
    what to change. `split` (InputTimings' shares of the timed steps: taking batches from the workers,
    waiting for `move`, running it; `prefetch`: `move` ran on the prefetch thread) says where the wait went.
    `card_idle` (CardGaps: the share of the timed steps the card had nothing to run between steps) says what
    the wait cost: where the card's queued work covered it, the card, not the input, set the pace. `decode`
    (data.decode and data.gpu_share, for a folder of JPEGs) words the advice where the host's cores are the
    limit: the GPU decoder is offered only where the run did not already use it as far as it could."""
    line = f"input: the loop waited for data {wait:.0%} of the timed steps"
    if split is not None:
        take, move_wait, move_busy = split
        line += f" (taking batches from the workers {take:.0%}, moving them to the device {move_wait:.0%}"
        line += f"; the prefetch thread busy {move_busy:.0%})" if prefetch else ")"
    if card_idle is not None:
        line += f", and the card had nothing to run between steps {card_idle:.0%} of them"
    # The card's queued work covered the wait: the card (the model, and any decoding there), not the input, set the pace.
    covered = card_idle is not None and card_idle < CARD_IDLE_SHOWN and card_idle < wait / 2
    on = f" and decoding {SplitTuner.what(gpu_share).removesuffix(' on the GPU')}" if gpu_share and not choosing else ""
    card = (f": the card's queued work covered the wait, so the card (the model{on}), not the input, set the pace; "
            "more workers or cores would not train faster")
    if not workers:
        return line + ("; it reads its own data (data.workers=0)" + card if covered else
                       "; it reads its own data (data.workers=0): set data.workers to read and decode in parallel")
    if busy is None or own is None:
        return line + f"; how busy its {workers} workers were is unknown here (no /proc)" + (card if covered else "")
    who = "its" if ranks == 1 else "rank 0's"
    line += (f"; {who} {workers} worker{'s' if workers != 1 else ''} kept {busy:.1f} cores busy and the training "
             f"process {own:.1f}, of {cores}")
    if choosing:
        return line + (f"; data.decode=auto was still choosing where to decode when the run ended (trying "
                       f"{SplitTuner.what(gpu_share or 0.0)}), so its trials are in these steps: a longer run "
                       "chooses (within a few hundred steps), and data.decode=cpu or data.decode=gpu decides "
                       "for good")
    if gpu_share:
        line += f"; data.decode=auto put {SplitTuner.what(gpu_share)}, where it trained faster"
    if covered:
        return line + card
    if gpu_share:
        if gpu_share >= 1:
            return line + (": the GPU decoder, one batch at a time beside the model, is the limit (with more cores "
                           "per card the workers keep more of the JPEGs)")
        return line + (": the workers and the GPU decoder together are the limit (more cores per card, or smaller "
                       "files: python -m job.shrink)")
    if (busy + own) * ranks >= 0.85 * cores:
        return line + (": the host's cores are the limit (more cores per card, or smaller files: python -m job.shrink"
                       + _gpu_decoder_advice(decode) + ")")
    if busy >= 0.85 * workers:
        return line + ": every worker is busy and cores are left: raise data.workers"
    return line + ": the workers are idle part of the time, waiting on the disk or on the training process"


def _gpu_decoder_advice(decode: tuple[str, float] | None) -> str:
    """The part of input_verdict's advice that offers the GPU decoder where a host's cores are the limit, from
    the run's data.decode and data.gpu_share: data.decode=auto where the workers decoded every JPEG, or a
    share on the GPU it has not measured; nothing where data.decode=auto kept the workers (it measured the
    GPU decoder slower there), where every JPEG was on the GPU already, or where the data are not JPEGs."""
    if decode is None:
        return ""
    mode, share = decode
    if mode == "cpu":
        return ("; or data.decode=auto, which puts on the GPU the JPEGs the workers fall short of, where that "
                "trains faster")
    if mode == "gpu" and share < 1:
        return (f"; or data.decode=auto, which measures the GPU's share instead of the data.gpu_share={share:g} "
                "set")
    return ""


def _thread_mark() -> tuple | None:
    """(now, seconds the calling thread has run on a core, seconds it has waited for one), or None (no
    scheduler statistics here)."""
    sched = thread_sched_s()
    return (time.perf_counter(), *sched) if sched is not None else None


def _workers_cpu(batches) -> tuple | None:
    """(now, CPU seconds the stream's DataLoader workers have used, CPU seconds this process has used, and the
    stream's InputTimings: seconds taking batches, waiting for `move`, running `move`) where it has workers and
    /proc says (the timings None where the stream has none)."""
    read = getattr(batches, "worker_cpu_s", None)
    used = read() if read is not None else None
    own = process_cpu_s(os.getpid()) if used is not None else None
    timed = getattr(batches, "input_s", None)
    split = (timed() if timed is not None else None) or (None, None, None)
    return (time.perf_counter(), used, own, *split) if own is not None else None


def _batches(tr: Trainer):
    offset, count = tr.strategy.share(tr.micro_batch)
    return tr.data.batches(micro_batch=tr.micro_batch, start=tr.sample_position, offset=offset, count=count,
                           device=tr.device, channels_last=tr.cfg.train.channels_last, prefetch=tr.cfg.data.prefetch)


def _cpu_threads() -> int:
    """Threads for a CPU run: the machine's cores not fully busy (1-minute load average, the machine's), no
    more than the cores it may use (its affinity), at least 1, at most 4.

    A thread per core oversubscribes a loaded machine (a busy 2-core machine ran the default job several
    times slower), while an idle one is faster with every core; a small model gains nothing past 4."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(4, usable_cores(), math.ceil((os.cpu_count() or 1) - load)))


def _reset_peaks(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)


def _plan_key(cfg, world_size: int, micro_batch: int) -> dict:
    """Everything a cached memory plan depends on besides the cards (checked on resume)."""
    from omegaconf import OmegaConf

    t = cfg.train
    return {"strategy": cfg.strategy.name, "split": cfg.strategy.split, "gpu0_batch": cfg.strategy.gpu0_batch,
            "world_size": world_size, "micro_batch": micro_batch,
            "workload": OmegaConf.to_container(cfg.workload), "amp": t.amp,
            "activation_checkpointing": t.activation_checkpointing, "channels_last": t.channels_last,
            "compile": t.compile, "optimizer": t.optimizer, "momentum": t.momentum,
            "margin_gb": cfg.memory.margin_gb, "cap_gb": list(cfg.memory.cap_gb), "batches_ahead": _batches_ahead(cfg)}


def _batches_ahead(cfg) -> int:
    """Moved batches a card holds beside the one training: data.prefetch's thread makes the next
    data.prefetch_depth while it trains (without it, the next is moved once the step is queued, into
    memory the step freed). Synthetic data is drawn on the device, one batch at a time."""
    return int(cfg.data.prefetch_depth) if cfg.data.prefetch and cfg.data.kind != "synthetic" else 0


def _where(devices: list[torch.device], world: int) -> str:
    if devices[0].type == "cpu":
        return f"CPU x {world} process(es)" if world > 1 else "CPU"
    return f"{world} processes x 1 GPU" if world > 1 else f"{len(devices)} GPU(s)"


def _install_signal_handlers():
    if threading.current_thread() is not threading.main_thread():
        return {}
    _stop.clear()
    _stop_signal[0] = None
    return {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}


def _restore_signal_handlers(handlers) -> None:
    for s, h in handlers.items():
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(s, h)
