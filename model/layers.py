"""Building blocks of the Llama-3 decoder and its variants (plain PyTorch).

Module and parameter names follow HuggingFace's LlamaForCausalLM (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj, input_layernorm, ...) so that export
and import are a rename of the top-level prefix and nothing else.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.constants import IGNORE_INDEX
from common.errors import ConfigError

from .config import ModelConfig
from .kernels.flash import flash_attention, flash_attention_varlen, segments_from_mask
from .kernels.loss import linear_cross_entropy
from .kernels.mixit_blocked import MixitParams, compute_drift, mixit_blocked
from .kernels.mixit_streamed import generate_tiles, mixit_streamed
from .kernels.mixit_triton import mixit_triton
from .kernels.select import (
    attention_backend,
    log_choice,
    mixit_backend,
    mixit_dense_bytes,
    mixit_streamed_bytes,
    sdpa_native_gqa,
)
from .mixit import branch_scale as mixit_branch_scale
from .mixit import mixing_matrix


class RMSNorm(nn.Module):
    """RMSNorm; `out_scale` multiplies the output (the final norm carries MixiT's LM-head width factor, so
    every head that reads it, pipeline stages and classifiers included, sees the same logits)."""

    def __init__(self, dim: int, eps: float, out_scale: float = 1.0):
        super().__init__()
        self.eps = eps
        self.out_scale = out_scale
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale: the same order as HF Llama.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return y if self.out_scale == 1.0 else y * self.out_scale


class ScaledLinear(nn.Linear):
    """nn.Linear whose output is multiplied by a constant (MixiT's width factor sqrt(base/fan_in))."""

    def __init__(self, in_features: int, out_features: int, bias: bool, out_scale: float = 1.0):
        super().__init__(in_features, out_features, bias=bias)
        self.out_scale = out_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.out_scale == 1.0 else y * self.out_scale


class LMHead(nn.Linear):
    """The output projection (vocab x hidden, no bias). Given labels it returns the next-token loss
    instead of the logits: chunked (kernels/loss.py, never the full (tokens, vocab) logits) unless
    `chunk` is 0. The loss runs inside this module's own forward, so a wrapper that gathers a
    module's parameters around its forward (ZeRO-3) covers it, the tied embedding matrix included."""

    def __init__(self, hidden: int, vocab: int, chunk: int):
        super().__init__(hidden, vocab, bias=False)
        self.chunk = chunk

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy(
            h.flatten(0, -2), self.weight, labels.flatten(), self.chunk, IGNORE_INDEX, reduction
        )


def width_factor(cfg: ModelConfig, fan_in: int, base: int | None) -> float:
    """MixiT's width factor sqrt(base / fan_in) (1 for other mixers, or without a base)."""
    return math.sqrt(base / fan_in) if cfg.mixer == "mixit" and base is not None else 1.0


def linear(cfg: ModelConfig, fan_in: int, fan_out: int, base: int | None = None) -> nn.Linear:
    """A projection; under MixiT its output times sqrt(base / fan_in), `base` defaulting to mixit_width_base."""
    scale = width_factor(cfg, fan_in, cfg.mixit_width_base if base is None else base)
    return nn.Linear(fan_in, fan_out, bias=cfg.bias) if scale == 1.0 else ScaledLinear(fan_in, fan_out, cfg.bias, scale)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies theta^(-2i/d_h), fp32, rescaled when cfg.rope_scaling asks for it."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, device=device, dtype=torch.int64).float() / dh))
    if cfg.rope_scaling is None:
        return inv_freq
    return llama3_scaled_inv_freq(inv_freq, cfg.rope_scaling)


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's RoPE scaling: frequencies whose wavelength exceeds original_max / low_freq_factor are
    divided by `factor`, those shorter than original_max / high_freq_factor are kept, and the band between
    interpolates linearly in original_max / wavelength. fp32 ops in the order HF uses, so tables match bit for bit."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short one
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    long_waves = torch.where(wavelen > context / low, inv_freq / factor, between)
    return torch.where(wavelen < context / high, inv_freq, long_waves)


def rope_cos_sin(
    cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (…, t, head_dim) for the half-rotation convention HF Llama uses: the angles are
    computed in fp32, then the tables are cast once to `dtype` (the activations' dtype, as HF does)."""
    inv_freq = rope_inv_freq(cfg, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, t, dh); cos/sin: (t, dh) or (b, t, dh). Rotates in x's dtype (HF Llama's order of
    operations): in bf16 no fp32 copy of q and k is made; the tables are cast if they are not x's dtype."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """SwiGLU (Llama) or MixiT's gated LeakyReLU with gain sqrt(2 / (1 + a^2))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(cfg, d, f)
        self.up_proj = linear(cfg, d, f)
        self.down_proj = linear(cfg, f, d, cfg.mixit_down_width_base)
        self.leaky_slope = None
        if cfg.mixer == "mixit" and cfg.mixit_leaky_c is not None:
            self.leaky_slope = 1.0 + cfg.mixit_leaky_c / math.sqrt(d)
            self.leaky_gain = math.sqrt(2.0 / (1.0 + self.leaky_slope**2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.leaky_slope is None:
            act = F.silu(gate)
        else:
            act = F.leaky_relu(gate, self.leaky_slope) * self.leaky_gain
        return self.down_proj(act * self.up_proj(x))


class KVCache:
    """Per-layer cache for incremental decoding: keys and values (softmax), values only (MixiT)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Tokens cached so far (read before a forward; layers use past_length during one)."""
        return self.past_length(0)

    def past_length(self, layer: int) -> int:
        return 0 if self.v[layer] is None else self.v[layer].shape[2]

    def update(self, layer: int, k: torch.Tensor | None, v: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.v[layer] is not None:
            v = torch.cat([self.v[layer], v], dim=2)
            k = None if k is None else torch.cat([self.k[layer], k], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class SoftmaxAttention(nn.Module):
    """Causal (or bidirectional) multi-head attention with RoPE and GQA.

    The `shaped` variant (Noci et al.) mixes with A = I + softmax(Q K^T / tau) - C, where C
    averages uniformly over the visible positions (C[i, j] = 1/(i+1), j <= i, when causal):
    out = V + softmax-attention(Q, K, V; 1/tau) - C V, with C V a running mean of V.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)
        self.record_attn = False  # eval probes: keep the last attention pattern
        self.last_attn: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.past_length(self.layer)
            k, v = cache.update(self.layer, k, v)
        groups = cfg.num_heads // cfg.num_kv_heads
        impl, reason = attention_backend(cfg.attn_impl, q, attn_mask, past, self.record_attn)
        cu_seqlens = None
        if impl == "flash_varlen":
            cu_seqlens = segments_from_mask(attn_mask)
            if cu_seqlens is None:
                impl, reason = "sdpa", "document mask is not contiguous segments"
        log_choice("attention", impl, reason)
        if impl == "eager":
            out = self._eager(q, _expand_kv(k, groups), _expand_kv(v, groups), past, attn_mask)
        elif impl == "flash":
            out = flash_attention(q, k, v, causal=cfg.causal, softmax_scale=cfg.attn_scale)
        elif impl == "flash_varlen":
            out = flash_attention_varlen(q, k, v, cu_seqlens, causal=cfg.causal, softmax_scale=cfg.attn_scale)
        else:
            mask, causal = self._sdpa_mask(t, past, attn_mask, q.device)
            if groups > 1 and sdpa_native_gqa(q, mask):  # K/V heads shared in the kernel, not copied
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, scale=cfg.attn_scale, enable_gqa=True
                )
            else:
                out = F.scaled_dot_product_attention(
                    q,
                    _expand_kv(k, groups),
                    _expand_kv(v, groups),
                    attn_mask=mask,
                    is_causal=causal,
                    scale=cfg.attn_scale,
                )
        if cfg.shaped:
            out = self._shape(out, _expand_kv(v, groups), past, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.hidden_size))

    def _shape(self, out: torch.Tensor, v: torch.Tensor, past: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Shaped attention: add the identity (V of the new rows) and subtract the uniform average C V."""
        if attn_mask is not None:
            raise NotImplementedError("shaped attention with document masking is not supported; pack without doc_ids")
        vf = v.float()
        if self.cfg.causal:
            count = torch.arange(1, vf.shape[2] + 1, device=v.device, dtype=torch.float32)[:, None]
            center = (vf.cumsum(dim=2) / count)[:, :, past:]
        else:
            center = vf.mean(dim=2, keepdim=True)
        return (out.float() + vf[:, :, past:] - center).to(out.dtype)

    def _sdpa_mask(self, t: int, past: int, attn_mask: torch.Tensor | None, device: torch.device):
        if attn_mask is None and (not self.cfg.causal or past == 0):
            return None, self.cfg.causal
        return _full_mask(self.cfg.causal, t, past, attn_mask, device), False

    def _eager(self, q, k, v, past, attn_mask):
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.cfg.attn_scale
        mask = _full_mask(self.cfg.causal, q.shape[2], past, attn_mask, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        if self.record_attn:
            self.last_attn = probs.detach()
        return (probs @ v.float()).to(q.dtype)


def _full_mask(causal: bool, t: int, past: int, attn_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """Boolean (…, t, past + t) mask: True = may attend. attn_mask: (b, t, past + t) extra constraint."""
    mask = None
    if causal:
        mask = torch.ones(t, past + t, dtype=torch.bool, device=device).tril(diagonal=past)
    if attn_mask is not None:
        extra = attn_mask[:, None]
        mask = extra if mask is None else (mask & extra)
    return mask


class MixingAttention(nn.Module):
    """MixiT's token mixer: concat_h(A_h V_h) W_o with fixed A (no Q, no K, no softmax).

    A is regenerated from the config seed on first use on a device and cached there
    (an attribute, not a buffer: it is never saved, never cast by .to(dtype), never broadcast).
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.v_proj = linear(cfg, d, kv)
        self.o_proj = linear(cfg, d, d)
        self._cache: dict[tuple, torch.Tensor] = {}
        self._params = None  # kernels.mixit_blocked.MixitParams, built on first use

    def impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The mixing implementation for this device (cfg.mixit_impl; 'auto': kernels/select.py)."""
        c = self.cfg
        nbytes = torch.finfo(dtype).bits // 8
        dense = mixit_dense_bytes(c.num_heads, c.num_layers, c.max_seq_len, nbytes)
        streamed = mixit_streamed_bytes(c.num_heads, c.num_layers, c.max_seq_len, nbytes, c.causal)
        impl, reason = mixit_backend(
            c.mixit_impl,
            c.max_seq_len,
            device,
            dense,
            streamed_bytes=streamed,
            causal=c.causal,
            layer=self.layer,
            num_layers=c.num_layers,
        )
        log_choice("mixit", impl, reason)
        return impl

    # torch._disable_dynamo is torch.compiler.disable applied at the first call: importing the model
    # does not import torch._dynamo (about 1.7 s), which a process that neither compiles nor builds on
    # the meta device then never pays
    @torch._disable_dynamo  # built once and cached: a compiled block sees only the cached tensor
    def drift(self, t: int, device: torch.device) -> torch.Tensor:
        """drift_h for heads 1..H-1, (H-1, n) fp32: computed blockwise once per device and cached."""
        n = self.cfg.max_seq_len if self.cfg.causal else t
        key = ("drift", str(device), n)
        if key not in self._cache:
            with torch.no_grad():
                self._cache[key] = compute_drift(self.mixit_params(), n, device, self.cfg.mixit_block_size)
        return self._cache[key]

    @torch._disable_dynamo  # generated once, cached, like the dense matrix
    def tiles(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Heads 1..H-1 as stored 64 x 64 tiles in `dtype` (kernels/mixit_streamed.py: causal, beta (M - drift
        1^T), the centering folded in; bidirectional, M): written once per device and dtype and kept for the
        model's life; the same tiles serve every t <= T."""
        key = ("tiles", str(device), dtype)
        if key not in self._cache:
            drift = self.drift(self.cfg.max_seq_len, device) if self.cfg.causal else None
            with torch.no_grad():
                self._cache[key] = generate_tiles(self.mixit_params(), dtype, device, drift)
        return self._cache[key]

    def mixit_params(self) -> MixitParams:
        """The layer's Philox keys and sigmas of heads 1..H-1, built on first use."""
        if self._params is None:
            self._params = MixitParams(self.cfg, self.layer)
        return self._params

    @torch._disable_dynamo  # built once, cached; traced into an inductor graph its build did not finish
    def matrix(self, t: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A for sequence length t, (H, t, t): the leading block of the T x T matrix when causal."""
        full_t = self.cfg.max_seq_len if self.cfg.causal else t
        key = (str(device), dtype, full_t)
        if key not in self._cache:
            self._cache[key] = mixing_matrix(self.cfg, self.layer, full_t, device, dtype)
        return self._cache[key][:, :t, :t]

    def document_matrix(self, attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(b, H, t, t) mixing for packed documents: each document mixed as if it were its own
        sequence starting at position 0. MixiT indexes A by absolute position, so this is the
        position reset that masking alone would not give. attn_mask (b, t, t) is True within a
        document; documents are contiguous, so a token's position in its document is the number
        of earlier tokens it may see. Dense (a gather from the cached T x T matrix)."""
        t = attn_mask.shape[1]
        seen = attn_mask & torch.ones(t, t, dtype=torch.bool, device=attn_mask.device).tril()
        pos = seen.sum(-1) - 1  # (b, t)
        a = self.matrix(t, attn_mask.device, dtype)[:, pos[:, :, None], pos[:, None, :]]  # (H, b, t, t)
        return a.transpose(0, 1) * seen[:, None]

    def forward(
        self, x: torch.Tensor, cos=None, sin=None, cache: KVCache | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        if attn_mask is not None and (cache is not None or not cfg.causal):
            raise NotImplementedError(
                "MixiT resets its mixing per document only in causal training forwards (no KV cache); "
                "pack without doc_ids"
            )
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        groups = cfg.num_heads // cfg.num_kv_heads
        if attn_mask is not None:  # each group's rows stacked against V's shared head (GQA), V not repeated
            a = self.document_matrix(attn_mask, v.dtype).reshape(b, cfg.num_kv_heads, groups * t, t)
            out = torch.matmul(a, v).view(b, cfg.num_heads, t, cfg.head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.hidden_size))
        past = 0
        if cache is not None:
            past = cache.past_length(self.layer)
            _, v = cache.update(self.layer, None, v)
        total = past + t
        if total > cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {total} exceeds model.max_seq_len={cfg.max_seq_len} (MixiT matrix size)"
            )
        impl = self.impl(x.device, v.dtype)
        if impl == "streamed":  # V's heads shared in the kernels (GQA), not repeated
            drift = self.drift(total, x.device)
            out = mixit_streamed(v, self.tiles(x.device, v.dtype), self.mixit_params(), drift, past, groups)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.hidden_size))
        if impl == "dense":
            a = self.matrix(total, x.device, v.dtype)[:, past:total, :total]  # rows of the new positions
            # one product per head over the whole batch, (H, t, total) @ (H, total, b*dh): a broadcast
            # matmul would first copy A to every sequence (b*H*t^2 entries a step). With GQA, head h reads
            # V's head h // groups: one product per member g of a group, heads g, g + groups, ... (a view
            # of A), against V's shared heads, so V is never repeated
            vh = v.permute(1, 2, 0, 3).reshape(cfg.num_kv_heads, total, b * cfg.head_dim)
            if groups == 1:
                out = torch.bmm(a, vh)
            else:
                a = a.unflatten(0, (cfg.num_kv_heads, groups))
                out = torch.stack([torch.bmm(a[:, g], vh) for g in range(groups)], 1)
            out = out.view(cfg.num_heads, t, b, cfg.head_dim).permute(2, 0, 1, 3)  # (b, H, t, dh)
        else:  # V's heads shared in the kernels (GQA), not repeated
            fn = mixit_triton if impl == "triton" else mixit_blocked
            drift = self.drift(total, x.device)
            out = fn(v, self.mixit_params(), drift, past, cfg.mixit_block_size, groups)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, cfg.hidden_size))


class Block(nn.Module):
    """Pre-norm decoder block. MixiT scales the residual: h <- s h + sqrt(1 - s^2) f(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MixingAttention(cfg, layer) if cfg.mixer == "mixit" else SoftmaxAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.skip_scale, self.branch_scale = 1.0, 1.0
        if cfg.mixer == "mixit":
            if cfg.mixit_depth_alpha != 0:
                self.branch_scale = mixit_branch_scale(cfg)
            elif cfg.mixit_residual_scale is not None:
                s = cfg.mixit_residual_scale
                self.skip_scale, self.branch_scale = s, math.sqrt(1.0 - s * s)

    def _residual(self, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if self.skip_scale == 1.0 and self.branch_scale == 1.0:
            return h + f
        return self.skip_scale * h + self.branch_scale * f

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self._residual(h, self.self_attn(self.input_layernorm(h), cos, sin, cache, attn_mask))
        return self._residual(h, self.mlp(self.post_attention_layernorm(h)))
