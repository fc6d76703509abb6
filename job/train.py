"""The trainer, top to bottom: pick devices → build model, optimizer, strategy → resume → loop → close.

Everything strategy-specific sits behind job.strategies (setup / loss / backward_sync); the loop below
is the same for all of them. Interruptions (SIGTERM, SIGUSR1, SIGUSR2) set a flag; the current step
finishes, every rank agrees to stop, a checkpoint is written, and the process exits 75.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import signal
import threading
import time
from pathlib import Path

import torch

from job import checkpoint as ckpt
from job import launch, report, rundir
from job.config import summary
from job.errors import EXIT_INTERRUPTED, EXIT_OK, PeerUsageError, UsageError
from job.models import WORKLOADS, human, param_count
from job.strategies import REGISTRY
from job.strategies import build as build_strategy

log = logging.getLogger("job")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
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
    request_stop(signal.Signals(signum).name, signum)


def run(cfg) -> int:
    """Train per `cfg`; returns the process exit code (0, 75 after an interruption)."""
    env = launch.dist_env()
    if env is None and REGISTRY[cfg.strategy.name].multi_process:
        n = launch.nprocs_for(cfg, torch.cuda.device_count() if cfg.train.device != "cpu" else 0)
        if n > 1:
            # Refuse a batch that cannot be split before starting n processes that would each refuse it.
            build_strategy(cfg.strategy.name, strategy_cfg=cfg.strategy, devices=[torch.device("cpu")],
                           world_size=n).check(micro_batch=cfg.train.batch_size // cfg.train.accum_steps)
            cfg.train.run_id = cfg.train.run_id or _new_run_id(cfg)
            return launch.spawn(cfg, n)
    trainer = Trainer(cfg, env or launch.DistEnv(0, 1, 0))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _new_run_id(cfg) -> str:
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy.name}-{cfg.workload.name}"
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
        return [torch.device("cuda", index)]
    return [torch.device("cuda", i) for i in range(count)]


class Trainer:
    def __init__(self, cfg, env: launch.DistEnv):
        self.cfg, self.env = cfg, env
        t, w = cfg.train, cfg.workload
        self.spec = WORKLOADS[w.name]
        multi = REGISTRY[cfg.strategy.name].multi_process
        self.devices = _pick_devices(cfg, env, multi)
        self.device = self.devices[0]
        if multi and env.world_size > 1:
            backend = cfg.strategy.backend
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            launch.init_group(env, backend=backend, device=self.device)
        self.strategy = build_strategy(cfg.strategy.name, strategy_cfg=cfg.strategy, devices=self.devices,
                                       rank=env.rank, world_size=env.world_size, local_rank=env.local_rank)
        self.micro_batch = t.batch_size // t.accum_steps
        self.strategy.check(micro_batch=self.micro_batch)
        self.is_main = self.strategy.is_main
        if not self.is_main:
            log.setLevel(logging.WARNING)

        # Every rank needs the same run id: rank 0's wins.
        run_id = t.run_id or _new_run_id(cfg)
        self.run_id = self.strategy.all_gather_object(run_id)[0]
        cfg.train.run_id = self.run_id
        self.run_dir = Path(t.run_dir) / self.run_id
        self.ckpt_dir = self.run_dir / "checkpoints"

        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = t.cudnn_benchmark
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(t.seed)  # same initial weights on every rank
        model = self.spec.build(w, activation_checkpointing=t.activation_checkpointing)
        if t.channels_last and self.spec.is_image:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.amp == "fp16")
        self.step, self.data_position = 0, 0
        self._saved_step = -1
        # Weights are restored before the strategy wraps or replicates the model, the optimizer after
        # (its shape may depend on the strategy), RNG last.
        self.strategy.run_dir = self.run_dir
        state, resume_path = self._startup_checks()
        self.resumed = resume_path is not None
        self.strategy.setup(self.model, self.spec.loss, compile=t.compile)
        self.optimizer = self.strategy.build_optimizer(self._optimizer)
        if state is not None:
            self._resume(state, resume_path)
        else:  # per-rank stream for dropout etc.; a resumed run restores its own
            torch.manual_seed(t.seed + 1 + env.rank)
        self.batches = _batches(self)
        self.clock = _Clock()
        report.card_rows(self.devices, rank=env.rank)  # NVML start-up and card mapping, before any timing
        self.telemetry = None
        if cfg.telemetry.port:
            self.telemetry = self._start_telemetry()

    # -- building -------------------------------------------------------------------------------
    def _optimizer(self, params) -> torch.optim.Optimizer:
        t = self.cfg.train
        if t.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay,
                                     fused=self.device.type == "cuda")
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def _start_telemetry(self):
        from job import telemetry

        tel = telemetry.TrainingTelemetry(
            self.cfg.telemetry, run=self.run_id, strategy=self.cfg.strategy.name, rank=self.env.rank,
            local_rank=self.env.local_rank, world_size=self.env.world_size, info=summary(self.cfg),
            device=self.device if self.device.type == "cuda" else None,
        )
        try:
            tel.start()
        except OSError as e:
            raise UsageError(
                f"cannot serve metrics on {self.cfg.telemetry.host}:{self.cfg.telemetry.port} ({e.strerror}); "
                "pick a free telemetry.port or 0 to turn it off"
            ) from None
        return tel

    def _startup_checks(self) -> tuple[dict | None, Path | None]:
        """Rank 0 takes the run's lock, picks the checkpoint to resume and checks it and the data; every
        rank gets its verdict: one refusal printed once, and the same checkpoint loaded everywhere (ranks
        searching on their own could pick different ones). Nothing is written here: a refused command
        leaves an existing run as it was."""
        self.rundir = rundir.RunDir(self.run_dir) if self.is_main else None
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
                if self.cfg.data.kind == "imagefolder":
                    from job.data import check_imagefolder

                    check_imagefolder(self.cfg.data.path, num_classes=self.cfg.workload.num_classes)
            except UsageError as e:
                verdict["error"] = str(e)
                self.rundir.refused()
        verdict = self.strategy.all_gather_object(verdict)[0]
        if verdict["error"]:
            launch.destroy_group()  # every rank is here: a clean exit, not an abort
            raise (UsageError if self.is_main else PeerUsageError)(verdict["error"])
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

    def _resume(self, state: dict, path: Path) -> None:
        try:
            self.strategy.load_optimizer_state_dict(self.optimizer, state["optimizer"])
        except (ValueError, KeyError) as e:
            raise UsageError(
                f"checkpoint {path} has optimizer state that does not fit train.optimizer="
                f"{self.cfg.train.optimizer} ({e}); keep the optimizer or set train.resume=never"
            ) from None
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        rngs = state.get("rng") or []
        if len(rngs) == self.env.world_size:
            ckpt.set_rng_state(rngs[self.env.rank])
        else:
            torch.manual_seed(self.cfg.train.seed + 1 + self.env.rank + self.step)
        log.info("resumed from %s at step %d (data position %d)", path, self.step, self.data_position)

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
                stopped = self._loop()
            finally:
                _restore_signal_handlers(handlers)
            self.save_checkpoint()
        except ckpt.WriteFailed as e:
            return self._checkpoint_lost(e)
        if stopped:
            log.warning("stopped at step %d; checkpoint written; exit %d", self.step, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        self._finish()
        return EXIT_OK

    def _loop(self) -> bool:
        t = self.cfg.train
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.amp)
        log_every = t.log_every
        card_every = self.cfg.telemetry.log_every or t.log_every
        samples_per_step = t.batch_size
        rank_samples = self.strategy.local_batch(self.micro_batch) * t.accum_steps
        warm = t.timing_warmup if t.timing_warmup >= 0 else min(10, max(1, (t.steps - self.step) // 10))
        warm_step = self.step + warm
        if warm == 0:
            self.clock.start(self.step)
        window_start, window_steps = time.perf_counter(), 0
        loss_sum = torch.zeros((), device=self.device)
        last_loss = float("nan")
        while self.step < t.steps:
            step_start = time.perf_counter()
            self._set_lr()
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(t.accum_steps):
                x, y = next(self.batches)
                with self.strategy.backward_sync(micro == t.accum_steps - 1):
                    with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss = self.strategy.loss(x, y)
                    self.scaler.scale(loss / t.accum_steps).backward()
                loss_sum += loss.detach() / t.accum_steps
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step += 1
            self.data_position += t.accum_steps
            self.strategy.on_step_end(self.step)
            window_steps += 1

            if warm and self.step == warm_step:
                self._sync()
                self.clock.start(self.step)
            if self.step == t.steps:
                self._sync()
                self.clock.stop(self.step)
            if self.step % log_every == 0 or self.step == t.steps:
                self._sync()
                now = time.perf_counter()
                with self.clock.paused():
                    last_loss = self.strategy.mean(loss_sum.item() / window_steps)
                    rate = window_steps * samples_per_step / (now - window_start)
                    self._log_step(last_loss, rate, cards=self.step % card_every == 0 or self.step == t.steps)
                loss_sum.zero_()
                window_start, window_steps = now, 0
            if self.telemetry is not None:  # samples this rank trained on, so a sum over ranks is right
                self.telemetry.observe_step(time.perf_counter() - step_start, rank_samples, last_loss)
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.steps:
                self._sync()
                with self.clock.paused():
                    self.save_checkpoint()
            if self.strategy.any(_stop.is_set()):
                return self.step < t.steps
        return False

    def _set_lr(self) -> None:
        t = self.cfg.train
        scale = min(1.0, (self.step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * scale

    def _sync(self) -> None:
        if self.device.type == "cuda":
            for d in self.devices:
                torch.cuda.synchronize(d)

    def _rows(self) -> list[dict]:
        rows = report.card_rows(self.devices, rank=self.env.rank)
        return [r for per_rank in self.strategy.all_gather_object(rows) for r in per_rank]

    def _log_step(self, loss: float, rate: float, *, cards: bool) -> None:
        rows = self._rows()
        if not self.is_main:
            return
        unit = self.spec.unit
        k = self.spec.units_per_sample(self.cfg.workload)
        log.info("step %d/%d  loss %.4f  %s %s/s", self.step, self.cfg.train.steps, loss, f"{rate * k:,.0f}", unit)
        if cards and rows:
            log.info("%s", report.card_line(self.step, rows))
        record = {"step": self.step, "loss": loss, "samples_per_s": rate, f"{unit}_per_s": rate * k,
                  "time": time.time(), "cards": rows}
        self.rundir.append_line("metrics.jsonl", json.dumps(record))

    def save_checkpoint(self) -> None:
        """Rank 0 writes; every rank learns whether it could (ckpt.WriteFailed on all ranks if not)."""
        if self._saved_step == self.step:  # a stop right after a periodic checkpoint: nothing new
            return
        rngs = self.strategy.all_gather_object(ckpt.rng_state())
        failed = None
        if self.is_main:
            from omegaconf import OmegaConf

            state = {
                "model": self.model.state_dict(),
                "optimizer": self.strategy.optimizer_state_dict(self.optimizer),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "step": self.step,
                "data_position": self.data_position,
                "rng": rngs,
                "world_size": self.env.world_size,
                "config": OmegaConf.to_container(self.cfg),
            }
            try:
                path = ckpt.save(self.ckpt_dir, self.step, state, keep=self.cfg.train.keep_checkpoints)
                log.info("checkpoint %s", path)
            except ckpt.WriteFailed as e:
                failed = str(e)
        failed = self.strategy.all_gather_object(failed)[0]  # also the barrier: all ranks wait for the write
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
                          "trained again. Free space, then run the same command; exit %d", e, self.step,
                          kept[-1], since + 1, self.step, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        if self.is_main:
            log.error("error: %s; no checkpoint of this run was kept, so the %d steps trained are lost. Free "
                      "space and start again; exit 1", e, self.step)
        return 1

    def _finish(self) -> None:
        self._sync()
        t = self.cfg.train
        throughput = self.clock.rate(t.batch_size)
        rows = self._rows()
        if not self.is_main:
            return
        k = self.spec.units_per_sample(self.cfg.workload)
        unit = self.spec.unit
        summary_doc = {
            "run_id": self.run_id, "steps": self.step, "strategy": self.cfg.strategy.name,
            "workload": self.cfg.workload.name, "world_size": self.env.world_size,
            "samples_per_s": throughput, f"{unit}_per_s": throughput * k, "imbalance": report.imbalance(rows),
            "cards": rows,
        }
        self.rundir.write_text("summary.json", json.dumps(summary_doc, indent=2) + "\n")
        title = (f"per-card memory: {self.cfg.strategy.name}, {self.cfg.workload.name}, global batch "
                 f"{t.batch_size}, {self.step} steps (run {self.run_id})")
        print(report.table(rows, throughput=throughput * k, unit=unit, title=title), flush=True)

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        self.strategy.teardown()
        # DESIGN.md: this order exits cleanly; others aborted at exit in 4 runs of 10.
        del self.model, self.optimizer, self.batches
        gc.collect()
        launch.destroy_group()


class _Clock:
    """Training seconds between warm-up and the last step, minus logging and checkpoint writes (after a
    device sync, so no GPU work is left out): what the final throughput divides by."""

    def __init__(self):
        self.start_step = self.end_step = None
        self.t0 = self.t1 = self.excluded = 0.0

    def start(self, step: int) -> None:
        self.start_step, self.t0 = step, time.perf_counter()

    def stop(self, step: int) -> None:
        if self.start_step is not None:
            self.end_step, self.t1 = step, time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.start_step is not None and self.end_step is None:
                self.excluded += time.perf_counter() - t

    def rate(self, samples_per_step: int) -> float:
        if self.start_step is None or self.end_step is None or self.end_step <= self.start_step:
            return 0.0
        seconds = self.t1 - self.t0 - self.excluded
        return (self.end_step - self.start_step) * samples_per_step / seconds if seconds > 0 else 0.0


def _batches(tr: Trainer):
    from job.data import batches

    c = tr.cfg
    return batches(tr.spec, c.workload, c.data, micro_batch=tr.micro_batch, start=tr.data_position,
                   rank=tr.env.rank if tr.strategy.multi_process else 0,
                   world=tr.env.world_size if tr.strategy.multi_process else 1,
                   seed=c.train.seed, device=tr.device, channels_last=c.train.channels_last)


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
