"""Tiny GGUF files written from tiny safetensors checkpoints, as llama.cpp's converter would
write them: llama.cpp tensor names, Llama q/k rows permuted, llama3 rope scaling as a
rope_freqs tensor, the tokenizer and chat template as metadata, and matrices stored in any
tensor type (norms stay F32, as llama.cpp keeps them).

Types the `gguf` library can quantize are quantized from the weights; for the k-quants it
cannot (Q2_K ... Q6_K) the blocks are random bytes with small finite scales, so the matrices
are random too: a test then compares against transformers reading the same file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from sgl_jax.layers.rotary import RopeConfig
from sgl_jax.models.gguf import llama3_rope_divisors, permute_rows

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
# Byte offsets of the float16 scales inside one block of each k-quant, the rest being codes.
_K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                   "Q6_K": (208,)}
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf_from_checkpoint(checkpoint_dir: str | os.PathLike, path: str | os.PathLike,
                               tensor_type: str = "F32", *, seed: int = 0) -> Path:
    """Convert the tiny checkpoint in `checkpoint_dir` (one model.safetensors) into a GGUF
    file at `path` whose matrices are stored as `tensor_type`."""
    import gguf

    checkpoint_dir, path = Path(checkpoint_dir), Path(path)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_config(writer, config)
    _write_tokenizer(writer, checkpoint_dir)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(checkpoint_dir / "model.safetensors"))
    for name, array in tensors.items():
        array = _llama_cpp_layout(name, array.astype(np.float32), config, arch)
        _add_tensor(writer, _gguf_name(name), array, tensor_type, rng)
    rope = RopeConfig.from_hf(config)
    if rope.rope_type == "llama3":
        divisors = llama3_rope_divisors(rope.theta, _head_dim(config), vars(rope))
        writer.add_tensor("rope_freqs.weight", divisors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_config(writer, config: dict[str, Any]) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    rope = RopeConfig.from_hf(config)
    writer.add_rope_freq_base(rope.theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if rope.rope_type == "llama3":
        writer.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)


def _write_tokenizer(writer, checkpoint_dir: Path) -> None:
    """The byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    data = json.loads((checkpoint_dir / "tokenizer.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    added = {t["content"] for t in data["added_tokens"]} - special
    # llama.cpp token types: 1 normal, 3 control (special), 4 user-defined (added).
    types = [3 if t in special else 4 if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    writer.add_chat_template(tokenizer.chat_template)


def _llama_cpp_layout(name: str, array: np.ndarray, config: dict[str, Any], arch: str
                      ) -> np.ndarray:
    if arch != "llama":
        return array
    if ".self_attn.q_proj." in name:
        return permute_rows(array, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return permute_rows(array, config["num_key_value_heads"])
    return array


def _gguf_name(name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def _add_tensor(writer, name: str, array: np.ndarray, tensor_type: str,
                rng: np.random.Generator) -> None:
    import gguf

    if array.ndim == 1 or tensor_type == "F32":
        writer.add_tensor(name, array)
    elif tensor_type == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    elif tensor_type in _K_QUANT_SCALES:
        kind = gguf.GGMLQuantizationType[tensor_type]
        writer.add_tensor(name, random_k_quant_blocks(array.shape, tensor_type, rng),
                          raw_dtype=kind)
    else:
        kind = gguf.GGMLQuantizationType[tensor_type]
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def random_k_quant_blocks(shape: tuple[int, ...], tensor_type: str, rng: np.random.Generator
                          ) -> np.ndarray:
    """Random codes for a [rows, cols] matrix in a k-quant (u8[rows, cols / 256 * block]),
    with float16 scales set to small values so the weights stay in a trained-like range."""
    import gguf

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[tensor_type]:
        scales = rng.uniform(1e-4, 4e-4, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
