"""Parallel layout: checks that refuse impossible layouts, and the DeepSpeed config the
trainer hands to the engine (the per-rank memory estimate: pretrain/memory.py).

The JSON in ds_configs/ only says *how* to parallelise (ZeRO stage, offload, buckets).
Everything the recipe states (batch sizes, precision, optimizer, clipping) is filled in
here, and a template that sets one of those keys is refused, so the two never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import RecipeError

from .config import RunConfig, resolve_ds_config_path

# Keys the trainer owns; a ds_configs/ template must not set them.
RECIPE_OWNED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "data_types",
)

# zero_optimization sizes a template may leave "auto": filled from the model's hidden size h the way
# HF Transformers resolves them (buckets of one h x h matrix; tensors up to 10 h, the norm gains and
# biases, stay whole on every rank under ZeRO-3 instead of being gathered at each use).
AUTO_SIZES = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


@dataclass
class Layout:
    world_size: int
    pipeline_stages: int
    data_parallel: int
    micro_batch: int  # sequences per rank per forward pass
    grad_accum: int  # micro-batches per optimizer step (per pipeline: micro-batches in flight)
    global_batch: int  # sequences per optimizer step
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool

    def describe(self) -> str:
        off = [n for n, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        return (
            f"world={self.world_size} = pipeline {self.pipeline_stages} x data {self.data_parallel}; "
            f"ZeRO-{self.zero_stage}{' (CPU offload: ' + ', '.join(off) + ')' if off else ''}; "
            f"global batch {self.global_batch} seq = micro {self.micro_batch} x grad-accum {self.grad_accum} "
            f"x data {self.data_parallel}"
        )

    def check_layers(self, num_layers: int) -> None:
        """Refuse more pipeline stages than the model has layers (known once the data sized the model)."""
        if self.pipeline_stages > num_layers:
            raise RecipeError(
                f"parallel.pipeline_stages={self.pipeline_stages} exceeds the model's {num_layers} layers. "
                "Fix: use at most num_layers stages."
            )


def load_template(cfg: RunConfig) -> dict[str, Any]:
    path = resolve_ds_config_path(cfg.parallel.ds_config)
    try:
        tmpl = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e})") from None
    owned = [k for k in RECIPE_OWNED if k in tmpl]
    if owned:
        raise RecipeError(
            f"{path} sets {owned}, which the recipe owns (train.*, optim.*). "
            "Fix: remove them from the JSON and set them in the recipe."
        )
    zero = tmpl.get("zero_optimization", {})
    bad_auto = [k for k, v in zero.items() if v == "auto" and k not in AUTO_SIZES]
    if bad_auto:
        raise RecipeError(
            f'{path}: zero_optimization {bad_auto} cannot be "auto" (only {sorted(AUTO_SIZES)} can). '
            "Fix: give a number."
        )
    return tmpl


def plan_layout(cfg: RunConfig, world_size: int) -> Layout:
    """Check the layout for `world_size` ranks; raise RecipeError with the reason if impossible."""
    tmpl = load_template(cfg)
    zero = tmpl.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    pp = cfg.parallel.pipeline_stages
    if world_size % pp:
        raise RecipeError(
            f"world size {world_size} is not divisible by parallel.pipeline_stages={pp}. "
            f"Fix: use a world size that is a multiple of {pp}, or change pipeline_stages."
        )
    if pp > 1 and stage >= 2:
        raise RecipeError(
            f"pipeline parallelism (parallel.pipeline_stages={pp}) cannot be combined with ZeRO-{stage}: "
            "DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only. "
            "Fix: parallel.ds_config=pipeline (ZeRO-1) or zero1."
        )
    if pp > 1 and stage == 0 and cfg.train.precision == "bf16":
        raise RecipeError(
            "bf16 pipeline parallelism needs ZeRO-1: DeepSpeed's pipeline engine accumulates bf16 "
            "gradients in fp32 only with its ZeRO-1 optimizer. Fix: parallel.ds_config=pipeline "
            "(ZeRO-1) or zero1."
        )
    if pp > 1 and stage == 0 and cfg.train.grad_clip > 0:
        raise RecipeError(
            f"train.grad_clip={cfg.train.grad_clip} with pipeline parallelism and ZeRO-0: DeepSpeed's "
            "clipping there measures the norm of the first stage's gradients only, so every stage "
            "would be scaled by the wrong factor. Fix: parallel.ds_config=pipeline (ZeRO-1), "
            "or train.grad_clip=0."
        )
    if stage >= 3 and cfg.train.compile:
        raise RecipeError(
            "train.compile with ZeRO-3: torch.compile traces into DeepSpeed's parameter-gathering hooks around "
            "each block and recompiles for every block until it gives up (eager again). "
            "Fix: parallel.ds_config=zero1 or zero2, or train.compile=false."
        )
    if pp > 1 and ("offload_optimizer" in zero or "offload_param" in zero):
        raise RecipeError("CPU offload is not supported with pipeline parallelism. Fix: parallel.ds_config=pipeline.")
    dp = world_size // pp
    mb = cfg.train.micro_batch_sequences
    gbs = cfg.global_batch_size
    if gbs % (mb * dp):
        ok = [m for m in range(1, gbs + 1) if gbs % (m * dp) == 0]
        raise RecipeError(
            f"global batch {gbs} sequences is not divisible by micro_batch_sequences={mb} x "
            f"data-parallel {dp}. Fix: choose train.micro_batch_sequences from {ok[:8]} "
            f"or a global batch that is a multiple of {mb * dp}."
        )
    return Layout(
        world_size=world_size,
        pipeline_stages=pp,
        data_parallel=dp,
        micro_batch=mb,
        grad_accum=gbs // (mb * dp),
        global_batch=gbs,
        zero_stage=stage,
        offload_optimizer="offload_optimizer" in zero,
        offload_param="offload_param" in zero,
    )


def build_ds_config(cfg: RunConfig, layout: Layout, on_cpu: bool, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config: the template plus every value the recipe owns, and its "auto" sizes
    from the model's `hidden_size` (AUTO_SIZES)."""
    ds = load_template(cfg)
    zero = ds.get("zero_optimization", {})
    for key, size in AUTO_SIZES.items():
        if zero.get(key) == "auto":
            if hidden_size is None:
                raise ValueError(f'zero_optimization.{key} is "auto": pass the model\'s hidden_size')
            zero[key] = size(hidden_size)
    o, t = cfg.optim, cfg.train
    ds["train_batch_size"] = layout.global_batch
    ds["train_micro_batch_size_per_gpu"] = layout.micro_batch
    ds["gradient_accumulation_steps"] = layout.grad_accum
    ds["gradient_clipping"] = float(t.grad_clip)
    ds["bf16"] = {"enabled": t.precision == "bf16"}
    ds["fp16"] = {"enabled": False}
    if t.precision == "bf16" and layout.pipeline_stages > 1:
        # Accumulate micro-batch gradients in fp32 under pipeline parallelism.
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    torch_adam = bool(o.torch_adam or on_cpu)
    ds["optimizer"] = {
        "type": "AdamW",
        "params": {
            "lr": o.lr,
            "betas": list(o.betas),
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            "torch_adam": torch_adam,
            "adam_w_mode": True,
        },
    }
    if torch_adam and o.fused:  # passed through to torch.optim.AdamW
        ds["optimizer"]["params"]["fused"] = True
    return ds
