"""Maps the `architectures` entry of a config.json to the code that implements it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_jax.models import llama, qwen2, qwen3, qwen3_moe, qwen3_next
from sgl_jax.models.config import ModelConfig


@dataclass(frozen=True)
class ModelImpl:
    """One architecture: how to read its config and name its tensors; the forward pass comes
    from the decoder. `hf_weight_specs(config, names=None)`: `names`, the checkpoint's
    tensors, pick between spellings where an architecture has several. A hybrid model's
    forward also takes `state_slots` (and `linear_attention`, see qwen3_next)."""

    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    hf_weight_specs: Callable = llama.hf_weight_specs
    forward: Callable = llama.forward
    compute_logits: Callable = llama.compute_logits
    ignored_tensor_prefixes: tuple[str, ...] = ()  # checkpoint tensors inference never uses


_REGISTRY: dict[str, ModelImpl] = {
    arch: ModelImpl(config_from_hf=module.config_from_hf)
    for module in (llama, qwen2, qwen3)
    for arch in module.ARCHITECTURES
} | {
    arch: ModelImpl(config_from_hf=qwen3_moe.config_from_hf,
                    hf_weight_specs=qwen3_moe.hf_weight_specs)
    for arch in qwen3_moe.ARCHITECTURES
} | {
    arch: ModelImpl(config_from_hf=qwen3_next.config_from_hf,
                    hf_weight_specs=qwen3_next.hf_weight_specs, forward=qwen3_next.forward,
                    compute_logits=qwen3_next.compute_logits,
                    ignored_tensor_prefixes=qwen3_next.IGNORED_TENSOR_PREFIXES)
    for arch in qwen3_next.ARCHITECTURES
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_impl(hf_config: dict[str, Any]) -> ModelImpl:
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
