"""FLOP accounting per token, per variant (for MFU and for scaling studies).

Convention (PaLM / nanoGPT, torchtitan's too): a matmul with a weight of P entries costs 2P FLOPs per
token forward; attention costs 2*t*d for Q K^T and 2*t*d for A V per layer and token
(t = sequence length, no discount for the causal half; `causal_half=True` counts half of it for a
causal model, the work a kernel that skips the masked half does: the MFU printed beside the
convention's). Elementwise ops, norms and
softmax are not counted. The backward pass costs, for each matmul,
  * 2P for the input gradient, when anything upstream trains (always, except in a
    prefix of fully frozen layers under frozen embeddings), and
  * 2P for the weight gradient, only when that weight trains.
So `standard` costs 6N + 12 L t d per token (N = matmul weights, head included,
embedding lookup excluded). What the variants save, per layer and token:
  * frozen_qk:  2 (P_q + P_k)           (no weight gradients for W_q, W_k)
  * frozen_mlp: 2 P_mlp
  * mixit:      6 (P_q + P_k) and 8 t d (no Q/K projections; forward keeps only A V,
                2td, and backward only dV = A^T dO, 2td: A is fixed, so no dA, dQ, dK)
  * random_transformer: 2 P_layer per layer (weights frozen; input gradients still
                flow to the trainable embeddings).
"""

from __future__ import annotations

from .config import ModelConfig


def flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, step: int = 0, causal_half: bool = False
) -> dict[str, float]:
    """Forward and training (forward + backward) FLOPs per token at optimizer step `step`; `causal_half`:
    attention's causal half only (a causal model's)."""
    t = cfg.max_seq_len if seq_len is None else seq_len
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    frozen = cfg.frozen_groups_at(step)

    def trains(*groups: str) -> bool:
        return not (set(groups) & frozen)

    fwd = bwd = 0.0
    upstream = trains("embeddings")  # does anything before this op need gradients?
    for _ in range(cfg.num_layers):
        ops = []  # (weight entries, groups)
        if cfg.mixer == "softmax":
            ops += [(d * d, ("qk", "blocks")), (d * kv, ("qk", "blocks"))]
        ops += [(d * kv, ("v", "blocks"))]
        for p, groups in ops:
            fwd += 2 * p
            bwd += (2 * p if upstream else 0) + (2 * p if trains(*groups) else 0)
        upstream = upstream or any(trains(*g) for _, g in ops)
        attn = (4 if cfg.mixer == "softmax" else 2) * t * d * (0.5 if causal_half and cfg.causal else 1)
        fwd += attn
        # softmax backward: dQ, dK, dP, dV (2x forward); MixiT backward: only dV = A^T dO (1x)
        bwd += (2 * attn if cfg.mixer == "softmax" else attn) if upstream else 0
        for p, groups in [(d * d, ("o", "blocks")), (2 * d * f, ("mlp", "blocks")), (f * d, ("mlp", "blocks"))]:
            fwd += 2 * p
            bwd += (2 * p if upstream else 0) + (2 * p if trains(*groups) else 0)
            upstream = upstream or trains(*groups)
    head_groups = ("head", "embeddings") if cfg.tie_embeddings else ("head",)
    fwd += 2 * d * v
    bwd += (2 * d * v if upstream else 0) + (2 * d * v if trains(*head_groups) else 0)
    return {"forward": fwd, "backward": bwd, "train": fwd + bwd}
