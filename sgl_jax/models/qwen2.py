"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (never on o_proj)."""

from typing import Any

from sgl_jax.models.config import ModelConfig, dense_config_from_hf

ARCHITECTURES = ("Qwen2ForCausalLM",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf(hf, qkv_bias=True, o_bias=False)
