"""Tests for the tiny tokenizer / checkpoint factories in sgl_jax.testing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from sgl_jax.testing import PRESETS, TINY_VOCAB_SIZE, write_tiny_checkpoint, write_tiny_tokenizer
from sgl_jax.testing.tokenizer import ENDOFTEXT_ID

REPO_ROOT = Path(__file__).resolve().parents[2]
MOE_PRESETS = ("qwen3_moe", "qwen3_next")

# --------------------------------------------------------------------------- helpers


def _header(file: Path) -> dict[str, dict]:
    """The safetensors JSON header (dtype/shape per tensor), read without any framework."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _tensors(ckpt: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) over all weight files of a checkpoint."""
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        for name, spec in _header(file).items():
            assert name not in out, f"{name} stored twice"
            out[name] = (spec["dtype"], tuple(spec["shape"]))
    return out


def _json(file: Path) -> dict:
    return json.loads(file.read_text())


def _load_all(ckpt: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        arrays.update(load_file(file))
    return arrays


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "Zebras xylophone QUIRKY words never seen in training!?",
        "Rocket 🚀 party 🎉 with family 👨‍👩‍👧",
        "机器学习很有趣。日本語のテキスト。한국어",
        "  leading spaces,\ttabs\nand\r\nnewlines  ",
    ],
)
def test_tokenizer_round_trips_any_text(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_tokenizer_special_and_think_tokens(tok) -> None:
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == ENDOFTEXT_ID == PRESETS["llama"]["config"]["eos_token_id"]
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    # <think> is a plain added token: it survives skip_special_tokens, <|im_end|> does not.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_tokenizer_vocab_fits_model(tok) -> None:
    assert len(tok) <= TINY_VOCAB_SIZE
    assert max(tok.get_vocab().values()) < TINY_VOCAB_SIZE


def test_tokenizer_is_deterministic(tmp_path: Path, tok_dir: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_returned_tokenizer_matches_saved(tmp_path: Path, tok) -> None:
    returned = write_tiny_tokenizer(tmp_path)
    text = "Hello <think>world</think> 😀"
    assert returned.encode(text) == tok.encode(text)
    assert returned.chat_template == tok.chat_template


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]
CHAT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template(tok) -> None:
    render = lambda **kw: tok.apply_chat_template(MESSAGES, tokenize=False, **kw)
    assert render() == CHAT
    assert render(add_generation_prompt=True) == CHAT + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True, enable_thinking=True) == (
        CHAT + "<|im_start|>assistant\n"
    )
    assert render(add_generation_prompt=True, enable_thinking=False) == (
        CHAT + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # The empty think block belongs to the generation prompt only.
    assert render(enable_thinking=False) == CHAT


def test_chat_template_multi_turn_and_content_parts(tok) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n"


# --------------------------------------------------------------------------- checkpoints


def _write_both(tmp_path: Path, preset: str, **kwargs) -> tuple[Path, Path]:
    pytest.importorskip("torch")
    t = write_tiny_checkpoint(tmp_path / "torch", preset, backend="torch", **kwargs)
    n = write_tiny_checkpoint(tmp_path / "numpy", preset, backend="numpy", **kwargs)
    return t, n


@pytest.mark.parametrize("max_shard_size", [None, "100KB"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_torch_and_numpy_writers_agree(tmp_path: Path, preset: str, max_shard_size) -> None:
    t, n = _write_both(tmp_path, preset, max_shard_size=max_shard_size)
    assert _tensors(t) == _tensors(n)
    assert _json(t / "config.json") == _json(n / "config.json")
    assert _json(n / "config.json")["architectures"] == [PRESETS[preset]["architecture"]]
    assert _json(t / "generation_config.json") == _json(n / "generation_config.json")
    if max_shard_size and preset in MOE_PRESETS:
        # transformers shards its fused in-memory expert stacks, then saves them per expert;
        # the numpy writer shards the per-expert tensors: same tensors, other shard files
        return
    assert sorted(p.name for p in t.iterdir()) == sorted(p.name for p in n.iterdir())
    if max_shard_size:
        index = "model.safetensors.index.json"
        assert _json(t / index) == _json(n / index)


def test_writers_agree_with_biases_and_overrides(tmp_path: Path) -> None:
    t, n = _write_both(
        tmp_path, "llama", attention_bias=True, mlp_bias=True, num_hidden_layers=2, vocab_size=600
    )
    tensors = _tensors(n)
    assert tensors == _tensors(t)
    assert "model.layers.1.self_attn.o_proj.bias" in tensors
    assert "model.layers.1.mlp.down_proj.bias" in tensors
    assert "model.layers.2.input_layernorm.weight" not in tensors
    assert tensors["lm_head.weight"][1] == (600, 64)


def test_numpy_layout_per_architecture(tmp_path: Path) -> None:
    # Independent of torch: the shapes below are what the HF modeling code declares.
    qwen2 = _tensors(write_tiny_checkpoint(tmp_path / "q2", "qwen2", backend="numpy"))
    assert qwen2["model.layers.0.self_attn.k_proj.weight"][1] == (16, 64)  # one KV head
    assert qwen2["model.layers.0.self_attn.v_proj.bias"][1] == (16,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert "lm_head.weight" in qwen2

    qwen3 = _tensors(write_tiny_checkpoint(tmp_path / "q3", "qwen3", backend="numpy"))
    assert qwen3["model.layers.3.self_attn.q_proj.weight"][1] == (128, 64)  # 4 heads x 32
    assert qwen3["model.layers.3.self_attn.o_proj.weight"][1] == (64, 128)
    assert qwen3["model.layers.3.self_attn.k_norm.weight"][1] == (32,)
    assert "model.layers.0.self_attn.q_proj.bias" not in qwen3
    assert "lm_head.weight" not in qwen3  # tied


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_transformers_loads_numpy_checkpoint(tmp_path: Path, preset: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(tmp_path, preset, backend="numpy", seed=3)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    # Loaded values are the file's, not a fresh re-initialisation (compared through a save:
    # transformers holds MoE experts fused in memory and saves them per expert again).
    model.save_pretrained(tmp_path / "resaved")
    resaved = _load_all(tmp_path / "resaved")
    for name, array in _load_all(path).items():
        np.testing.assert_array_equal(resaved[name], array, err_msg=name)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 300]])).logits
    assert logits.shape == (1, 4, TINY_VOCAB_SIZE) and torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_sharded_checkpoint(tmp_path: Path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    path = write_tiny_checkpoint(tmp_path, "llama", backend=backend, max_shard_size="200KB")
    index = _json(path / "model.safetensors.index.json")
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert not (path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = _tensors(path)
    assert set(index["weight_map"]) == set(tensors)
    nbytes = sum(4 * int(np.prod(shape)) for _, shape in tensors.values())
    assert index["metadata"]["total_size"] == nbytes


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize(("dtype", "stored"), [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_dtypes(tmp_path: Path, backend: str, dtype: str, stored: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    path = write_tiny_checkpoint(tmp_path, "qwen3", dtype=dtype, backend=backend)
    assert {dt for dt, _ in _tensors(path).values()} == {stored}
    config = _json(path / "config.json")
    assert config.get("dtype", config.get("torch_dtype")) == dtype


def test_default_is_single_float32_file(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama", backend="numpy")
    assert (path / "model.safetensors").exists()
    assert not (path / "model.safetensors.index.json").exists()
    assert {dt for dt, _ in _tensors(path).values()} == {"F32"}
    assert (path / "tokenizer.json").exists()


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, "llama", backend="numpy", max_shard_size="100KB")
    write_tiny_checkpoint(tmp_path, "llama", backend="numpy", with_tokenizer=False)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_numpy_weights_follow_seed_and_init(tmp_path: Path) -> None:
    a = _load_all(write_tiny_checkpoint(tmp_path / "a", "qwen2", backend="numpy", seed=1))
    b = _load_all(write_tiny_checkpoint(tmp_path / "b", "qwen2", backend="numpy", seed=1))
    c = _load_all(write_tiny_checkpoint(tmp_path / "c", "qwen2", backend="numpy", seed=2))
    emb = "model.embed_tokens.weight"
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a[emb], c[emb])
    assert abs(float(a[emb].std()) - PRESETS["qwen2"]["config"]["initializer_range"]) < 0.01
    norm = a["model.norm.weight"]
    assert abs(float(norm.mean()) - 1) < 0.1 and 0.03 < float(norm.std()) < 0.3
    assert np.abs(a["model.layers.0.self_attn.q_proj.bias"]).max() > 0


def test_torch_writer_randomizes_biases_and_norms(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = write_tiny_checkpoint(tmp_path, "qwen2", backend="torch", with_tokenizer=False)
    weights = _load_all(path)
    assert np.abs(weights["model.layers.0.self_attn.k_proj.bias"]).max() > 0
    assert float(weights["model.layers.0.input_layernorm.weight"].std()) > 0.03
    assert abs(float(weights["model.embed_tokens.weight"].std()) - 0.2) < 0.01


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        write_tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="dtype"):
        write_tiny_checkpoint(tmp_path, "llama", dtype="int8")
    with pytest.raises(ValueError, match="backend"):
        write_tiny_checkpoint(tmp_path, "llama", backend="jax")


def test_auto_backend_works_without_torch(tmp_path: Path) -> None:
    # A `None` entry in sys.modules makes `import torch` fail, as on a torch-less install.
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from sgl_jax.testing import write_tiny_checkpoint\n"
        f"write_tiny_checkpoint({str(tmp_path)!r}, 'qwen3', dtype='bfloat16')\n"
        "assert sys.modules['torch'] is None\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    assert {dt for dt, _ in _tensors(tmp_path).values()} == {"BF16"}
    assert _json(tmp_path / "config.json")["architectures"] == ["Qwen3ForCausalLM"]


def test_repeat_block_fills_matrices_from_one_random_block(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "tiled", "llama", backend="numpy", repeat_block=97)
    plain = _load_all(write_tiny_checkpoint(tmp_path / "drawn", "llama", backend="numpy"))
    tiled = _load_all(path)
    assert {n: a.shape for n, a in tiled.items()} == {n: a.shape for n, a in plain.items()}
    matrices = [a for n, a in tiled.items() if not n.endswith("norm.weight")]
    block = np.unique(matrices[0])
    assert len(block) == 97  # every value drawn once, repeated to fill the matrix
    for array in matrices:
        assert np.isin(array, block).all() and len(np.unique(array)) == 97
    assert not all(np.array_equal(a.ravel()[:97], matrices[0].ravel()[:97]) for a in matrices)
    with pytest.raises(ValueError, match="numpy"):
        write_tiny_checkpoint(tmp_path / "torch", "llama", backend="torch", repeat_block=97)
