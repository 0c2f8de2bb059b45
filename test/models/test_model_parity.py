"""Llama / Qwen2 / Qwen3 against transformers (PyTorch, CPU, float32) on tiny random checkpoints."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.loader import load_model
from sgl_jax.testing import write_tiny_checkpoint

# llama3: Llama-3.1 rope scaling with original_max_position_embeddings = 32;
# qwen2: a single KV head; qwen3: head_dim 32 != hidden / heads = 16, tied embeddings.
PRESETS = ["llama", "llama3", "qwen2", "qwen3"]
PROMPT_LENS = [7, 45, 20]  # 45 > 32 reaches the scaled rope regime of llama3
ATOL = 1e-4


@pytest.fixture(scope="module", params=PRESETS)
def checkpoint(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, reference, load_model(str(path), dtype="float32", progress=False)


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in PROMPT_LENS]


class PageCounter:
    def __init__(self):
        self.next = 1

    def take(self, num_tokens: int, page_size: int) -> list[int]:
        count = -(-num_tokens // page_size)
        self.next += count
        return list(range(self.next - count, self.next))


@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_prefill_logits(checkpoint, page_size):
    _, _, reference, model = checkpoint
    runner = ModelRunner(model, num_pages=256, page_size=page_size)
    pages = PageCounter()
    seqs = prompts()
    chunks = [SeqChunk(ids, 0, pages.take(len(ids), page_size)) for ids in seqs]
    logits, _ = runner.forward(chunks, all_logits=True)
    expected = np.concatenate([reference_logits(reference, ids) for ids in seqs])
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


def test_mixed_decode_and_chunked_prefill(checkpoint):
    """One step holding a decode token, a whole prompt and the second chunk of a prompt."""
    _, _, reference, model = checkpoint
    page_size = 4
    runner = ModelRunner(model, num_pages=64, page_size=page_size)
    pages = PageCounter()
    a, b, c = prompts(seed=1)
    a_pages, b_pages, c_pages = (pages.take(len(x) + 1, page_size) for x in (a, b, c))
    split = 13
    runner.forward([SeqChunk(a[:-1], 0, a_pages), SeqChunk(c[:split], 0, c_pages)])
    logits, _ = runner.forward(
        [
            SeqChunk(a[-1:], len(a) - 1, a_pages),
            SeqChunk(b, 0, b_pages),
            SeqChunk(c[split:], split, c_pages),
        ]
    )
    expected = [reference_logits(reference, x)[-1] for x in (a, b, c)]
    np.testing.assert_allclose(logits, np.stack(expected), atol=ATOL, rtol=0)


def test_tree_mask_window_matches_each_branch(checkpoint):
    """A verify window with two branches gives each branch's own causal logits."""
    _, _, reference, model = checkpoint
    runner = ModelRunner(model, num_pages=64, page_size=4)
    prefix = prompts(seed=2)[0]
    pages = PageCounter().take(len(prefix) + 5, 4)
    runner.forward([SeqChunk(prefix, 0, pages)])
    # Window: root r, children x and y of r, z child of x.  Positions follow depth.
    r, x, y, z = 11, 22, 33, 44
    parents = [-1, 0, 0, 1]
    mask = np.eye(4, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    depth = [0, 1, 1, 2]
    n = len(prefix)
    window = SeqChunk([r, x, y, z], n, pages, positions=[n + d for d in depth], tree_mask=mask)
    logits, _ = runner.forward([window], all_logits=True)
    paths = [[r], [r, x], [r, y], [r, x, z]]
    expected = np.stack([reference_logits(reference, prefix + p)[-1] for p in paths])
    np.testing.assert_allclose(logits[:4], expected, atol=ATOL, rtol=0)


def test_captured_hidden_states_are_layer_inputs(checkpoint):
    _, _, reference, model = checkpoint
    layers = (0, 2, model.config.num_layers - 1)
    runner = ModelRunner(model, num_pages=64, page_size=16, capture_layers=layers)
    ids = prompts()[1]
    _, captured = runner.forward([SeqChunk(ids, 0, [1, 2, 3])])
    with torch.no_grad():
        hidden_states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer, ours in zip(layers, captured, strict=True):
        # transformers' hidden_states[i] is the residual stream entering layer i (i < L).
        np.testing.assert_allclose(ours, hidden_states[layer][0].numpy(), atol=ATOL, rtol=0)


def test_greedy_continuation_matches_transformers(checkpoint):
    from sgl_jax import Engine

    _, path, reference, _ = checkpoint
    seqs = prompts(seed=3)
    engine = Engine(
        model_path=str(path), dtype="float32", page_size=16, skip_server_warmup=True,
        precompile_token_paddings=[128], precompile_bs_paddings=[4], max_prefill_tokens=128,
    )
    outputs = engine.generate(
        input_ids=seqs,
        sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
    )
    engine.shutdown()
    for ids, out in zip(seqs, outputs, strict=True):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        assert out["output_ids"] == generated[0, len(ids) :].tolist()
