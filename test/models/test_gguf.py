"""GGUF checkpoints against two oracles: transformers on the safetensors checkpoint a float
GGUF was converted from, and transformers reading the same (quantized) GGUF file."""

import json
import logging
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models import gguf as gguf_module
from sgl_jax.models.gguf import SUPPORTED_TYPES, GGUFError, find_gguf_file
from sgl_jax.models.loader import load_model
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.gguf import write_gguf_from_checkpoint
from sgl_jax.tokenizer import load_tokenizer

# The presets of test_model_parity: rope scaling (llama3), one KV head with biases (qwen2),
# q/k norms with head_dim != hidden / heads and tied embeddings (qwen3).
PRESETS = ["llama", "llama3", "qwen2", "qwen3"]
# Block-quantized matrices need in-features a multiple of 256 (k-quants).
QUANT_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "head_dim": 64}
PROMPTS = [[5, 17, 99, 230, 8, 41, 300], list(range(3, 48))]  # 45 tokens reach llama3 scaling


def our_logits(path, dtype="float32") -> np.ndarray:
    model = load_model(str(path), dtype=dtype, progress=False)
    runner = ModelRunner(model, num_pages=64, page_size=16)
    first = 1
    chunks = []
    for ids in PROMPTS:
        pages = list(range(first, first + -(-len(ids) // 16)))
        first += len(pages)
        chunks.append(SeqChunk(ids, 0, pages))
    logits, _ = runner.forward(chunks, all_logits=True)
    return np.asarray(logits)


def reference_logits(model) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([model(torch.tensor([ids])).logits[0].numpy() for ids in PROMPTS])


@pytest.mark.parametrize("preset", PRESETS)
def test_float_gguf_equals_transformers_on_the_source_checkpoint(preset, tmp_path):
    source = write_tiny_checkpoint(tmp_path / "hf", preset)
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "F32")
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    np.testing.assert_allclose(our_logits(path), reference_logits(reference), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tensor_type", [t for t in SUPPORTED_TYPES if t != "F32"])
def test_quantized_gguf_equals_transformers_reading_it(tensor_type, tmp_path):
    source = write_tiny_checkpoint(tmp_path / "hf", "llama", **QUANT_SHAPE)
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", tensor_type)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    expected = reference_logits(reference)
    # Random k-quant codes give large logits; float32 error grows with their scale. With
    # today's packages Q6_K's worst logits differ by 2.6e-5 of the largest (torch's and XLA's
    # float32 sums in another order): 4e-5 still catches any dequantization error.
    atol = 4e-5 * np.abs(expected).max()
    np.testing.assert_allclose(our_logits(path), expected, atol=atol, rtol=0)


def test_a_later_load_maps_the_dequantized_copy_the_first_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = write_tiny_checkpoint(tmp_path / "hf", "llama", **QUANT_SHAPE)
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "Q4_1")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    expected = reference_logits(reference)
    atol = 4e-5 * np.abs(expected).max()
    np.testing.assert_allclose(our_logits(path), expected, atol=atol, rtol=0)
    [kept] = (tmp_path / "cache").rglob("dequantized.f32")
    table = json.loads((kept.parent / "gguf_tensors.json").read_text())
    assert kept.stat().st_size == 4 * sum(np.prod(entry["shape"]) for entry in table.values())

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("the second load dequantized the file again")
    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantizing)
    np.testing.assert_allclose(our_logits(path), expected, atol=atol, rtol=0)


def test_a_copy_too_large_or_unwritable_is_not_kept(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_module, "_KEPT_LIMIT", 1024)
    source = write_tiny_checkpoint(tmp_path / "hf", "llama")
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "F16")
    first = our_logits(path)
    [metadata] = (tmp_path / "cache").rglob("gguf_tensors.json")
    assert not list(metadata.parent.glob("dequantized.*"))
    # Within the limit but unwritable (a directory where the copy goes): the load goes on.
    monkeypatch.setattr(gguf_module, "_KEPT_LIMIT", 2 << 30)
    (metadata.parent / f"dequantized.f32.{os.getpid()}.partial").mkdir()
    with caplog.at_level(logging.WARNING, "sgl_jax.models.gguf"):
        np.testing.assert_array_equal(our_logits(path), first)
    assert "Not keeping the dequantized weights" in caplog.text
    assert not list(metadata.parent.glob("dequantized.json"))


def test_metadata_gives_config_tokenizer_and_chat_template(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = write_tiny_checkpoint(tmp_path / "hf", "qwen3", head_dim=16)
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "Q8_0")
    model = load_model(str(path), progress=False)
    assert model.model_dir.is_relative_to(tmp_path / "cache" / "sgl-jax")
    assert model.config.architecture == "Qwen3ForCausalLM" and model.config.qk_norm
    assert model.config.tie_word_embeddings and model.config.eos_token_ids == (0,)
    # the server's loader takes the converted tokenizer's class directly (no config, no
    # torch): the class AutoTokenizer would pick
    ours = load_tokenizer(model.model_dir)
    assert type(ours) is type(AutoTokenizer.from_pretrained(str(model.model_dir)))
    original = AutoTokenizer.from_pretrained(str(source))
    messages = [{"role": "user", "content": "The capital of France is Paris."}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "Hello! How are you doing today? <|im_end|>"
    assert ours(text)["input_ids"] == original(text)["input_ids"]


def test_gguf_serves_through_the_engine(tmp_path):
    from sgl_jax import Engine

    source = write_tiny_checkpoint(tmp_path / "hf", "llama")
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "F16")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = PROMPTS[0]
    with Engine(model_path=str(tmp_path), dtype="float32", skip_server_warmup=True,
                precompile_token_paddings=[64], precompile_bs_paddings=[1],
                max_prefill_tokens=64) as engine:
        out = engine.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long))
    assert out["output_ids"] == expected[0, len(ids):].tolist()


def test_unsupported_tensor_type_is_named(tmp_path):
    source = write_tiny_checkpoint(tmp_path / "hf", "llama", **QUANT_SHAPE)
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if tensor.name == "blk.1.ffn_up.weight":  # same byte-free shape, an IQ4_NL block
            kind = gguf.GGMLQuantizationType.IQ4_NL
            rows, cols = (int(d) for d in reversed(tensor.shape))
            data = np.zeros((rows, cols // 32 * 18), np.uint8)
            writer.add_tensor(tensor.name, data, raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_up.weight' .* IQ4_NL, which is not "
                                        r"supported; supported GGUF types: F32, F16"):
        load_model(str(tmp_path / "iq.gguf"), progress=False)


def test_directory_with_one_gguf_is_that_file(tmp_path):
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "m.gguf").write_bytes(b"")
    assert find_gguf_file(tmp_path / "only") == tmp_path / "only" / "m.gguf"
    (tmp_path / "only" / "n.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="holds 2 GGUF files .*m.gguf, n.gguf.*pass the path"):
        find_gguf_file(tmp_path / "only")
    (tmp_path / "only" / "config.json").write_text("{}")  # a Hugging Face directory wins
    assert find_gguf_file(tmp_path / "only") is None


def test_unsupported_architecture_and_garbage_are_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'gemma2' .* not supported; supported: "
                                        "llama, qwen2, qwen3"):
        load_model(str(tmp_path / "g.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        load_model(str(tmp_path / "bad.gguf"))


def test_gguf_target_with_an_eagle3_draft_equals_plain_decoding(tmp_path):
    import json

    from sgl_jax import Engine
    from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

    source = write_tiny_checkpoint(tmp_path / "hf", "llama")
    path = write_gguf_from_checkpoint(source, tmp_path / "model.gguf", "Q8_0")
    draft = write_tiny_eagle3_draft(tmp_path / "draft",
                                    json.loads((source / "config.json").read_text()))
    settings = dict(model_path=str(path), dtype="float32", skip_server_warmup=True,
                    precompile_token_paddings=[64], precompile_bs_paddings=[1, 2],
                    max_prefill_tokens=64)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outputs = []
    for spec in ({}, dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                          speculative_num_steps=3, speculative_eagle_topk=2,
                          speculative_num_draft_tokens=6)):
        with Engine(**settings, **spec) as engine:
            outputs.append([o["output_ids"] for o in
                            engine.generate(input_ids=PROMPTS, sampling_params=params)])
    assert outputs[0] == outputs[1] and all(len(o) == 12 for o in outputs[0])
