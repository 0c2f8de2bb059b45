"""Model configuration parsed once from a Hugging Face `config.json` (the rotary settings by
`RopeConfig.from_hf`, which accepts both of their spellings), and what it allows tensor
parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from sgl_jax.layers.gated_delta_net import GdnConfig
from sgl_jax.layers.rotary import RopeConfig


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs; hashable so jitted functions can close over it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always, Llama via attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None
    # Mixture of experts (Qwen3-MoE); num_experts 0 means every layer has the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top k of the router
    moe_intermediate_size: int = 0  # of each routed expert
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # Hybrid decoders (Qwen3-Next): per layer "full_attention" or "linear_attention" (Gated
    # DeltaNet, shaped by `linear_attention`); empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: GdnConfig | None = None
    partial_rotary_factor: float = 1.0  # rotary on the first fraction of each head's features
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: out * sigmoid(gate)
    zero_centered_norm: bool = False  # RMSNorm scales by (1 + weight), in float32

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, i: int) -> bool:
        """Whether layer i is linear attention (Gated DeltaNet) rather than full attention."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer keeps a recurrent state per request instead of KV pages."""
        return any(self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def num_attention_layers(self) -> int:
        """Layers with a paged KV cache."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i has a mixture-of-experts MLP (else the dense one)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer has the dense MLP of `intermediate_size`."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, but "
                             f"num_hidden_layers is {self.num_layers}")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported; supported: "
                             "full_attention, linear_attention")
        if self.is_hybrid and self.linear_attention is None:
            raise ValueError("linear_attention layers need the linear_* config fields")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                             f"{self.head_dim} gives {self.rotary_dim} rotary features; it "
                             "must give an even number between 2 and head_dim")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )


def check_tensor_parallel(config: ModelConfig, tp_size: int, what: str = "the model") -> None:
    """A clear error when `config` cannot be split `tp_size` ways."""
    problems = tensor_parallel_problems(config, tp_size)
    if problems:
        usable = [t for t in range(1, len(jax.devices()) + 1)
                  if not tensor_parallel_problems(config, t)]
        raise ValueError(
            f"--tp-size {tp_size} cannot split {what}: {'; '.join(problems)}. Sizes "
            f"that work with the {len(jax.devices())} device(s) here: "
            f"{', '.join(map(str, usable))}")


def tensor_parallel_problems(config: ModelConfig, tp: int) -> list[str]:
    """What keeps `config` from being split `tp` ways (empty when nothing does)."""
    problems = []
    if config.num_heads % tp:
        problems.append(f"{config.num_heads} attention heads do not divide by {tp}")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"{kv} KV heads neither divide by {tp} nor divide {tp}")
    if config.has_dense_mlp and config.intermediate_size % tp:
        problems.append(f"intermediate size {config.intermediate_size} does not divide by {tp}")
    if config.num_experts and config.moe_intermediate_size % tp:
        problems.append(f"expert intermediate size {config.moe_intermediate_size} does not "
                        f"divide by {tp}")
    if config.shared_expert_intermediate_size % tp:
        problems.append(f"shared expert intermediate size "
                        f"{config.shared_expert_intermediate_size} does not divide by {tp}")
    linear = config.linear_attention
    if config.is_hybrid and linear.num_key_heads % tp:
        problems.append(f"{linear.num_key_heads} linear-attention key heads do not divide by "
                        f"{tp}")
    return problems


def dense_config_from_hf(hf: dict[str, Any], **arch_flags: Any) -> ModelConfig:
    """Parse the fields every Llama-like decoder shares; `arch_flags` set what the family fixes."""
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; only 'silu' is")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    num_heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
    flags = {"qkv_bias": attention_bias, "o_bias": attention_bias} | arch_flags
    config = ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_hf(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
        checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        **flags,
    )
    config.validate()
    return config


def moe_fields_from_hf(hf: dict[str, Any], shared_expert: bool = False) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen-style MoE config.json, as ModelConfig keyword
    arguments. The hub writes `num_experts`; transformers 5 saves it as `num_local_experts`."""
    fields = {
        "num_experts": hf.get("num_experts") or hf.get("num_local_experts") or 0,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": hf.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }
    if shared_expert:
        fields["shared_expert_intermediate_size"] = hf["shared_expert_intermediate_size"]
    return fields


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
