"""`fsdp`: parameters, gradients and optimizer state sharded over the ranks (PyTorch FSDP2, `fully_shard`).

One process per card, started like `ddp` (plain command, torchrun, Slurm, Kubernetes). Each rank keeps
1/world of every parameter, of its gradient and of the optimizer state; a block's full weights exist only
while that block runs (all-gathered before its forward and again before its backward, freed after), and
gradients are reduce-scattered as each block's backward ends. The sharding unit is one block of the model
(the workload's `blocks`, job.workload): a transformer block of `lm`, a stage (layer1-4) of `resnet50`, a conv block of `tiny`;
what is left (embeddings, head, norms) is the root unit.

- The model stays on the CPU until `setup` (`to_device`): `fully_shard` moves each unit to the card as it
  shards it, so the whole float32 model is never on one card.
- Mixed precision: with `train.amp=bf16`, FSDP's own policy (`MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=float32)`) all-gathers the weights in bf16 and computes in bf16 while the sharded master
  weights, gradients and optimizer state stay float32; the trainer's autocast is turned off inside this
  strategy's forward, so nothing is cast twice. fp16 is refused (its loss scaler would have to agree across
  shards on a skipped step).
- Activation checkpointing (`train.activation_checkpointing`) wraps each block before it is sharded (the
  order torchtitan uses): recomputation in backward runs after the block's weights are all-gathered again.
- Batches: the per-rank shares are the memory plan's (job.memplan) as under `ddp`, and the loss is this
  rank's sum x world / micro-batch, so the averaged gradient is the full micro-batch mean whatever the
  split. `strategy.split=auto` gives the even split here without probing: the plan's probes run each card's
  forward/backward on its own, and under fsdp every forward and backward is a collective of all ranks.
  Explicit shares (`strategy.split=a,b`) work.
- Accumulation: gradients are reduce-scattered on every micro-step (skipping it, as ddp's no_sync does,
  would keep an unsharded gradient: the memory this strategy exists to save).
- Checkpoints are the full, unsharded state (`get_model_state_dict`/`get_optimizer_state_dict` with
  `full_state_dict=True, cpu_offload=True`), gathered on every rank, written by rank 0 through the usual
  path, shaped exactly like one process's `model.state_dict()` and `optimizer.state_dict()`: a run saved
  here resumes under ddp, balanced or one process, and the other way round.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from job import memplan
from job.errors import UsageError
from job.strategies.base import tensors_by_device, unique_tensors
from job.strategies.ddp import ProcessGroupStrategy

log = logging.getLogger("job")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPStrategy(ProcessGroupStrategy):
    """The collectives and shares of ddp (ProcessGroupStrategy), sharded with fully_shard instead of wrapped in
    DDP; backward_sync is the base's, so every micro-step reduce-scatters (see Accumulation above)."""

    name = "fsdp"

    def check(self, *, micro_batch: int) -> None:
        if self.world_size < 2:
            raise UsageError(
                "fsdp shards the model over several processes, and this run has one (one visible card, or "
                "strategy.nprocs=1 on CPU); use 2 or more cards (or strategy.nprocs=2 on CPU), or strategy=ddp"
            )
        if str(self.cfg.gpu0_batch).strip().lower() != "auto":
            raise UsageError(
                f"strategy.gpu0_batch={self.cfg.gpu0_batch} is for balanced/ddp; under fsdp give every rank's "
                "share with strategy.split (e.g. strategy.split=4,12), or leave gpu0_batch=auto"
            )
        if self.precision.mode == "fp16":
            raise UsageError(
                "fsdp does not support train.amp=fp16 (its loss scaler would have to agree across shards on "
                "skipped steps); use train.amp=bf16 (FSDP's mixed-precision policy) or off"
            )
        super().check(micro_batch=micro_batch)  # a sample per rank, and the split
        if self.device.type == "cuda" and self.cfg.backend == "gloo":
            raise UsageError("fsdp on GPUs needs NCCL (gloo has no all-gather or reduce-scatter of CUDA tensors); use "
                             "strategy.backend=auto or nccl")
        if self.device.type == "cuda" and self.distributed:
            import socket

            # Ranks that share a card shard nothing away (and NCCL refuses them): compare the cards themselves,
            # as a rank bound to its own card by Slurm or CUDA_VISIBLE_DEVICES sees it as cuda:0 too.
            me = (socket.gethostname(), str(torch.cuda.get_device_properties(self.device).uuid))
            cards = self.all_gather_object(me)
            if len(set(cards)) < len(cards):
                raise UsageError(
                    f"fsdp: {len(cards)} ranks run on {len(set(cards))} card(s), so some share a card and sharding "
                    "saves nothing there: start one rank per card (strategy.nprocs=0), or use strategy=ddp"
                )

    def to_device(self, model: nn.Module) -> nn.Module:
        """Left on the CPU: `fully_shard` moves each unit to the card as it shards it, so the whole model never
        sits on one card (only one unit's full weights at a time, while it is being sharded)."""
        return model

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False, blocks=None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.module, self.loss_fn = model, loss_fn
        self.compile = compile
        if not self.distributed:  # check() refuses this; kept for a strategy built by hand
            raise UsageError("fsdp needs an initialised process group of 2 or more ranks")
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = self.precision.fsdp_policy()
        units = list(blocks or [])
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        log.info("fsdp: %d sharding units + the root over %d ranks; parameters%s", len(units), self.world_size,
                 " all-gathered in bf16, gradients reduced in float32" if self.precision.mode == "bf16" else " in float32")
        if not units and self.is_main:
            log.warning("fsdp: the workload names no blocks, so the whole model is one sharding unit: its full "
                        "weights are gathered for every forward and backward; give Workload(blocks=...) to shard "
                        "block by block")
        self.forward = torch.compile(model) if compile else model

    def plan_memory(self, planning) -> memplan.Plan:
        """Each rank's card (free memory, room) for the table; the split: explicit shares, else even."""
        mine = planning.card(self.device, f"rank {self.rank} {self.device}", self.local_rank)
        cards = self.all_gather_object(mine)
        plan = memplan.Plan(mode="explicit" if isinstance(self.mode, list) else "even",
                            micro_batch=planning.micro_batch, cards=cards, key=planning.key)
        if self.mode == "auto" and self.device.type == "cuda" and self.is_main:
            log.info("fsdp: strategy.split=auto splits evenly (the memory plan cannot probe one rank alone: every "
                     "forward and backward under fsdp is a collective); give shares with strategy.split=a,b to "
                     "split unevenly")
        sizes = self.mode if isinstance(self.mode, list) else memplan.even_split(planning.micro_batch, self.world_size)
        memplan.apply_fixed(plan, sizes)
        self.sizes = plan.sizes
        return plan

    def eval_output(self, x):
        with torch.autocast(self.device.type, enabled=False):  # FSDP's policy casts (as in loss)
            return self.forward(x)

    def loss(self, x, y):
        """As ddp: this rank's loss sum x world / micro-batch (FSDP averages gradients over the ranks)."""
        # FSDP's policy already computes in bf16; the trainer's autocast would only cast again.
        with torch.autocast(self.device.type, enabled=False):
            out = self.forward(x)
        return self.loss_fn(out, y, reduction="sum") * (self.world_size / self.micro_batch)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm over every shard (DTensor reduces it across ranks), as one process computes it."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def local_parameters(self):
        return [_local(p) for p in self.module.parameters()]

    # -- checkpoints: full state, keyed as one process keys it ---------------------------------------
    def _names(self) -> list[str]:
        """Parameter names in the order the optimizer was built with (module.parameters())."""
        return [n for n, _ in self.module.named_parameters()]

    def checkpoint_state(self, opt) -> tuple[dict, dict] | None:
        """Every rank takes part (the shards are gathered); rank 0 gets the full state on the CPU."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.module, options=options)
        opt_sd = get_optimizer_state_dict(self.module, opt, options=options)
        if not self.is_main:
            return None
        index = {name: i for i, name in enumerate(self._names())}
        # The groups' settings as the optimizer holds them (DCP's copy turns tuples such as betas into lists).
        groups = [{**{k: v for k, v in mine.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                  for mine, g in zip(opt.param_groups, opt_sd["param_groups"], strict=True)]
        return model_sd, {"state": {index[name]: value for name, value in opt_sd["state"].items()},
                          "param_groups": groups}

    def optimizer_state_dict(self, opt) -> dict:
        state = self.checkpoint_state(opt)
        return state[1] if state is not None else {}

    def load_optimizer_state_dict(self, opt, sd: dict) -> None:
        """`sd` is one process's optimizer state (every rank read the checkpoint); each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = self._names()
        groups = sd.get("param_groups") or []
        if sorted(i for g in groups for i in g.get("params", [])) != list(range(len(names))):
            raise ValueError(f"it lists {sum(len(g.get('params', [])) for g in groups)} parameters, the model has "
                             f"{len(names)}")
        named = {
            "state": {names[int(i)]: value for i, value in sd.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
        }
        set_optimizer_state_dict(self.module, opt, named, options=StateDictOptions(full_state_dict=True))
        for mine, saved in zip(opt.param_groups, groups, strict=True):  # the saved settings, types and all, as
            mine.update({k: v for k, v in saved.items() if k != "params"})  # Optimizer.load_state_dict keeps them

    def memory_tensors(self, optimizer) -> list[dict[str, list[torch.Tensor]]]:
        """This rank's shards: the optimizer's parameters are the sharded DTensors (the module's own attributes
        are swapped for the all-gathered weights while a block runs), their gradients and state are DTensors too;
        each counts as its local shard (`to_local`). The all-gathered weights are temporaries."""
        params = unique_tensors([p for g in optimizer.param_groups for p in g["params"]])
        return tensors_by_device(self.devices, params=params, buffers=list(self.module.buffers()), optimizer=optimizer,
                          local=_local)
