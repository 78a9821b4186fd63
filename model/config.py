"""Model configuration: one dataclass that fully determines the network.

A config is everything needed to rebuild a model bit-for-bit, including the
MixiT seed: the fixed random mixing matrices are regenerated from it rather than
stored, so checkpoints stay small and two constructions always agree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError, did_you_mean

# The variants and what each one is made of: which token mixer, and which named
# parameter groups start frozen. Every variant is a preset of the same freezing
# mechanism (model/freezing.py), so schedules and overrides compose with all of them.
VARIANTS: dict[str, dict[str, Any]] = {
    "standard": {"mixer": "softmax", "frozen": ()},
    "frozen_qk": {"mixer": "softmax", "frozen": ("qk",)},
    "frozen_mlp": {"mixer": "softmax", "frozen": ("mlp",)},
    "mixit": {"mixer": "mixit", "frozen": ()},
    # Zhong & Andreas: only the embeddings and the output head train.
    "random_transformer": {"mixer": "softmax", "frozen": ("blocks", "norms")},
    # Noci et al.'s shaped attention: A = I + softmax(Q K^T s) - C (C the causal uniform average).
    "shaped": {"mixer": "softmax", "frozen": (), "shaped": True},
}
# Named parameter groups a schedule or override can freeze (model/freezing.py maps names to groups).
PARAM_GROUPS = ("qk", "v", "o", "mlp", "norms", "embeddings", "head", "blocks")
ATTN_IMPLS = ("auto", "sdpa", "eager", "flash")
MIXIT_IMPLS = ("auto", "dense", "blocked", "triton", "streamed")
POOLINGS = ("last", "mean")  # a sequence classifier's pooling (model/classifier.py)
DEFAULT_POOLING = "last"
PARAMETRIZATIONS = ("standard", "mup")  # model.parametrization: µP scales init, rates and logits by width
MIXIT_RNGS = ("philox", "philox4x")  # one normal per Philox call, or four (model/rng.py matrix_normals)
# RoPE scalings model.rope_scaling may name, and the keys each one needs (the HF rope_parameters names).
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# MixiT counters are i*T + j in 32 bits (the Triton RNG's offset), so T*T < 2**31.
MAX_MIXIT_SEQ_LEN = 46340


def _bad(field_name: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"model.{field_name}: {problem}. Fix: {fix}.")


def _is_int(value: Any, low: int) -> bool:
    """An int (not a bool) >= low."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass
class ModelConfig:
    # Shape
    vocab_size: int = 32000
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None -> num_heads (no GQA)
    intermediate_size: int | None = None  # None -> 8/3 * hidden, rounded up to a multiple of 64
    max_seq_len: int = 256  # T: RoPE table / MixiT matrix size
    # Llama details
    rope_theta: float = 10000.0
    # None: plain RoPE. Llama-3.1/3.2: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (low frequencies divided by factor, a smooth band between).
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    bias: bool = False  # biases on every projection (the reference turned them on)
    init_std: float = 0.02
    # std of W_q, W_k at init in every variant, trained or frozen, so that standard and frozen_qk differ
    # only in freezing. None -> 1/sqrt(hidden) (the paper's rule for frozen Q/K); 0.02 is the reference
    # code's (and Llama's) choice for both.
    qk_init_std: float | None = None
    # Variant and freezing
    variant: str = "standard"
    frozen_groups: list[str] | None = None  # None -> the variant's preset
    # Freeze/unfreeze schedule: [[step, [groups...]], ...]; from `step` on, exactly these groups are frozen.
    freeze_schedule: list[list[Any]] = field(default_factory=list)
    # MixiT (VARIANTS.md); only read when variant == "mixit"
    mixit_seed: int = 0
    mixit_rng: str = "philox"  # how M's entries are drawn from the seed: MIXIT_RNGS (model/rng.py)
    mixit_beta: float = 1.0
    mixit_depth_alpha: float = 0.0  # != 0: the reference's other path (no identity, sigma=1/sqrt(T), branch scale)
    mixit_depth_base_layers: int = 2  # L_base in the branch scale (L_base / L) ** alpha
    mixit_residual_scale: float | None = 0.5  # s in h <- s h + sqrt(1-s^2) f(norm(h)); None -> plain residual
    mixit_leaky_c: float | None = -1.0  # gated LeakyReLU slope a = 1 + c/sqrt(d); None -> SwiGLU
    mixit_width_base: int | None = 512  # projection outputs times sqrt(base/fan_in); None -> off
    mixit_down_width_base: int | None = None  # down_proj's base; None -> mixit_width_base (the reference: 1)
    mixit_head_width_base: int | None = (
        None  # the LM head's output times sqrt(base/hidden); None -> off (reference: 512)
    )
    mixit_pos_embedding: bool = True  # learned absolute positions added to token embeddings
    shaped_tau0: float = 1.0  # shaped attention temperature: tau = tau0 sqrt(d_h) (d / d_base)
    shaped_width_base: int = 512  # d_base in that temperature
    causal: bool = True  # False: bidirectional (sequence classification)
    # Maximal update parametrisation (Yang et al., Tensor Programs V): "mup" scales, by m = hidden_size /
    # mup_base_width, the init std of hidden matrices (1/sqrt(m)), their Adam rate (1/m: the optimizer's
    # param groups), the logits (1/m) and the attention logits (1/d_h in place of 1/sqrt(d_h)), so that
    # a rate tuned at the base width transfers. "standard": none of these.
    parametrization: str = "standard"
    mup_base_width: int = 256
    # the base model's head dim in µP's 1/d_h: None -> mup_base_width // num_heads (the heads stay as the
    # width grows, so d_h grows); a ladder that adds heads at a fixed head dim sets that dim (1/sqrt(d_h))
    mup_base_head_dim: int | None = None
    # Implementation choices (do not change the function computed)
    attn_impl: str = "auto"
    mixit_impl: str = "auto"
    mixit_block_size: int = 128
    compile_blocks: bool = False  # torch.compile each decoder block (CPU and GPU)
    loss_chunk_tokens: int = 1024  # loss from `labels` in chunks of this many tokens; 0 -> full logits

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.qk_init_std is None:
            self.qk_init_std = 1.0 / math.sqrt(self.hidden_size)
        if self.frozen_groups is not None:
            self.frozen_groups = list(self.frozen_groups)
        self.freeze_schedule = [[int(s), list(g)] for s, g in self.freeze_schedule]
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = dict(self.rope_scaling)  # a copy: two configs never share one dict
        self.validate()

    # ---- validation: one clear error per rule -------------------------------------------
    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
            "mixit_block_size",
        ):
            value = getattr(self, name)
            if not _is_int(value, 1):
                raise _bad(name, f"must be a positive integer, got {value!r}", f"set {name} to an integer >= 1")
        if self.variant not in VARIANTS:
            hint = did_you_mean(self.variant, VARIANTS)
            raise _bad("variant", f"unknown variant {self.variant!r}", f"{hint}choose one of {sorted(VARIANTS)}")
        if self.hidden_size % self.num_heads:
            raise _bad(
                "hidden_size",
                f"{self.hidden_size} is not divisible by num_heads={self.num_heads}",
                "choose hidden_size a multiple of num_heads",
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise _bad(
                "num_heads",
                f"head dim {self.hidden_size // self.num_heads} is odd; RoPE needs an even head dim",
                "choose num_heads so hidden_size/num_heads is even",
            )
        if self.num_heads % self.num_kv_heads:
            raise _bad(
                "num_kv_heads",
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
                "choose num_kv_heads dividing num_heads (GQA groups must be equal)",
            )
        if self.variant == "mixit" and self.max_seq_len > MAX_MIXIT_SEQ_LEN:
            raise _bad(
                "max_seq_len",
                f"{self.max_seq_len} exceeds the MixiT limit {MAX_MIXIT_SEQ_LEN} (32-bit RNG counters)",
                f"use max_seq_len <= {MAX_MIXIT_SEQ_LEN}",
            )
        for name in ("mixit_width_base", "mixit_down_width_base", "mixit_head_width_base"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name), 1):
                raise _bad(
                    name, f"must be a positive integer or null, got {getattr(self, name)!r}", "e.g. 512, or null"
                )
        scale = self.mixit_residual_scale
        if self.variant == "mixit" and scale is not None and not 0.0 < scale <= 1.0:
            raise _bad(
                "mixit_residual_scale",
                f"{scale} is outside (0, 1]",
                "use a value in (0, 1], e.g. 0.5, or null for the plain residual",
            )
        if self.shaped_tau0 <= 0 or not _is_int(self.shaped_width_base, 1):
            raise _bad(
                "shaped_tau0/shaped_width_base",
                f"got {self.shaped_tau0!r}/{self.shaped_width_base!r}",
                "use a positive temperature and a positive integer base width",
            )
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0 and self.init_std > 0 and self.qk_init_std > 0):
            raise _bad("rope_theta/rms_norm_eps/init_std/qk_init_std", "must be positive", "set positive values")
        self._validate_rope_scaling()
        if self.mixit_seed < 0 or self.mixit_seed >= 2**32:
            raise _bad("mixit_seed", f"{self.mixit_seed} is outside [0, 2**32)", "use a 32-bit unsigned seed")
        if self.attn_impl not in ATTN_IMPLS:
            raise _bad("attn_impl", f"unknown {self.attn_impl!r}", f"choose one of {list(ATTN_IMPLS)}")
        if not isinstance(self.compile_blocks, bool):
            raise _bad(
                "compile_blocks",
                f"must be true or false, got {self.compile_blocks!r}",
                "set compile_blocks to a boolean",
            )
        if not _is_int(self.loss_chunk_tokens, 0):
            raise _bad(
                "loss_chunk_tokens",
                f"must be an integer >= 0, got {self.loss_chunk_tokens!r}",
                "use e.g. 4096, or 0 to compute the loss from full logits",
            )
        if self.parametrization not in PARAMETRIZATIONS:
            hint = did_you_mean(str(self.parametrization), PARAMETRIZATIONS)
            raise _bad(
                "parametrization", f"unknown {self.parametrization!r}", f"{hint}choose one of {list(PARAMETRIZATIONS)}"
            )
        if self.mup_base_head_dim is not None and not _is_int(self.mup_base_head_dim, 1):
            raise _bad("mup_base_head_dim", f"{self.mup_base_head_dim!r} is not a positive integer", "e.g. 64, or null")
        if not _is_int(self.mup_base_width, 1) or (
            self.parametrization == "mup" and self.mup_base_head_dim is None and self.mup_base_width % self.num_heads
        ):
            raise _bad(
                "mup_base_width",
                f"{self.mup_base_width!r} is not a positive multiple of num_heads={self.num_heads}",
                "use the width the rates were tuned at, e.g. 256, or set mup_base_head_dim where heads grow with the width",
            )
        if self.parametrization == "mup" and self.mixer == "mixit" and self.mixit_width_base is not None:
            raise _bad(
                "mixit_width_base",
                "MixiT's width factors and µP's multipliers both rescale the projections",
                "set mixit_width_base: null under parametrization: mup",
            )
        if self.mixit_rng not in MIXIT_RNGS:
            raise _bad("mixit_rng", f"unknown {self.mixit_rng!r}", f"choose one of {list(MIXIT_RNGS)}")
        if self.mixit_impl not in MIXIT_IMPLS:
            raise _bad("mixit_impl", f"unknown {self.mixit_impl!r}", f"choose one of {list(MIXIT_IMPLS)}")
        groups = list(self.frozen_groups or [])
        for step, sched_groups in self.freeze_schedule:
            if step < 0:
                raise _bad("freeze_schedule", f"negative step {step}", "use steps >= 0")
            groups += sched_groups
        for g in groups:
            if g not in PARAM_GROUPS:
                hint = did_you_mean(g, PARAM_GROUPS)
                raise _bad("frozen_groups", f"unknown parameter group {g!r}", f"{hint}choose from {list(PARAM_GROUPS)}")
        steps = [s for s, _ in self.freeze_schedule]
        if steps != sorted(set(steps)):
            raise _bad("freeze_schedule", f"steps {steps} are not strictly increasing", "list each step once, in order")

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        example = "{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}"
        if not isinstance(rs, dict):
            raise _bad("rope_scaling", f"must be a mapping or null, got {rs!r}", f"use null (plain RoPE) or {example}")
        kind = rs.get("rope_type")
        if kind not in ROPE_SCALING_KEYS:
            raise _bad(
                "rope_scaling",
                f"RoPE scaling type {kind!r} is not supported (supported: plain RoPE and "
                f"{', '.join(repr(k) for k in ROPE_SCALING_KEYS)}, as in Llama-3.1/3.2)",
                f"use null or {example}; linear, dynamic, yarn and longrope scalings are not implemented",
            )
        need = set(ROPE_SCALING_KEYS[kind])
        missing, extra = sorted(need - set(rs)), sorted(set(rs) - need - {"rope_type"})
        if missing or extra:
            raise _bad(
                "rope_scaling",
                f"{kind} needs exactly {sorted(need)} besides rope_type (missing {missing}, unknown {extra})",
                f"write it as {example}",
            )
        if self.mixer == "mixit":
            raise _bad("rope_scaling", "MixiT has no rotary embedding to scale", "set rope_scaling to null for mixit")
        num = {k: rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor")}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in num.values()):
            raise _bad(
                "rope_scaling", f"factor/low_freq_factor/high_freq_factor must be numbers, got {num}", f"e.g. {example}"
            )
        if not (num["factor"] >= 1.0 and 0 < num["low_freq_factor"] < num["high_freq_factor"]):
            raise _bad(
                "rope_scaling",
                f"need factor >= 1 and 0 < low_freq_factor < high_freq_factor, got {num}",
                "use Llama-3.1's factor 8, low_freq_factor 1, high_freq_factor 4 (Llama-3.2: factor 32)",
            )
        old = rs["original_max_position_embeddings"]
        if not _is_int(old, 1):
            raise _bad(
                "rope_scaling",
                f"original_max_position_embeddings must be a positive integer, got {old!r}",
                "set it to the context length of the unscaled pretraining (8192 for Llama-3.1/3.2)",
            )

    # ---- derived quantities ------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mixer(self) -> str:
        return VARIANTS[self.variant]["mixer"]

    @property
    def shaped(self) -> bool:
        return bool(VARIANTS[self.variant].get("shaped", False))

    @property
    def attn_scale(self) -> float:
        """Softmax logit scale: 1/sqrt(d_h), or shaped attention's 1/tau."""
        if self.shaped:
            return 1.0 / (self.shaped_tau0 * math.sqrt(self.head_dim) * (self.hidden_size / self.shaped_width_base))
        if self.parametrization == "mup":  # 1/d_h, equal to 1/sqrt(d_h) at the base width
            return math.sqrt(self.mup_base_head_dim or self.mup_base_width // self.num_heads) / self.head_dim
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def width_mult(self) -> float:
        """µP's m = hidden_size / mup_base_width (1 under the standard parametrisation)."""
        return self.hidden_size / self.mup_base_width if self.parametrization == "mup" else 1.0

    def frozen_groups_at(self, step: int) -> set[str]:
        """Frozen groups in effect at optimizer step `step` under the freeze schedule."""
        groups = set(VARIANTS[self.variant]["frozen"] if self.frozen_groups is None else self.frozen_groups)
        for start, sched_groups in self.freeze_schedule:
            if step >= start:
                groups = set(sched_groups)
        return groups

    def schedule_boundaries(self) -> list[int]:
        return [s for s, _ in self.freeze_schedule if s > 0]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in d if k not in names]
        if unknown:
            k = unknown[0]
            hint = did_you_mean(k, names).strip() or f"valid keys: {sorted(names)}"
            raise ConfigError(f"model.{k}: unknown key. Fix: {hint}")
        return cls(**d)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# A size ladder for scaling studies. The big ones are the Llama-3 shapes
# (Llama-3.2-1B/3B, Llama-3-8B); the small ones run on a CPU.
_LLAMA3 = dict(num_kv_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_seq_len=2048)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192),
    "xs": dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384),
    "s": dict(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=768),
    "m": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536),
    "l": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048),
    "xl": dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=2816),
    "1b": dict(_LLAMA3, hidden_size=2048, num_layers=16, num_heads=32, intermediate_size=8192, tie_embeddings=True),
    "3b": dict(_LLAMA3, hidden_size=3072, num_layers=28, num_heads=24, intermediate_size=8192, tie_embeddings=True),
    "8b": dict(_LLAMA3, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=14336),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig from the size ladder, with field overrides."""
    if name not in PRESETS:
        hint = did_you_mean(name, PRESETS)
        raise ConfigError(f"model.preset: unknown preset {name!r}. Fix: {hint}choose one of {list(PRESETS)}.")
    return ModelConfig(**{**PRESETS[name], **overrides})


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Closed-form parameter counts (the test checks them against real modules).

    Returns total, embedding (token + MixiT positions), head (0 when tied) and
    per-layer counts. Biases follow cfg.bias: q,k,v,o and the three MLP projections.
    """
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    b = 1 if cfg.bias else 0
    if cfg.mixer == "mixit":
        attn = (d * kv + b * kv) + (d * d + b * d)  # v, o only
    else:
        attn = (d * d + b * d) + 2 * (d * kv + b * kv) + (d * d + b * d)
    mlp = 2 * (d * f + b * f) + (f * d + b * d)
    norms = 2 * d
    layer = attn + mlp + norms
    embed = v * d + (cfg.max_seq_len * d if cfg.mixer == "mixit" and cfg.mixit_pos_embedding else 0)
    head = 0 if cfg.tie_embeddings else v * d
    total = embed + cfg.num_layers * layer + d + head
    return {
        "total": total,
        "embedding": embed,
        "head": head,
        "per_layer": layer,
        "attention_per_layer": attn,
        "mlp_per_layer": mlp,
        "non_embedding": total - embed,
    }
