"""Pretraining under the DeepSpeed engine.

    python -m pretrain.train --recipe recipes/tiny_cpu.yaml [--dry-run] [--resume auto|never|PATH]
                             [--run-dir DIR] [section.key=value ...]

Runs as one plain process (world size 1; the process group is set up here with gloo or
nccl) or under `deepspeed` / `launch.sh` / torchrun. `train(recipe, overrides)` is the
same thing as a Python function (world size 1 in-process, or inside a launched process).

What one optimizer step does, identically for every layout: each data-parallel rank
takes its share of the global batch from the loader, splits it into micro-batches, and
the loss of every micro-batch is the SUM of its token cross-entropies times
dp * grad_accum / (scored tokens in the whole global batch). DeepSpeed divides by
grad_accum and averages over dp, so the gradient is exactly that of the mean token loss
over the global batch, whatever the layout (the per-rank mean of means would not be,
when ranks hold different numbers of scored tokens).

Freezing: the engine (and so the optimizer, gradient buffers and all-reduce) covers
only the parameters with requires_grad at the current step. When the model's freeze
schedule changes the trainable set, the engine is rebuilt before that step: weights,
step, LR schedule and data position carry over; the Adam moments of tensors that stay
trainable carry over under ZeRO 0/1/2 and pipeline (ZeRO-1); newly trainable tensors start
with zero moments; under ZeRO-3 and CPU offload all moments restart (docs/TRAINING.md).
"""
from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from data_pipeline.errors import DataError

from . import checkpointing as ckpt
from . import faults, safety
from .config import REPO_ROOT, RecipeError, RunConfig, load_recipe
from .data import make_loader
from .layout import Layout, build_ds_config, memory_estimate, plan_layout
from .metrics import Logger, device_peak_tflops, memory_gib, train_flops_per_token

IGNORE_INDEX = -100


@dataclass
class RunResult:
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)       # step (1-based, after the update) -> loss
    val_losses: dict[int, float] = field(default_factory=dict)
    final_step: int = 0
    tokens_seen: int = 0
    last_checkpoint: Path | None = None
    resumed_from: Path | None = None
    interrupted: bool = False


# ---- small helpers ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device=cuda but no CUDA device is visible. Fix: train.device=cpu")
    if want == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if want == "cuda":
        # One visible GPU per process (e.g. srun --gpus-per-task) -> cuda:0; else cuda:LOCAL_RANK.
        local = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local if local < torch.cuda.device_count() else 0)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Initialise torch.distributed through DeepSpeed; returns True when this call created it.
    `timeout_s` bounds every collective (a dead or hung peer ends the run instead of hanging it)."""
    import deepspeed
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return False
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device.type == "cpu":
        # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce op on first use
        # (minutes on a small machine); gloo's own all-reduce is used instead.
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import datetime
    kw = {}
    if timeout_s:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        # DeepSpeed creates its data/pipeline/ZeRO groups with `new_group(ranks)`, which takes
        # torch's module-level default (30 min for gloo), not the world group's timeout: without
        # this, a peer that hangs inside a sub-group collective holds this rank for 30 minutes.
        from torch.distributed import distributed_c10d as c10d
        c10d.default_pg_timeout = kw["timeout"]
        if hasattr(c10d, "default_pg_nccl_timeout"):
            c10d.default_pg_nccl_timeout = kw["timeout"]
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False, **kw)
    return True


def shutdown_distributed() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def model_config(cfg: RunConfig, vocab_size: int | None):
    from model import preset
    if cfg.task == "classification":
        from .classification import model_config as classification_model_config
        mcfg = classification_model_config(cfg, vocab_size)
        if mcfg is not None:
            return mcfg
    m = dict(cfg.model)
    name = m.pop("preset", "tiny")
    if m.get("vocab_size") is None:
        if vocab_size is None:
            m.pop("vocab_size", None)
        else:
            m["vocab_size"] = int(vocab_size)
    elif vocab_size is not None and m["vocab_size"] < vocab_size:
        raise RecipeError(f"model.vocab_size={m['vocab_size']} is smaller than the data's vocabulary {vocab_size}")
    m.setdefault("max_seq_len", cfg.train.seq_len)
    if m["max_seq_len"] < cfg.train.seq_len:
        raise RecipeError(f"model.max_seq_len={m['max_seq_len']} < train.seq_len={cfg.train.seq_len}")
    return preset(name, **m)


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant":
        return o.lr
    span = o.decay_steps if o.decay_steps is not None else max(1, cfg.max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, span))
    if o.decay == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(module: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """AdamW groups over TRAINABLE tensors only: decay for matrices, none for biases/norms/embeddings."""
    decay, no_decay = [], []
    seen = set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        lname = name.lower()
        (no_decay if p.ndim < 2 or any(s in lname for s in cfg.optim.no_decay) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": cfg.optim.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        raise RecipeError("no trainable parameters at this step (every group is frozen); check model.frozen_groups "
                          "and model.freeze_schedule")
    return groups


# ---- the engine -------------------------------------------------------------------------

class Trainer:
    """Holds the model, the DeepSpeed engine and the per-step logic for one layout."""

    def __init__(self, cfg: RunConfig, mcfg, layout: Layout, device: torch.device):
        self.cfg, self.mcfg, self.layout, self.device = cfg, mcfg, layout, device
        self.pipe = layout.pipeline_stages > 1
        self.zero3 = layout.zero_stage >= 3
        self.ds_config = build_ds_config(cfg, layout, on_cpu=device.type == "cpu")
        self.engine = None
        self.model = None
        self.trainable_step = 0

    # -- construction ---------------------------------------------------------------------
    def build(self, step: int, state: dict[str, torch.Tensor] | None = None, load_universal: bool = False) -> None:
        """(Re)build model + engine with the trainable set of `step`; `state` overrides the initial weights."""
        import deepspeed
        from .classification import build_task_model
        seed = self.cfg.train.init_seed if self.cfg.train.init_seed is not None else self.cfg.seed
        model = build_task_model(self.cfg, self.mcfg, seed)
        if state is not None:
            model.load_state_dict(state, strict=True)
        model.set_step(step)
        model.to(device=self.device)
        if self.cfg.train.activation_checkpointing and not self.pipe:
            from torch.utils.checkpoint import checkpoint
            model.checkpoint_fn = lambda block, h, cos, sin: checkpoint(block, h, cos, sin, use_reentrant=False)
        if self.pipe:
            from .pipeline import build_pipeline
            module = build_pipeline(model, self.layout.pipeline_stages, self.cfg.parallel.partition_method,
                                    self.cfg.train.activation_checkpointing, seed)
        else:
            module = model
        ds_config = dict(self.ds_config)
        if load_universal:
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, self.cfg),
                                               config=ds_config)
        self.model, self.module, self.engine = model, module, engine
        safety.install_step_gate(self)       # lets a non-finite step skip its update
        self.trainable_step = step
        self.name_of = {id(p): n for n, p in model.named_parameters()}
        self.local_ids = {id(p) for p in module.parameters()}

    def rebuild(self, step: int) -> None:
        """A freeze-schedule boundary: keep the weights, apply the new trainable set, and carry
        the Adam moments of tensors that stay trainable (see optimizer_snapshot)."""
        state = self.full_state_dict()
        snap = self.optimizer_snapshot()
        self.engine.destroy()
        self.engine = None
        self.build(step, state=state)
        if snap is not None:
            self.optimizer_restore(*snap)

    # -- Adam moments across a rebuild ----------------------------------------------------
    def _inner_optimizer(self):
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)

    def _moment_mode(self) -> str | None:
        """'hp' (ZeRO-1/2 or bf16 wrappers: DeepSpeed's fragment API), 'plain' (ZeRO-0 fp32:
        the torch optimizer holds the parameters themselves), None (ZeRO-3 / offload: reset)."""
        if self.zero3 or self.layout.offload_optimizer:
            return None
        params = [p for p in self.module.parameters() if p.requires_grad]
        if params and all(hasattr(p, "_hp_mapping") for p in params):
            return "hp"
        if self._inner_optimizer() is self.engine.optimizer and self.layout.zero_stage == 0:
            return "plain"
        return None

    def _link_fragments(self) -> None:
        # DeepSpeed links each parameter to its optimizer-state fragments after the first step;
        # a freshly built (or just loaded) engine has not stepped yet.
        opt = self.engine.optimizer
        link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            opt._hp_optimizer_states_linked = False
            link()

    def optimizer_snapshot(self):
        """(name -> {exp_avg, exp_avg_sq}, adam step) for the current trainable tensors, or None."""
        mode = self._moment_mode()
        inner = self._inner_optimizer()
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        if mode is None or not steps:
            return None
        from deepspeed.utils import safe_get_full_optimizer_state
        self._link_fragments()
        snap = {}
        for p in self.module.parameters():
            if not p.requires_grad or id(p) not in self.name_of:
                continue
            if mode == "plain":
                st = inner.state.get(p, {})
                snap[self.name_of[id(p)]] = {k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq") if k in st}
            else:
                snap[self.name_of[id(p)]] = {k: safe_get_full_optimizer_state(p, k).detach().clone()
                                             for k in ("exp_avg", "exp_avg_sq")}
        return snap, float(steps[0])

    def optimizer_restore(self, snap: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Seed the new optimizer: carried moments for tensors that stayed trainable, zeros for
        newly trainable ones, and the old Adam step count for all (no bias-correction restart)."""
        mode = self._moment_mode()
        if mode is None:
            return
        from deepspeed.utils import safe_set_full_optimizer_state
        inner = self._inner_optimizer()
        for group in inner.param_groups:
            for fp in group["params"]:
                if len(inner.state.get(fp, {})) == 0:
                    inner.state[fp] = {"step": torch.tensor(step), "exp_avg": torch.zeros_like(fp),
                                       "exp_avg_sq": torch.zeros_like(fp)}
        self._link_fragments()
        for p in self.module.parameters():
            name = self.name_of.get(id(p))
            if not p.requires_grad or name not in snap:
                continue
            for k, v in snap[name].items():
                if mode == "plain":
                    inner.state[p][k].copy_(v.to(inner.state[p][k].device, inner.state[p][k].dtype))
                else:
                    safe_set_full_optimizer_state(p, v, k)

    def _gathered(self, params):
        if self.zero3:
            import deepspeed
            return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)
        import contextlib
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the plain model (gathered under ZeRO-3), on CPU. Under pipeline
        parallelism only this stage's tensors are current."""
        with self._gathered(self.model.parameters()):
            return {k: v.detach().clone().cpu() for k, v in self.model.state_dict().items()}

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        frozen = [(self.name_of[id(p)], p) for p in self.module.parameters()
                  if not p.requires_grad and id(p) in self.name_of]
        with self._gathered([p for _, p in frozen]):
            return {n: p.detach().clone().cpu() for n, p in frozen}

    def restore_frozen(self, tensors: dict[str, torch.Tensor]) -> int:
        params = [(n, p) for n, p in self.model.named_parameters()
                  if n in tensors and not p.requires_grad and id(p) in self.local_ids]
        if not params:
            return 0
        if self.zero3:
            import deepspeed
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                with torch.no_grad():
                    for n, p in params:
                        p.copy_(tensors[n].to(p.dtype))
        else:
            with torch.no_grad():
                for n, p in params:
                    p.copy_(tensors[n].to(device=p.device, dtype=p.dtype))
        return len(params)

    # -- one step -------------------------------------------------------------------------
    @property
    def dp_group(self):
        if self.pipe:
            return self.engine.grid.get_data_parallel_group()
        return None

    def _micro_batches(self, batch: dict[str, torch.Tensor]):
        ids, labels = batch["input_ids"], batch["labels"]
        mb = self.layout.micro_batch
        if ids.shape[0] != mb * self.layout.grad_accum:
            raise RuntimeError(f"loader returned {ids.shape[0]} sequences per rank; expected "
                               f"{mb * self.layout.grad_accum} (micro {mb} x grad-accum {self.layout.grad_accum})")
        return [(ids[i:i + mb].to(self.device), labels[i:i + mb].to(self.device)) for i in range(0, ids.shape[0], mb)]

    def _scale(self, mbs) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist
        n = torch.tensor(float(sum(int((y != IGNORE_INDEX).sum()) for _, y in mbs)), device=self.device)
        dist.all_reduce(n, group=self.dp_group)
        n = n.clamp_min(1.0)
        return n, torch.tensor([self.layout.data_parallel * self.layout.grad_accum], device=self.device) / n

    def _ce_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch. Uses the model's own loss (chunked: never
        the full [b, t, vocab] logits) except under ZeRO-3, whose parameter gathering only covers
        submodule forwards (the chunked loss reads lm_head.weight directly), or when the micro-batch
        scores no token (the mean would be NaN)."""
        n = int((y != IGNORE_INDEX).sum())
        if n and not self.zero3 and self.mcfg.loss_chunk_tokens:
            return self.engine(x, labels=y).float() * n
        logits = self.engine(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def train_step(self, batch: dict[str, torch.Tensor]) -> tuple[float, float | None]:
        """One optimizer step on this rank's share of the global batch; returns (global mean loss, grad norm)."""
        import torch.distributed as dist
        mbs = self._micro_batches(batch)
        n_tokens, scale = self._scale(mbs)
        if self.pipe:
            # the scale rides with the labels to the last stage's loss (a fault poisons it there)
            scale = faults.poison_loss(scale, getattr(self, "batch_index", None))
            data = iter([(x, (y, scale)) for x, y in mbs])
            skipped = self.gate.skipped
            loss = float(self.engine.train_batch(data_iter=data))
            self.nonfinite = not math.isfinite(loss) or self.gate.skipped > skipped
        else:
            total = torch.zeros((), device=self.device, dtype=torch.float32)
            own_norm = None
            bad = False
            for i, (x, y) in enumerate(mbs):
                ce = faults.poison_loss(self._ce_sum(x, y), getattr(self, "batch_index", None))
                bad = bad or not safety.is_finite(ce)
                if i == len(mbs) - 1:        # before the boundary step: every rank agrees to skip the update
                    self.nonfinite = self.gate.skip_next = safety.any_rank(bad, self.device)
                self.engine.backward(ce * scale.reshape(()))
                if i == len(mbs) - 1 and self.layout.zero_stage == 0:
                    # DeepSpeed reports no norm without ZeRO; gradients are all-reduced by now (pre-clip norm).
                    grads = [p.grad.float().norm() for p in self.module.parameters() if p.grad is not None]
                    own_norm = float(torch.stack(grads).norm()) if grads else 0.0
                self.engine.step()
                total += ce.detach()
            self.gate.skip_next = False
            dist.all_reduce(total)
            loss = float(total / n_tokens)
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else (None if self.pipe else own_norm)
        return loss, gn

    @torch.no_grad()
    def eval_loss(self, loader, batches: int) -> float:
        import torch.distributed as dist
        self.engine.eval()
        losses = []
        try:
            for _ in range(batches):
                try:
                    batch = next(loader)
                except StopIteration:
                    break
                mbs = self._micro_batches(batch)
                n_tokens, scale = self._scale(mbs)
                if self.pipe:
                    data = iter([(x, (y, scale)) for x, y in mbs])
                    out = self.engine.eval_batch(data_iter=data, num_micro_batches=len(mbs))
                    losses.append(float(out))
                else:
                    total = torch.zeros((), device=self.device)
                    for x, y in mbs:
                        total += self._ce_sum(x, y)
                    dist.all_reduce(total)
                    losses.append(float(total / n_tokens))
        finally:
            self.engine.train()
        return sum(losses) / max(1, len(losses))

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, run_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int) -> Path:
        import torch.distributed as dist
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        root = ckpt.ckpt_root(run_dir)
        tag = ckpt.tag_for(step)
        tag_dir = root / tag
        rank = dist.get_rank()
        if rank == 0 and tag_dir.exists():
            shutil.rmtree(tag_dir)                    # rewriting a tag: start from an empty dir
        dist.barrier()
        self.engine.save_checkpoint(str(root), tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {},
                                                                     "trainer_state": trainer_state},
                                    save_latest=False)
        frozen = self.frozen_tensors()      # collective under ZeRO-3: every rank takes part
        stage = self.engine.stage_id if self.pipe else 0
        dp_rank = self.engine.grid.get_data_parallel_rank() if self.pipe else rank
        if dp_rank == 0:
            ckpt.save_frozen(tag_dir, stage, frozen)
        ckpt.save_rng(tag_dir, rank)
        faults.pause("save", step)
        dist.barrier()                      # every rank has finished writing
        if rank == 0:
            ckpt.finalize(run_dir, tag_dir, trainer_state, keep_last)
        dist.barrier()
        return tag_dir

    def load(self, tag_dir: Path, universal: bool) -> None:
        import torch.distributed as dist
        load_dir, tag = str(tag_dir.parent), tag_dir.name
        safety.verify_checkpoint_dir(tag_dir)     # before DeepSpeed unpickles anything
        path, _ = self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {tag_dir}")
        self.restore_frozen(ckpt.load_frozen(tag_dir))
        if not ckpt.load_rng(tag_dir, dist.get_rank()):
            torch.manual_seed(self.cfg.seed + dist.get_rank())


# ---- the run ----------------------------------------------------------------------------

class _Stop:
    def __init__(self):
        self.requested = False
        self.signal = None

    def __call__(self, signum, frame):
        self.requested = True
        self.signal = signum


def default_run_dir(cfg: RunConfig) -> Path:
    return REPO_ROOT / "runs" / cfg.name


def resolved_config(cfg: RunConfig, mcfg) -> dict[str, Any]:
    d = cfg.to_dict()
    d["model"] = mcfg.to_dict()
    return d


def train(recipe: str | Path | dict | None = None, overrides=None, run_dir: str | Path | None = None,
          resume: str | None = "auto", stop_after_steps: int | None = None, overwrite: bool = False) -> RunResult:
    """Train (or continue) a run; returns the per-step losses. `stop_after_steps` ends the
    process's loop early at that step without a final checkpoint (for tests). A run dir that
    holds another run is refused unless resumed or `overwrite` (pretrain/safety.py)."""
    cfg = load_recipe(recipe, overrides)
    device = pick_device(cfg)
    import torch.distributed as dist
    env_keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved_env = {k: os.environ.get(k) for k in env_keys}
    plain = "RANK" not in os.environ
    if plain:     # a plain process: world size 1 (the environment is restored on return)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    owns_pg = init_distributed(device, cfg.parallel.timeout_s)
    if owns_pg:
        # ZeRO-3 processes abort at exit unless the process group is destroyed. It is kept
        # until then (DeepSpeed caches its groups), so train() can be called again in-process.
        atexit.register(shutdown_distributed)
    try:
        return _train(cfg, device, run_dir, resume, stop_after_steps, overwrite)
    except Exception as e:
        if isinstance(e, (RecipeError, safety.NonFiniteLoss, safety.UnsafeCheckpoint, safety.CheckpointWriteFailed)) \
                or not safety.collective_failure(e):
            raise
        raise safety.RankFailure(safety.rank_failure_message(
            e, cfg.parallel.timeout_s, Path(run_dir) if run_dir is not None else default_run_dir(cfg))) from e
    finally:
        if plain:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _train(cfg: RunConfig, device: torch.device, run_dir, resume, stop_after_steps, overwrite=False) -> RunResult:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    torch.manual_seed(cfg.seed)

    # Where to continue from; the checkpoint's recipe must describe the same model.
    resume_dir = None if overwrite else ckpt.resolve_resume(resume, run_dir)
    state: dict[str, Any] = ckpt.read_state(resume_dir) if resume_dir is not None else {}
    universal = bool(cfg.checkpoint.load_universal or state.get("universal"))

    # Data first: the model's vocabulary comes from it.
    layout = plan_layout(cfg, world)
    try:         # bad, empty or corrupt data is reported here, before any model is built
        probe = make_loader(cfg.data, "train", cfg.train.seq_len, cfg.global_batch_size, 0, layout.data_parallel,
                            cfg.seed)
    except ValueError as e:      # DataError and the built-in reader's errors name the file and the fix
        raise RecipeError(f"data: {e}") from None
    mcfg = model_config(cfg, getattr(probe, "vocab_size", None))
    if cfg.train.eval_every_steps:     # fail now, not at the first evaluation, if there is no val split
        make_loader(cfg.data, "val", cfg.train.seq_len, cfg.global_batch_size, 0, layout.data_parallel, cfg.seed)
    layout = plan_layout(cfg, world, mcfg.num_layers)
    if state:
        from model import ModelConfig
        from model.io import check_compatible
        try:
            check_compatible(mcfg, ModelConfig.from_dict(state["model_config"]), str(resume_dir))
        except ValueError as e:
            raise RecipeError(str(e)) from None
        data_tok, ckpt_tok = getattr(probe, "tokenizer_id", None), state.get("tokenizer_id")
        if data_tok is not None and ckpt_tok is not None and data_tok != ckpt_tok:
            raise RecipeError(f"checkpoint {resume_dir} was trained on tokenizer {ckpt_tok} but data.source "
                              f"{cfg.data.get('source')} uses {data_tok}; token ids would mean other things. Fix: "
                              "the data the checkpoint was trained on, or another --run-dir / --resume never")
    if rank == 0 or not overwrite:       # same answer on every rank; only rank 0 clears for --overwrite
        safety.check_run_dir(run_dir, resolved_config(cfg, mcfg), resume, overwrite and rank == 0)
    dist.barrier()

    if state and not universal:
        saved = (state.get("pipeline_stages", 1), state.get("data_parallel", state.get("world_size", 1)),
                 state.get("zero_stage", layout.zero_stage))
        now = (layout.pipeline_stages, layout.data_parallel, layout.zero_stage)
        if saved != now and (max(saved[2], now[2]) >= 1 or saved[0] != now[0]):
            raise RecipeError(
                f"checkpoint {resume_dir} was written with pipeline {saved[0]} x data {saved[1]}, ZeRO-{saved[2]}; "
                f"this run is pipeline {now[0]} x data {now[1]}, ZeRO-{now[2]}. DeepSpeed's partitioned files only "
                f"load under the same layout. Fix: python -m pretrain.universal --checkpoint {resume_dir} --out "
                f"{run_dir / 'universal'} and resume from the converted checkpoint (docs/TRAINING.md)")
    del probe
    trainer = Trainer(cfg, mcfg, layout, device)
    start_step = int(state.get("step", 0))
    trainer.build(int(state.get("trainable_step", start_step)), load_universal=universal)
    if trainer.pipe:
        dp_rank = trainer.engine.grid.get_data_parallel_rank()
    else:
        dp_rank = rank
    loader = make_loader(cfg.data, "train", cfg.train.seq_len, cfg.global_batch_size, dp_rank,
                         layout.data_parallel, cfg.seed)
    tokenizer_id = getattr(loader, "tokenizer_id", None)

    if resume_dir is not None:
        trainer.load(resume_dir, universal)
        loader.load_state_dict(state["loader"])

    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved_config(cfg, mcfg), sort_keys=False))
    logger = Logger(run_dir, rank == 0, cfg.logging.tensorboard, cfg.logging.progress_bar, cfg.max_steps, start_step)
    if resume_dir is not None:
        logger.truncate_after(start_step)
        logger.message(f"resumed from {resume_dir} at step {start_step}")
    logger.message(f"layout: {layout.describe()}")

    stop = _Stop()
    old_handlers = {}
    if cfg.checkpoint.save_on_signal:
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                old_handlers[s] = signal.signal(s, stop)
            except ValueError:       # not the main thread
                pass

    peak, _peak_src = device_peak_tflops(cfg.logging.peak_tflops, cfg.logging.measure_peak, device)
    result = RunResult(run_dir=run_dir, resumed_from=resume_dir, final_step=start_step)
    tokens_per_step = cfg.tokens_per_step
    tokens_seen = int(state.get("tokens_seen", start_step * tokens_per_step))
    step = start_step
    guard = safety.NanGuard(cfg.train.nan_policy, cfg.train.max_nan_skips, state.get("nan_skipped"))

    def trainer_state() -> dict[str, Any]:
        return {"step": step, "tokens_seen": tokens_seen, "trainable_step": trainer.trainable_step,
                "loader": loader.state_dict(), "tokenizer_id": tokenizer_id, "variant": mcfg.variant,
                "world_size": world, "layout": layout.describe(), "pipeline_stages": layout.pipeline_stages,
                "data_parallel": layout.data_parallel, "zero_stage": layout.zero_stage, "model_config": mcfg.to_dict(),
                "recipe": resolved_config(cfg, mcfg), "universal": False, "time": time.time(),
                "nan_skipped": sorted(guard.skip_positions)}

    def save() -> Path:
        try:
            return trainer.save(run_dir, step, trainer_state(), cfg.checkpoint.keep_last)
        except OSError as e:             # e.g. no space left: keep the last good checkpoint, stop clearly
            raise safety.checkpoint_write_failed(e, ckpt.ckpt_root(run_dir) / ckpt.tag_for(step), run_dir) from e

    def rollback() -> None:
        """Reload the last complete checkpoint (weights, optimizer, data position)."""
        nonlocal step, tokens_seen
        tag_dir = ckpt.latest_checkpoint(run_dir)
        if tag_dir is None:
            raise safety.NonFiniteLoss(f"non-finite loss at step {step + 1} and train.nan_policy=rollback, but "
                                       f"{run_dir} has no complete checkpoint yet. Fix: set checkpoint.every_steps, "
                                       "or train.nan_policy=skip")
        st = ckpt.read_state(tag_dir)
        if mcfg.frozen_groups_at(int(st["trainable_step"])) != mcfg.frozen_groups_at(trainer.trainable_step):
            trainer.rebuild(int(st["trainable_step"]))
        trainer.load(tag_dir, False)
        loader.load_state_dict(st["loader"])
        step, tokens_seen = int(st["step"]), int(st["tokens_seen"])
        logger.truncate_after(step)
        logger.message(f"rolled back to {tag_dir} (step {step}); skipping the offending batch")

    def evaluate() -> float:
        val = make_loader(cfg.data, "val", cfg.train.seq_len, cfg.global_batch_size, dp_rank,
                          layout.data_parallel, cfg.seed)
        return trainer.eval_loss(iter(val), cfg.train.eval_batches)

    flag = torch.zeros(1, device=device)
    try:
        while step < cfg.max_steps:
            if mcfg.frozen_groups_at(step) != mcfg.frozen_groups_at(trainer.trainable_step):
                logger.message(f"after step {step}: the freeze schedule changes the trainable set to "
                               f"frozen={sorted(mcfg.frozen_groups_at(step))}; rebuilding the engine")
                trainer.rebuild(step)
            t0 = time.perf_counter()
            safety.skip_marked_batches(loader, guard)
            position = safety.loader_position(loader)
            trainer.batch_index = None if position is None else position // cfg.global_batch_size
            batch = next(loader)
            lr = lr_at(cfg, step)
            trainer.set_lr(lr)
            loss, gn = trainer.train_step(batch)
            if trainer.nonfinite:            # the update was skipped on every rank
                action = guard.on_nonfinite(step, position, cfg.global_batch_size, loss)
                logger.message(f"non-finite loss {loss} at step {step + 1}, global samples [{position}, "
                               f"{position + cfg.global_batch_size if position is not None else '?'}): update skipped "
                               f"({action}; {guard.events}/{cfg.train.max_nan_skips} allowed)")
                if rank == 0:
                    with open(run_dir / "nonfinite.jsonl", "a") as f:
                        f.write(json.dumps({"step": step + 1, "samples": position, "loss": str(loss),
                                            "action": action}) + "\n")
                if action == "rollback":
                    rollback()
                continue
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step += 1
            tokens_seen += tokens_per_step
            result.losses[step] = loss
            rec: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "tokens_seen": tokens_seen}
            do_eval = cfg.train.eval_every_steps and (step % cfg.train.eval_every_steps == 0 or step == cfg.max_steps)
            if do_eval:
                rec["val_loss"] = result.val_losses[step] = evaluate()
            if step % cfg.logging.every_steps == 0 or step == cfg.max_steps or do_eval:
                fpt, _ = train_flops_per_token(mcfg, cfg.train.seq_len, step - 1)
                tps = tokens_per_step / dt
                rec.update(grad_norm=gn, tokens_per_s=tps, step_time_s=dt, tflops=tps * fpt / world / 1e12)
                if peak:
                    rec["mfu"] = rec["tflops"] / peak
                rec.update(memory_gib(device))
                logger.log(rec)
            # Preemption: every rank must agree before anyone saves.
            flag.fill_(1.0 if stop.requested else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                logger.message(f"signal received: saving a checkpoint at step {step} and stopping")
                result.last_checkpoint = save()
                result.interrupted = True
                break
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.max_steps:
                result.last_checkpoint = save()
            if stop_after_steps is not None and step >= stop_after_steps:
                break
        else:
            if cfg.checkpoint.save_final and step > start_step:
                result.last_checkpoint = save()
            elif resume_dir is not None and step == start_step:
                result.last_checkpoint = resume_dir
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        logger.close()
    result.final_step = step
    result.tokens_seen = tokens_seen
    if trainer.engine is not None:
        trainer.engine.destroy()
    return result


# ---- dry run ----------------------------------------------------------------------------

def dry_run(cfg: RunConfig, world_size: int, out=sys.stdout) -> dict[str, Any]:
    """Print the resolved config, parameter counts, FLOPs, memory per rank and layout;
    raise RecipeError for an impossible layout. Builds nothing real (meta tensors)."""
    from model import Transformer
    vocab = cfg.model.get("vocab_size")
    vocab_note = ""
    if vocab is None:
        try:
            vocab = make_loader(cfg.data, "train", cfg.train.seq_len, cfg.global_batch_size, 0, 1, cfg.seed).vocab_size
            vocab_note = " (from the data)"
        except Exception as e:  # noqa: BLE001 - a dry run reports, it does not need the data
            vocab_note = f" (preset default; data not readable: {e})"
    mcfg = model_config(cfg, vocab)
    layout = plan_layout(cfg, world_size, mcfg.num_layers)
    with torch.device("meta"):
        model = Transformer(mcfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    fpt, src = train_flops_per_token(mcfg, cfg.train.seq_len, 0)
    mem = memory_estimate(cfg, layout, trainable, total - trainable, mcfg.hidden_size, mcfg.num_layers,
                          mcfg.num_heads, mcfg.vocab_size)
    info = {"params_total": total, "params_trainable": trainable, "params_frozen": total - trainable,
            "frozen_groups": sorted(mcfg.frozen_groups_at(0)), "schedule_boundaries": mcfg.schedule_boundaries(),
            "train_flops_per_token": fpt, "flops_source": src, "memory_per_rank_gib": mem,
            "layout": layout.describe(), "tokens_per_step": cfg.tokens_per_step, "max_steps": cfg.max_steps}
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("# resolved config")
    p(yaml.safe_dump(resolved_config(cfg, mcfg), sort_keys=False).rstrip())
    p("# summary")
    p(f"vocab_size: {mcfg.vocab_size}{vocab_note}")
    p(f"parameters: total {total:,} | trainable {trainable:,} | frozen {total - trainable:,} "
      f"(frozen groups at step 0: {info['frozen_groups']}; schedule boundaries: {info['schedule_boundaries']})")
    p(f"FLOPs per token (fwd+bwd): {fpt:,.0f} [{src}]; per step: {fpt * cfg.tokens_per_step:.3e}")
    p(f"tokens per step: {cfg.tokens_per_step:,}; steps: {cfg.max_steps:,}; tokens: {cfg.tokens_per_step * cfg.max_steps:,}")
    p(f"layout: {layout.describe()}")
    fmt = lambda v: f"{v:.2f} GiB" if v >= 1 else f"{v * 1024:.2f} MiB"  # noqa: E731
    p("memory per rank (estimate): " + ", ".join(f"{k[:-4]} {fmt(v)}" for k, v in mem.items()))
    return info


# ---- CLI --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipes/X.yaml")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; train nothing")
    ap.add_argument("--world-size", type=int, default=None, help="world size for --dry-run (default: $WORLD_SIZE or 1)")
    ap.add_argument("--resume", default="auto", help="auto (latest complete checkpoint), never, or a path")
    ap.add_argument("--run-dir", default=None, help="default: runs/<name>")
    ap.add_argument("--overwrite", action="store_true", help="replace a different run already in the run dir")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_intermixed_args(argv)
    try:
        if args.dry_run:
            cfg = load_recipe(args.recipe, args.overrides)
            dry_run(cfg, args.world_size or int(os.environ.get("WORLD_SIZE", 1)))
            return 0
        res = train(args.recipe, args.overrides, run_dir=args.run_dir, resume=args.resume, overwrite=args.overwrite)
        shutdown_distributed()
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (safety.NonFiniteLoss, safety.CheckpointWriteFailed, safety.UnsafeCheckpoint, safety.RankFailure,
            DataError) as e:         # DataError here: data unreadable mid-run (e.g. a shard server outage)
        print(f"error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, safety.RankFailure):
            os._exit(3)                  # a dead peer can make process-group teardown hang
        return 3
    if int(os.environ.get("RANK", 0)) == 0:
        last = res.losses[max(res.losses)] if res.losses else float("nan")
        print(f"done: step {res.final_step}, tokens {res.tokens_seen:,}, last loss {last:.4f}, "
              f"checkpoint {res.last_checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
