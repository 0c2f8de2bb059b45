"""PyTorch building blocks for the reference implementations tests compare against
(imports torch: for tests only)."""

from __future__ import annotations

import torch
from safetensors.numpy import load_file


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding (rotate-half form) on x [T, heads, hd]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = positions[:, None].double() * inv_freq[None]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None].float()
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None].float()
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def torch_tensors(path) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in load_file(str(path)).items()}


def causal_self_attention(w: dict[str, torch.Tensor], prefix: str, a: torch.Tensor, *,
                          heads: int, kv_heads: int, head_dim: int, theta: float
                          ) -> torch.Tensor:
    """Llama attention of one sequence a [T, in] with its own q/k/v/o projections
    (`{prefix}self_attn.*_proj.weight`), rope at positions 0..T-1 and a causal mask."""
    n, hd = a.shape[0], head_dim
    positions = torch.arange(n)
    q = rope((a @ w[prefix + "self_attn.q_proj.weight"].T).view(n, heads, hd), positions, theta)
    k = rope((a @ w[prefix + "self_attn.k_proj.weight"].T).view(n, kv_heads, hd), positions,
             theta)
    v = (a @ w[prefix + "self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
    return attn @ w[prefix + "self_attn.o_proj.weight"].T
