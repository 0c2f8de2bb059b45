"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) whose MLP is a mixture of experts in
the layers `decoder_sparse_step` and `mlp_only_layers` pick (`ModelConfig.is_moe_layer`); the
other layers keep the dense MLP of `intermediate_size`. The forward pass is llama.py's: a
decoder layer holding a router runs `sgl_jax.layers.moe`.

Expert tensors come in two spellings, both accepted, chosen per layer by what the
checkpoint holds:
  * per expert (the hub's, and what transformers 5's `save_pretrained` writes by default):
    `mlp.experts.{e}.{gate,up,down}_proj.weight`, [I, H], [I, H], [H, I];
  * fused (transformers 5's in-memory layout, written with `save_original_format=False`):
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
    `mlp.experts.down_proj` [E, H, I].
The router is `mlp.gate.weight` [E, H]. `checkpoint_tensors` exports the per-expert spelling.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sgl_jax.layers.weights import FusedPart, WeightSpec
from sgl_jax.models import llama
from sgl_jax.models.config import ModelConfig, dense_config_from_hf, moe_fields_from_hf

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
_ALL = slice(None)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return dense_config_from_hf(hf, qk_norm=True, **moe_fields_from_hf(hf))


def hf_weight_specs(config: ModelConfig, names: Collection[str] | None = None
                    ) -> dict[str, WeightSpec]:
    """The decoder's tensors, with each MoE layer's dense MLP replaced by its router and
    experts, in the spelling `names` (the checkpoint's tensors) use; per expert without it."""
    present = set(names or ())
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    dense_mlps = tuple(f"model.layers.{i}.mlp." for i in moe_layers)
    specs = {name: spec for name, spec in llama.hf_weight_specs(config).items()
             if not name.startswith(dense_mlps)}
    for i in moe_layers:
        prefix = f"model.layers.{i}.mlp."
        fused = prefix + "experts.gate_up_proj" in present
        specs.update(moe_layer_specs(config, prefix, ("layers", i), fused=fused))
    return specs


def moe_layer_specs(config: ModelConfig, prefix: str, path: tuple[str | int, ...], *,
                    fused: bool = False) -> dict[str, WeightSpec]:
    """Router and experts of one MoE MLP named `prefix`... (e.g. "model.layers.3.mlp."), and
    its shared expert when the config has one (Qwen3-Next)."""
    e, h = config.num_experts, config.hidden_size
    specs = {prefix + "gate.weight": WeightSpec((*path, "w_router"), (e, h))}
    if fused:
        specs.update(_fused_expert_specs(config, prefix, path))
    else:
        for expert in range(e):
            specs.update(_expert_specs(config, f"{prefix}experts.{expert}.", path, expert))
    if config.shared_expert_intermediate_size:
        specs.update(_shared_expert_specs(config, prefix, path))
    return specs


def _shared_expert_specs(config: ModelConfig, prefix: str, path: tuple[str | int, ...]
                         ) -> dict[str, WeightSpec]:
    """`shared_expert.{gate,up,down}_proj` into w_shared_gate_up [Is, 2, H] and
    w_shared_down [H, Is]; `shared_expert_gate` [1, H] into w_shared_gate."""
    h, inter = config.hidden_size, config.shared_expert_intermediate_size
    gate_up = (*path, "w_shared_gate_up")

    def half(j: int) -> FusedPart:
        return FusedPart((inter, 2, h), (inter, h), (_ALL, j))
    return {
        prefix + "shared_expert.gate_proj.weight": WeightSpec(gate_up, (inter, h), half(0)),
        prefix + "shared_expert.up_proj.weight": WeightSpec(gate_up, (inter, h), half(1)),
        prefix + "shared_expert.down_proj.weight": WeightSpec(
            (*path, "w_shared_down"), (h, inter)),
        prefix + "shared_expert_gate.weight": WeightSpec((*path, "w_shared_gate"), (1, h)),
    }


def _expert_specs(config: ModelConfig, prefix: str, path: tuple[str | int, ...], expert: int
                  ) -> dict[str, WeightSpec]:
    """One expert's gate, up and down into the stacks w_expert_gate_up [E, I, 2, H] and
    w_expert_down [E, H, I]."""
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate_up, down = (*path, "w_expert_gate_up"), (*path, "w_expert_down")

    def half(j: int) -> FusedPart:
        return FusedPart((e, inter, 2, h), (inter, h), (expert, _ALL, j))
    return {
        prefix + "gate_proj.weight": WeightSpec(gate_up, (inter, h), half(0)),
        prefix + "up_proj.weight": WeightSpec(gate_up, (inter, h), half(1)),
        prefix + "down_proj.weight": WeightSpec(
            down, (h, inter), FusedPart((e, h, inter), (h, inter), (expert,))),
    }


def _fused_expert_specs(config: ModelConfig, prefix: str, path: tuple[str | int, ...]
                        ) -> dict[str, WeightSpec]:
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    # [E, 2I, H] viewed as [E, 2, I, H], transposed to the stack's [E, I, 2, H]
    gate_up = FusedPart((e, inter, 2, h), (e, 2, inter, h), (_ALL,), axes=(0, 2, 1, 3))
    return {
        prefix + "experts.gate_up_proj": WeightSpec(
            (*path, "w_expert_gate_up"), (e, 2 * inter, h), gate_up),
        prefix + "experts.down_proj": WeightSpec((*path, "w_expert_down"), (e, h, inter)),
    }
