"""Tiny random checkpoints in the exact Hugging Face layout.

Two writers produce the same files (config.json, generation_config.json, model.safetensors
or shards + model.safetensors.index.json, tokenizer files):

* ``torch``: instantiates the real transformers model, so names/shapes/init are HF's own.
* ``numpy``: needs no torch (the built-in demo model runs without it); it mirrors the
  transformers module layout tensor by tensor.

``initializer_range`` is 0.2 (HF default 0.02): after the final RMSNorm the hidden state has
unit RMS, so logit std is about 0.2 * sqrt(hidden_size) (1.6 for the presets).  A random
model then has clearly peaked next-token distributions, which keeps greedy decoding stable
under small numerical differences between implementations.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import transformers
from transformers import GenerationConfig, PretrainedConfig

from sgl_jax.testing.tokenizer import ENDOFTEXT_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer

Backend = Literal["auto", "torch", "numpy"]

DTYPES = ("float32", "bfloat16", "float16")
# Large enough that any tiny or benchmark-sized model is one file unless asked otherwise.
DEFAULT_MAX_SHARD_SIZE = "100GB"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Same metadata transformers writes; its loader accepts "pt"-format files.
_SAFETENSORS_METADATA = {"format": "pt"}

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "num_hidden_layers": 4,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "initializer_range": 0.2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
}

# Norm weights are drawn around 1 (not exactly 1) so that a loader ignoring them fails tests;
# zero-centred norms (Qwen3-Next's, which scale by 1 + weight) are drawn around 0.
NORM_WEIGHT_STD = 0.1
_ZERO_CENTERED_NORMS = ("Qwen3NextForCausalLM",)


def _norm_mean(architecture: str, name: str) -> float:
    """Where a norm weight is centred: 0 for zero-centred norms, else 1 (Qwen3-Next's gated
    norm inside linear attention scales by its weight as is)."""
    zero = architecture in _ZERO_CENTERED_NORMS and not name.endswith("linear_attn.norm.weight")
    return 0.0 if zero else 1.0

PRESETS: dict[str, dict[str, Any]] = {
    "llama": {
        "architecture": "LlamaForCausalLM",
        "config": {
            **_COMMON,
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
    },
    "llama3": {
        "architecture": "LlamaForCausalLM",
        "config": {
            **_COMMON,
            "num_key_value_heads": 4,
            "rope_theta": 500000.0,
            # original_max_position_embeddings=32 puts most of the 512 positions in the
            # scaled regime, so tests exercise the llama3 frequency remapping.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "tie_word_embeddings": False,
        },
    },
    "qwen2": {
        "architecture": "Qwen2ForCausalLM",
        "config": {
            **_COMMON,
            "num_key_value_heads": 1,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    },
    "qwen3": {
        "architecture": "Qwen3ForCausalLM",
        "config": {
            **_COMMON,
            "num_key_value_heads": 2,
            # Deliberately != hidden_size / num_attention_heads (16).
            "head_dim": 32,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
    },
    "qwen3_moe": {
        "architecture": "Qwen3MoeForCausalLM",
        "config": {
            **_COMMON,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            # 8 experts, top 2, renormalised; layer 1 keeps the dense MLP (intermediate_size).
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    },
    "qwen3_next": {
        "architecture": "Qwen3NextForCausalLM",
        "config": {
            **_COMMON,
            # Layers 3 and 7 are gated attention, the other six Gated DeltaNet.
            "num_hidden_layers": 8,
            "full_attention_interval": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # rotary on the first 8 features (partial_rotary_factor 0.25)
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "linear_conv_kernel_dim": 4,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            # 8 experts, top 2 renormalised, a shared expert; layer 1 keeps the dense MLP.
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    },
}


def write_tiny_checkpoint(
    path: str | os.PathLike,
    preset: str = "llama",
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: int | str | None = None,
    with_tokenizer: bool = True,
    backend: Backend = "auto",
    repeat_block: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random ``preset`` model (plus tokenizer) to ``path`` and return the path.

    ``config_overrides`` update the preset's HF config kwargs.  ``backend="auto"`` uses torch
    when it imports and numpy otherwise. ``repeat_block`` (numpy only): draw that many values
    once and fill each matrix with them from a random offset, repeated: for timing runs of
    large shapes (an 8B model is written at disk speed, not at the generator's).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_weights(out)
    shard_size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
    if _resolve_backend(backend) == "torch":
        if repeat_block is not None:
            raise ValueError("repeat_block needs backend='numpy'")
        _write_with_torch(out, tiny_config(preset, **config_overrides), dtype, seed, shard_size)
    else:
        config = tiny_config(preset, torch_dtype=dtype, **config_overrides)
        _write_with_numpy(out, config, dtype, seed, shard_size, repeat_block)
    if with_tokenizer:
        write_tiny_tokenizer(out)
    return out


def tiny_config(preset: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config object for ``preset`` with ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    architecture = PRESETS[preset]["architecture"]
    kwargs = {**copy.deepcopy(PRESETS[preset]["config"]), **overrides}
    # LlamaForCausalLM -> LlamaConfig; these config classes import without torch.
    config_cls = getattr(transformers, architecture.removesuffix("ForCausalLM") + "Config")
    return config_cls(architectures=[architecture], **kwargs)


def _resolve_backend(backend: Backend) -> Literal["torch", "numpy"]:
    if backend not in ("auto", "torch", "numpy"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'numpy', got {backend!r}")
    if backend != "auto":
        return backend
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def _remove_stale_weights(out: Path) -> None:
    # A leftover index or shard from an earlier write would make loaders pick wrong files.
    for old in [*out.glob("model*.safetensors"), out / WEIGHTS_INDEX_NAME]:
        old.unlink(missing_ok=True)


# --------------------------------------------------------------------------- torch writer


def _write_with_torch(
    out: Path, config: PretrainedConfig, dtype: str, seed: int, max_shard_size: int | str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # config.dtype is unset, so the model is built (and initialised) in float32; casting
    # afterwards makes a bf16/fp16 model the rounding of the float32 one for the same seed.
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _randomize_biases_and_norms(model, config.initializer_range, config.architectures[0])
    model.to(getattr(torch, dtype))
    # save_pretrained records the parameters' dtype in config.json.
    model.save_pretrained(out, max_shard_size=max_shard_size)


def _randomize_biases_and_norms(model: Any, std: float, architecture: str) -> None:
    # HF initialises biases to zero and norm weights to one (or zero), which would let a
    # loader that drops them pass tests.
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                param.normal_(_norm_mean(architecture, name), NORM_WEIGHT_STD)


# --------------------------------------------------------------------------- numpy writer


def weight_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names and [out, in] shapes of the HF checkpoint, in module order."""
    hidden, vocab, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    layer_types = getattr(config, "layer_types", None) or ()

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config.num_hidden_layers):
        layer, mlp = f"model.layers.{i}", f"model.layers.{i}.mlp"
        if layer_types and layer_types[i] == "linear_attention":  # Qwen3-Next
            shapes.update(_linear_attention_shapes(config, f"{layer}.linear_attn"))
        else:
            shapes.update(_attention_shapes(config, f"{layer}.self_attn"))
        if _is_moe_layer(config, i):
            shapes.update(_expert_shapes(config, mlp))
        else:
            for proj, shape in (
                ("gate", (inter, hidden)),
                ("up", (inter, hidden)),
                ("down", (hidden, inter)),
            ):
                shapes[f"{mlp}.{proj}_proj.weight"] = shape
                if mlp_bias:
                    shapes[f"{mlp}.{proj}_proj.bias"] = shape[:1]
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _attention_shapes(config: PretrainedConfig, attn: str) -> dict[str, tuple[int, ...]]:
    arch, hidden = config.architectures[0], config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    attention_bias = bool(getattr(config, "attention_bias", False))
    # Qwen2 hard-codes q/k/v bias and no o_proj bias; Llama/Qwen3 follow attention_bias.
    qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
    o_bias = arch != "Qwen2ForCausalLM" and attention_bias
    q_rows = q_dim * (2 if arch == "Qwen3NextForCausalLM" else 1)  # Qwen3-Next: q | gate
    shapes = {}
    for proj, rows in (("q", q_rows), ("k", kv_dim), ("v", kv_dim)):
        shapes[f"{attn}.{proj}_proj.weight"] = (rows, hidden)
        if qkv_bias:
            shapes[f"{attn}.{proj}_proj.bias"] = (rows,)
    shapes[f"{attn}.o_proj.weight"] = (hidden, q_dim)
    if o_bias:
        shapes[f"{attn}.o_proj.bias"] = (hidden,)
    if arch in _QK_NORM_ARCHITECTURES:
        shapes[f"{attn}.q_norm.weight"] = (head_dim,)
        shapes[f"{attn}.k_norm.weight"] = (head_dim,)
    return shapes


_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")


def _linear_attention_shapes(config: PretrainedConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's Gated DeltaNet block, as transformers declares it."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = nk * config.linear_key_head_dim, nv * config.linear_value_head_dim
    return {
        f"{prefix}.dt_bias": (nv,),
        f"{prefix}.A_log": (nv,),
        f"{prefix}.conv1d.weight": (2 * key_dim + value_dim, 1, config.linear_conv_kernel_dim),
        f"{prefix}.in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, config.hidden_size),
        f"{prefix}.in_proj_ba.weight": (2 * nv, config.hidden_size),
        f"{prefix}.norm.weight": (config.linear_value_head_dim,),
        f"{prefix}.out_proj.weight": (config.hidden_size, value_dim),
    }


def _is_moe_layer(config: PretrainedConfig, i: int) -> bool:
    """transformers' rule for Qwen MoE decoders: experts unless listed in mlp_only_layers."""
    num_experts = getattr(config, "num_experts", 0) or 0
    return (num_experts > 0 and i not in (config.mlp_only_layers or ())
            and (i + 1) % config.decoder_sparse_step == 0)


def _expert_shapes(config: PretrainedConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    """The router and each expert's projections, in the hub's per-expert spelling."""
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shapes = {f"{mlp}.gate.weight": (config.num_experts, hidden)}
    for e in range(config.num_experts):
        shapes[f"{mlp}.experts.{e}.gate_proj.weight"] = (inter, hidden)
        shapes[f"{mlp}.experts.{e}.up_proj.weight"] = (inter, hidden)
        shapes[f"{mlp}.experts.{e}.down_proj.weight"] = (hidden, inter)
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    if shared:  # Qwen3-Next
        shapes[f"{mlp}.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[f"{mlp}.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[f"{mlp}.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[f"{mlp}.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes  # ships with jax; safetensors.numpy stores it as BF16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _random_state_dict(config: PretrainedConfig, dtype: str, seed: int,
                       repeat_block: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    std = np.float32(config.initializer_range)
    target = _numpy_dtype(dtype)
    block = None if repeat_block is None else (
        rng.standard_normal(repeat_block, dtype=np.float32) * std).astype(target)
    tensors = {}
    architecture = config.architectures[0]
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            value = (_norm_mean(architecture, name)
                     + rng.standard_normal(shape, dtype=np.float32) * NORM_WEIGHT_STD)
        elif block is not None:
            value = np.resize(np.roll(block, rng.integers(block.size)), shape)
        else:
            value = rng.standard_normal(shape, dtype=np.float32) * std
        tensors[name] = value.astype(target, copy=False)
    return tensors


def _write_with_numpy(
    out: Path, config: PretrainedConfig, dtype: str, seed: int, max_shard_size: int | str,
    repeat_block: int | None = None,
) -> None:
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    tensors = _random_state_dict(config, dtype, seed, repeat_block)
    # The same splitting routine (key order, byte sizes) transformers uses for torch tensors.
    split = split_state_dict_into_shards_factory(
        tensors,
        get_storage_size=lambda array: array.nbytes,
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size,
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors[name] for name in names}
        save_file(shard, out / filename, metadata=_SAFETENSORS_METADATA)
    if split.is_sharded:
        total_parameters = sum(array.size for array in tensors.values())
        index = {
            "metadata": {"total_parameters": total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (out / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def write_noisy_copy(source: str | os.PathLike, path: str | os.PathLike, *,
                     relative_noise: float, seed: int = 0) -> Path:
    """Copy a checkpoint with Gaussian noise of `relative_noise` times each tensor's standard
    deviation added: a draft that agrees with its target often but not always."""
    from safetensors.numpy import load_file, save_file

    src, out = Path(source), Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for item in src.iterdir():
        if item.suffix == ".safetensors":
            tensors = load_file(str(item))
            noisy = {name: (t + rng.normal(size=t.shape) * relative_noise * t.std()).astype(t.dtype)
                     for name, t in tensors.items()}
            save_file(noisy, str(out / item.name), metadata={"format": "pt"})
        elif item.is_file():
            shutil.copy(item, out / item.name)
    return out
