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
