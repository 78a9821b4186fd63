"""Adam moments across a freeze-schedule boundary.

When the model's freeze schedule changes the trainable set, the engine is rebuilt before that
step (`ModelEngine.rebuild`): weights, step, LR schedule and data position carry over; the Adam
moments of tensors that stay trainable carry over under ZeRO 0/1/2 and pipeline (ZeRO-1);
newly trainable tensors start with zero moments and the old Adam step count (no
bias-correction restart); under ZeRO-3 and CPU offload all moments restart (docs/TRAINING.md).
"""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _moment_mode(model_engine) -> str | None:
    """'hp' (ZeRO-1/2 or bf16 wrappers: DeepSpeed's fragment API), 'plain' (ZeRO-0 fp32:
    the torch optimizer holds the parameters themselves), None (ZeRO-3 / offload: reset)."""
    if model_engine.zero3 or model_engine.layout.offload_optimizer:
        return None
    params = [p for p in model_engine.module.parameters() if p.requires_grad]
    if params and all(hasattr(p, "_hp_mapping") for p in params):
        return "hp"
    if model_engine.inner_optimizer is model_engine.engine.optimizer and model_engine.layout.zero_stage == 0:
        return "plain"
    return None


def _link_fragments(model_engine) -> None:
    # DeepSpeed links each parameter to its optimizer-state fragments after the first step;
    # a freshly built (or just loaded) engine has not stepped yet.
    opt = model_engine.engine.optimizer
    link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        opt._hp_optimizer_states_linked = False
        link()


def optimizer_snapshot(model_engine) -> tuple[dict[str, dict[str, torch.Tensor]], float] | None:
    """(name -> {exp_avg, exp_avg_sq}, adam step) for the current trainable tensors, or None."""
    mode = _moment_mode(model_engine)
    inner = model_engine.inner_optimizer
    steps = [st["step"] for st in inner.state.values() if "step" in st]
    if mode is None or not steps:
        return None
    from deepspeed.utils import safe_get_full_optimizer_state  # deferred: heavy (deepspeed)

    _link_fragments(model_engine)
    snap = {}
    for p in model_engine.module.parameters():
        if not p.requires_grad or id(p) not in model_engine.name_of:
            continue
        if mode == "plain":
            st = inner.state.get(p, {})
            snap[model_engine.name_of[id(p)]] = {k: st[k].detach().clone() for k in MOMENTS if k in st}
        else:
            snap[model_engine.name_of[id(p)]] = {
                k: safe_get_full_optimizer_state(p, k).detach().clone() for k in MOMENTS
            }
    return snap, float(steps[0])


def optimizer_restore(model_engine, snap: dict[str, dict[str, torch.Tensor]], step: float) -> None:
    """Seed the new optimizer: carried moments for tensors that stayed trainable, zeros for
    newly trainable ones, and the old Adam step count for all (no bias-correction restart)."""
    mode = _moment_mode(model_engine)
    if mode is None:
        return
    from deepspeed.utils import safe_set_full_optimizer_state  # deferred: heavy (deepspeed)

    inner = model_engine.inner_optimizer
    for group in inner.param_groups:
        for fp in group["params"]:
            if len(inner.state.get(fp, {})) == 0:
                inner.state[fp] = {
                    "step": torch.tensor(step),
                    "exp_avg": torch.zeros_like(fp),
                    "exp_avg_sq": torch.zeros_like(fp),
                }
    _link_fragments(model_engine)
    for p in model_engine.module.parameters():
        name = model_engine.name_of.get(id(p))
        if not p.requires_grad or name not in snap:
            continue
        for k, v in snap[name].items():
            if mode == "plain":
                inner.state[p][k].copy_(v.to(inner.state[p][k].device, inner.state[p][k].dtype))
            else:
                safe_set_full_optimizer_state(p, v, k)
