"""The model under a DeepSpeed engine for one layout, and what one optimizer step does.

On every layout, the loss of each micro-batch is the SUM of its token cross-entropies times
dp * grad_accum / (scored tokens in the whole global batch): after DeepSpeed divides by grad_accum
and averages over dp, the gradient is exactly that of the mean token loss over the global batch
(a per-rank mean of means would not be, when ranks hold different numbers of scored tokens).

Freezing: the engine covers only the parameters with requires_grad at the current step; `rebuild`
applies a new trainable set (pretrain/freeze_transitions.py carries the Adam moments across).

Non-finite values never reach the weights or the Adam moments: a non-finite loss (all ranks agree
before the boundary `engine.step()`) or a non-finite norm of the gradients about to be applied
makes `StepGate` skip the inner optimizer's update; what happens next is the loop's
`train.nan_policy` (pretrain/loop.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.constants import IGNORE_INDEX
from common.deepspeed_import import import_deepspeed
from common.errors import RecipeError
from model.init import is_hidden_matrix

from . import engine_checkpoint, faults, freeze_transitions
from .config import RunConfig
from .context import RunContext
from .layout import Layout, build_ds_config
from .memory import resolve_checkpointing
from .parallelize import build_local


def param_groups(module: torch.nn.Module, cfg: RunConfig, width_mult: float = 1.0) -> list[dict[str, Any]]:
    """AdamW groups over TRAINABLE tensors only: decay for matrices, none for biases/norms/embeddings; under
    µP (`width_mult` m > 1 or < 1) the hidden matrices' group has `lr_scale` 1/m (`set_lr` applies it)."""
    by_kind: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}  # (decays, hidden) -> tensors
    seen = set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        lname = name.lower()
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned tensor: its full shape
        decays = not (ndim < 2 or any(s in lname for s in cfg.optim.no_decay))
        by_kind.setdefault((decays, width_mult != 1.0 and is_hidden_matrix(name)), []).append(p)
    groups = [
        {"params": ps, "weight_decay": cfg.optim.weight_decay if decays else 0.0}
        | ({"lr_scale": 1.0 / width_mult} if hidden else {})
        for (decays, hidden), ps in sorted(by_kind.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]
    if not groups:
        raise RecipeError(
            "no trainable parameters at this step (every group is frozen). Fix: check model.frozen_groups "
            "and model.freeze_schedule"
        )
    return groups


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as the loop reads it: the global mean loss, the gradient norm (None where
    DeepSpeed reports none), and whether the update was applied (False: skipped on every rank)."""

    loss: float
    grad_norm: float | None
    finite: bool


class StepGate:
    """Wraps the innermost (torch) optimizer's `step`, which DeepSpeed calls on every rank after
    gradient reduction and clipping, so that one optimizer step's update can be skipped: the fp32
    master weights, the moments and the Adam step count stay untouched. `begin(skip)` opens a step;
    at its first inner call the gate decides for the whole step: skip when asked to (a non-finite
    loss) or when the norm of the gradients it holds, over every rank, is not finite (under ZeRO-3,
    whose inner calls are per sub-group, the first sub-group's). `end()` says whether it skipped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.skip = False
        self.decided = False
        self.norm: float | None = None  # the gradient norm checked in the current step (None: not checked)
        self._step = optimizer.step
        optimizer.step = self.step

    def _grad_norm(self) -> float:
        """The norm of the gradients this optimizer holds, over every rank (a NaN or inf anywhere
        makes it non-finite; one all-reduce and one host sync)."""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        dev = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        sq = torch.zeros((), device=dev, dtype=torch.float32)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            sq = norms.pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq)
        return float(sq.sqrt())

    def begin(self, skip: bool = False) -> None:
        self.skip, self.decided, self.norm = skip, False, None

    def end(self) -> bool:
        """True when the optimizer step since `begin` skipped its update."""
        skipped = self.skip and self.decided
        self.skip, self.decided = False, False
        return skipped

    def step(self, *args, **kwargs):
        if not self.decided:
            self.norm = self._grad_norm()
            self.skip = self.skip or not math.isfinite(self.norm)
            self.decided = True
        if self.skip:
            return None
        return self._step(*args, **kwargs)


def any_rank(flag: bool | torch.Tensor, device: torch.device, group=None) -> bool:
    """True on every rank when `flag` (a bool, or a one-element tensor on the device) is true on any rank."""
    if isinstance(flag, torch.Tensor):
        t = flag.detach().reshape(1).to(device=device, dtype=torch.float32)
    else:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


class ModelEngine:
    """Holds the model, the DeepSpeed engine and the per-step logic for one layout."""

    def __init__(self, cfg: RunConfig, mcfg, layout: Layout, device: torch.device):
        self.cfg, self.mcfg, self.layout, self.device = cfg, mcfg, layout, device
        self.pipe = layout.pipeline_stages > 1
        self.zero3 = layout.zero_stage >= 3
        self.ds_config = build_ds_config(cfg, layout, on_cpu=device.type == "cpu", hidden_size=mcfg.hidden_size)
        # the activation-checkpointing mode applied, why (`auto`: the estimate against the device), and the
        # estimated peak memory per rank with it (pretrain/memory.py)
        self.checkpointing, self.checkpointing_reason, self.memory_estimate_gib = resolve_checkpointing(
            cfg, mcfg, layout, self.ds_config.get("zero_optimization", {}), device
        )
        self.engine = None
        self.model = None
        self.trainable_step = 0
        self.poison = faults.loss_poisoner()  # None in production (pretrain/faults.py)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_context(cls, ctx: RunContext) -> "ModelEngine":
        """This rank's engine at the run's resume point: the trainable set of its step, its checkpoint loaded."""
        model_engine = cls(ctx.cfg, ctx.mcfg, ctx.layout, ctx.device)
        point = ctx.point
        model_engine.build(point.trainable_step, load_universal=point.universal)
        if point.tag_dir is not None:
            engine_checkpoint.load(model_engine, point.tag_dir, point.universal, ctx.cfg.seed)
        return model_engine

    def checkpoint_state(self) -> dict[str, Any]:
        """The engine's part of trainer_state.json: the model, its trainable set and the layout that wrote it."""
        layout = self.layout
        return {
            "trainable_step": self.trainable_step,
            "variant": self.mcfg.variant,
            "world_size": dist.get_world_size(),
            "layout": layout.describe(),
            "pipeline_stages": layout.pipeline_stages,
            "data_parallel": layout.data_parallel,
            "zero_stage": layout.zero_stage,
            "model_config": self.mcfg.to_dict(),
        }

    def build(self, step: int, state: dict[str, torch.Tensor] | None = None, load_universal: bool = False) -> None:
        """(Re)build model + engine with the trainable set of `step`; `state` overrides the initial weights.
        Each rank allocates only the tensors it owns (pretrain/parallelize.py)."""
        deepspeed = import_deepspeed()

        seed = self.cfg.train.init_seed if self.cfg.train.init_seed is not None else self.cfg.seed
        model, module = build_local(
            self.cfg, self.mcfg, self.layout, self.device, self.ds_config, seed, step, state, self.checkpointing
        )
        # DeepSpeed pops keys of the nested dicts it is given (0.18: optimizer.params): a copy per engine
        ds_config = copy.deepcopy(self.ds_config)
        if load_universal:
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=param_groups(module, self.cfg, self.mcfg.width_mult), config=ds_config
        )
        self.model, self.module, self.engine = model, module, engine
        self.gate = StepGate(self.inner_optimizer)  # skips the update of a step with a non-finite loss or gradient norm
        self.trainable_step = step
        self.name_of = {id(p): n for n, p in model.named_parameters()}
        self.local_ids = {id(p) for p in module.parameters()}

    def rebuild(self, step: int) -> None:
        """A freeze-schedule boundary: keep the weights, apply the new trainable set, and carry
        the Adam moments of tensors that stay trainable."""
        state = self.full_state_dict()
        snap = freeze_transitions.optimizer_snapshot(self)
        self.engine.destroy()
        self.engine = None
        self.build(step, state=state)
        if snap is not None:
            freeze_transitions.optimizer_restore(self, *snap)

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside DeepSpeed's wrappers (ZeRO, bf16)."""
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)

    # -- tensors --------------------------------------------------------------------------
    def gathered(self, params, modifier_rank: int | None = None):
        """Full parameters inside the block (ZeRO-3 gathers its partitions, and with `modifier_rank`
        scatters that rank's changes on exit; otherwise a no-op)."""
        if self.zero3:
            deepspeed = import_deepspeed()

            return deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank)
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the plain model this rank holds (gathered under ZeRO-3), on CPU. Under
        pipeline parallelism: this stage's tensors (the others are on the meta device)."""
        with self.gathered(self.model.parameters()):
            return {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items() if not v.is_meta}

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        frozen = [
            (self.name_of[id(p)], p) for p in self.module.parameters() if not p.requires_grad and id(p) in self.name_of
        ]
        with self.gathered([p for _, p in frozen]):
            return {n: p.detach().clone().cpu() for n, p in frozen}

    def restore_frozen(self, tensors: dict[str, torch.Tensor]) -> int:
        params = [
            (n, p)
            for n, p in self.model.named_parameters()
            if n in tensors and not p.requires_grad and id(p) in self.local_ids
        ]
        if params:
            with self.gathered([p for _, p in params], modifier_rank=0), torch.no_grad():
                for n, p in params:
                    p.copy_(tensors[n].to(device=p.device, dtype=p.dtype))
        return len(params)

    # -- one step -------------------------------------------------------------------------
    @property
    def dp_group(self):
        return self.engine.grid.get_data_parallel_group() if self.pipe else None

    @property
    def dp_rank(self) -> int:
        return self.engine.grid.get_data_parallel_rank() if self.pipe else dist.get_rank()

    def _micro_batches(self, batch: dict[str, torch.Tensor]):
        """[(input_ids, labels, doc_ids or None)] per micro-batch, on the device."""
        ids, labels, docs = batch["input_ids"], batch["labels"], batch.get("doc_ids")
        mb, n = self.layout.micro_batch, self.layout.grad_accum
        if ids.shape[0] != mb * n:
            raise RuntimeError(
                f"loader returned {ids.shape[0]} sequences per rank; expected {mb * n} (micro {mb} x grad-accum {n})"
            )
        ids, labels = ids.to(self.device).split(mb), labels.to(self.device).split(mb)
        docs = [None] * n if docs is None else docs.to(self.device).split(mb)
        return list(zip(ids, labels, docs))

    def _scale(self, mbs) -> tuple[torch.Tensor, torch.Tensor]:
        # counted on the device: no host read per micro-batch
        n = torch.stack([(y != IGNORE_INDEX).sum() for _, y, _ in mbs]).sum().float()
        dist.all_reduce(n, group=self.dp_group)
        n = n.clamp_min(1.0)
        return n, torch.tensor([self.layout.data_parallel * self.layout.grad_accum], device=self.device) / n

    def _ce_sum(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch (0 when it scores no token), from the model's own
        (chunked) loss, which runs inside the head's forward, so ZeRO-3 gathers its parameters for it.
        `docs` (data.return_doc_ids) masks attention to each document and restarts its positions."""
        extra = {} if docs is None else {"doc_ids": docs}  # a classifier's forward takes no doc_ids
        return self.engine(x, labels=y, reduction="sum", **extra).float()

    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)

    def train_step(self, batch: dict[str, torch.Tensor], batch_index: int | None = None) -> StepResult:
        """One optimizer step on this rank's share of the global batch (`batch_index`: its place in the
        data order, which fault injection reads). `finite` is False when the update was skipped on every
        rank: a non-finite loss, or a non-finite gradient norm with a finite loss (the step gate's check,
        or DeepSpeed's own overflow skip)."""
        mbs = self._micro_batches(batch)
        n_tokens, scale = self._scale(mbs)
        if self.pipe:
            # the scale rides with the labels to the last stage's loss (a fault poisons it there)
            if self.poison is not None:
                scale = self.poison(scale, batch_index)
            data = iter([(x, (y, scale)) for x, y, _ in mbs])
            self.gate.begin()
            loss = float(self.engine.train_batch(data_iter=data))
            skipped = self.gate.end()
        else:
            total = torch.zeros((), device=self.device, dtype=torch.float32)
            own_norm = None
            bad = torch.zeros((), dtype=torch.bool, device=self.device)  # on the device until the vote
            loss_bad = False
            for i, (x, y, d) in enumerate(mbs):
                ce = self._ce_sum(x, y, d)
                if self.poison is not None:
                    ce = self.poison(ce, batch_index)
                bad = bad | ~torch.isfinite(ce.detach())
                if i == len(mbs) - 1:  # before the boundary step: every rank agrees to skip the update
                    loss_bad = any_rank(bad, self.device)
                    self.gate.begin(skip=loss_bad)
                self.engine.backward(ce * scale.reshape(()))
                if i == len(mbs) - 1 and self.layout.zero_stage == 0:
                    # DeepSpeed reports no norm without ZeRO; gradients are all-reduced by now (pre-clip norm).
                    grads = [p.grad.float().norm() for p in self.module.parameters() if p.grad is not None]
                    own_norm = float(torch.stack(grads).norm()) if grads else 0.0
                self.engine.step()
                total += ce.detach()
            skipped = self.gate.end() or loss_bad
            dist.all_reduce(total)
            loss = float(total / n_tokens)
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else (None if self.pipe else own_norm)
        # A step the gate refused logs the norm it refused (DeepSpeed 0.18.0-0.19.6 were seen to report a
        # finite one). DeepSpeed's ZeRO optimizers that skip an overflowing step before the gate sees it
        # report an infinite norm (the same on every rank).
        if skipped and self.gate.norm is not None and not math.isfinite(self.gate.norm):
            gn = self.gate.norm
        finite = not (skipped or not math.isfinite(loss) or (gn is not None and not math.isfinite(gn)))
        return StepResult(loss, gn, finite)

    @contextlib.contextmanager
    def _evaluating(self):
        """Eval mode and no gradients inside the block; training mode after."""
        self.engine.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.engine.train()

    def _eval_batch(self, batch) -> tuple[float, float, float]:
        """(summed token cross-entropy, tokens scored, their mean) of one batch, all ranks together."""
        mbs = self._micro_batches(batch)
        n_tokens, scale = self._scale(mbs)
        if self.pipe:  # the last stage's mean over the batch's scored tokens
            data = iter([(x, (y, scale)) for x, y, _ in mbs])
            mean = float(self.engine.eval_batch(data_iter=data, num_micro_batches=len(mbs)))
            return mean * float(n_tokens), float(n_tokens), mean
        total = torch.zeros((), device=self.device)
        for x, y, d in mbs:
            total += self._ce_sum(x, y, d)
        dist.all_reduce(total)
        return float(total), float(n_tokens), float(total / n_tokens)

    def eval_sums(self, batches, max_batches: int) -> tuple[float, float]:
        """(summed token cross-entropy, tokens scored) over up to `max_batches` of `batches`, all ranks
        together: the parts of a loss pooled over several validation sets."""
        ce_total, n_total = 0.0, 0.0
        with self._evaluating():
            for batch in itertools.islice(batches, max_batches):
                ce, n, _ = self._eval_batch(batch)
                if ce != 0.0:  # n is clamped to 1 for a batch of padding only, which scores nothing
                    ce_total, n_total = ce_total + ce, n_total + n
        return ce_total, n_total

    def eval_loss(self, loader, batches: int) -> float:
        """The mean over up to `batches` batches of each batch's mean token loss."""
        with self._evaluating():
            losses = [self._eval_batch(batch)[2] for batch in itertools.islice(loader, batches)]
        return sum(losses) / max(1, len(losses))
