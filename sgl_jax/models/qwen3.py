"""Qwen3: the Llama decoder with per-head q/k RMSNorm before RoPE and an explicit head_dim."""

from typing import Any

from sgl_jax.models.config import ModelConfig, dense_config_from_hf

ARCHITECTURES = ("Qwen3ForCausalLM",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf(hf, qk_norm=True)
