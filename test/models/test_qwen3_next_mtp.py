"""Qwen3-Next's multi-token-prediction module (the NEXTN draft) against a PyTorch reference:
transformers' own Qwen3-Next decoder layer (gated full attention with partial rotary, the
sparse MoE with its gated shared expert) between fc and the zero-centred norms written here,
recomputed over the whole sequence at every step. Three consecutive draft steps (the first
fed the target's final-norm hidden states, the later ones the module's own output and draft
token, through its paged KV cache) give the same logits. A checkpoint without the module is
refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import BatchShape, SeqChunk, build_forward_batch
from sgl_jax.models.loader import CheckpointError, load_model, load_nextn_draft
from sgl_jax.speculative.drafters.head_networks import NextnDraft
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.mtp import mtp_layer_config, write_mtp_tensors

PAGE_SIZE = 4
SHAPE = BatchShape(num_tokens=32, q_block=16, pages_per_seq=8, num_logits=1)
STEPS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
    return path, write_mtp_tensors(path, seed=1)


def zero_centred_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class ReferenceMtp:
    """The module in PyTorch, from the checkpoint's mtp.* tensors."""

    def __init__(self, path, tensors):
        config = mtp_layer_config(path)
        self.eps = config.rms_norm_eps
        self.layer = Qwen3NextDecoderLayer(config, 0)
        self.rotary = Qwen3NextRotaryEmbedding(config)
        prefix = "mtp.layers.0."
        state = {k.removeprefix(prefix): torch.from_numpy(v) for k, v in tensors.items()
                 if k.startswith(prefix) and ".experts." not in k}
        experts = range(config.num_experts)
        expert = lambda e, kind: torch.from_numpy(tensors[f"{prefix}mlp.experts.{e}.{kind}.weight"])
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in experts])
        self.layer.load_state_dict(state, strict=True)
        self.w = {k.removeprefix("mtp."): torch.from_numpy(v) for k, v in tensors.items()
                  if not k.startswith(prefix)}

    def __call__(self, embed, tokens, features):
        """(outputs [T, H], their logits are the caller's): every position at once, causal."""
        w = self.w
        x = torch.cat([zero_centred_norm(embed[tokens], w["pre_fc_norm_embedding.weight"],
                                         self.eps),
                       zero_centred_norm(features, w["pre_fc_norm_hidden.weight"], self.eps)],
                      -1) @ w["fc.weight"].T
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
        out = self.layer(x[None], position_embeddings=self.rotary(x[None], positions),
                         attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return zero_centred_norm(out[0], w["norm.weight"], self.eps)


def test_three_draft_steps_match_the_reference(checkpoint):
    path, tensors = checkpoint
    prompt = np.random.default_rng(0).integers(3, 500, 13)
    n = len(prompt)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hidden = hf.model(torch.tensor(prompt)[None]).last_hidden_state[0]  # final-norm
        lm_head, embed_t = hf.lm_head.weight, hf.model.embed_tokens.weight
        first = int((hidden[-1] @ lm_head.T).argmax())  # the target's next token

    target = load_model(str(path), dtype="float32", progress=False)
    loaded = load_nextn_draft(str(path), target.config, dtype=target.dtype, progress=False)
    draft = NextnDraft(loaded, target, get_attention_backend("native"))
    cache = allocate_kv_cache(loaded.config, num_pages=16, page_size=PAGE_SIZE,
                              dtype=jnp.float32)
    pages = list(range(1, 9))

    @jax.jit
    def step(params, cache, batch, features):
        out, cache = draft.forward(params, cache, batch.input_ids, batch.positions, features,
                                   batch.attention, from_target=True)
        last = out[batch.logits_indices]
        return last, draft.logits(params, last), cache

    # Step 1 pairs each prompt position t with token t+1 (the target's token after the last).
    tokens, features = [*prompt[1:], first], hidden.numpy()
    seq_tokens, seq_features = list(tokens), torch.from_numpy(features.copy())
    prefix = 0
    reference = ReferenceMtp(path, tensors)
    for _ in range(STEPS):
        batch = build_forward_batch([SeqChunk(list(map(int, tokens)), prefix, pages)],
                                    page_size=PAGE_SIZE, shape=SHAPE)
        padded = np.zeros((SHAPE.num_tokens, features.shape[1]), np.float32)
        padded[: len(features)] = features
        out, logits, cache = step(draft.params, cache, batch, padded)
        with torch.no_grad():
            ref_out = reference(embed_t, torch.tensor(seq_tokens), seq_features)
            ref_logits = ref_out[-1] @ lm_head.T
        np.testing.assert_allclose(np.asarray(logits)[0], ref_logits.numpy(), atol=2e-4,
                                   rtol=2e-4)
        drafted = int(np.argmax(np.asarray(logits)[0]))
        assert drafted == int(ref_logits.argmax())
        # The next step: the drafted token, fed the module's own output at the last position.
        prefix += len(tokens)
        tokens, features = [drafted], np.asarray(out)
        seq_tokens.append(drafted)
        seq_features = torch.cat([seq_features, ref_out[-1:]])
    assert prefix == n + STEPS - 1


def test_a_checkpoint_without_the_module_is_refused(checkpoint, tmp_path):
    path, _ = checkpoint
    target = load_model(str(path), dtype="float32", progress=False)
    bare = write_tiny_checkpoint(tmp_path / "bare", "qwen3_next")
    with pytest.raises(CheckpointError, match="holds no multi-token-prediction module"):
        load_nextn_draft(str(bare), target.config, dtype=target.dtype, progress=False)
