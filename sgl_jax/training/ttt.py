"""The training-time-test (TTT) forward: the serving draft (`models/llama_eagle3.forward`) run
over dense batches of whole sequences, unrolled for `length` steps.

Batches are B rows of T tokens, right-padded, flattened row-major to B*T tokens for the model
code. Draft index t holds the pair (target features of token t, token t + 1) at position t, as
a serving KV slot does, so step 0 at index t predicts token t + 2. Step k feeds back step k-1's
output hidden states and the tokens shifted k places left, at position t + k: exactly where the
serving draft puts its depth-k node when the verified prefix ends at t.

Attention at step k (`ttt_attention`): the step-0 keys causally (what serving holds in its KV
cache), plus the keys index t itself produced at steps 1..k (the draft's own chain).
Keys past a row's length are never visible to its real tokens (right padding, causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.models import llama_eagle3
from sgl_jax.models.llama_eagle3 import Eagle3Config, Params

_MASKED = -1e30


@dataclass(frozen=True)
class DenseBatch:
    """Attention metadata of a dense batch: `batch_size` rows of equal length, flattened."""

    batch_size: int


jax.tree_util.register_dataclass(DenseBatch, data_fields=[], meta_fields=["batch_size"])

# One layer's keys and values [s, B*T, n_kv, hd] of TTT steps 0..s-1 (None before step 0).
StepKV = tuple[jax.Array, jax.Array] | None


@dataclass(frozen=True)
class StepCache:
    """The models' cache contract (`layer(i)`, `with_layer(i, ...)`) over dense batches: each
    layer's keys and values of the TTT steps so far, in place of paged ones."""

    layers: tuple[StepKV, ...]

    @classmethod
    def empty(cls, num_layers: int) -> StepCache:
        return cls((None,) * num_layers)

    def layer(self, i: int) -> StepKV:
        return self.layers[i]

    def with_layer(self, i: int, layer_kv: StepKV) -> StepCache:
        return StepCache(self.layers[:i] + (layer_kv,) + self.layers[i + 1:])


jax.tree_util.register_dataclass(StepCache, data_fields=["layers"], meta_fields=[])


def ttt_attention(
    q: jax.Array,  # [B*T, n_heads, hd]
    k: jax.Array,  # [B*T, n_kv, hd]
    v: jax.Array,
    layer_kv: StepKV,  # keys, values [s, B*T, n_kv, hd] of steps 0..s-1 (None: s = 0)
    metadata: DenseBatch,
    *,
    scale: float,
) -> tuple[jax.Array, StepKV]:
    """An `AttentionBackend` for TTT: step s (= len of layer_kv) attends causally over the
    step-0 keys and to index t's own keys of steps 1..s. With no earlier step this is plain
    causal attention, which is also how the target runs over a training batch."""
    keys, values = k[None], v[None]
    if layer_kv is not None:
        keys = jnp.concatenate([layer_kv[0], keys])
        values = jnp.concatenate([layer_kv[1], values])
    b = metadata.batch_size
    n, num_heads, hd = q.shape
    t, num_kv = n // b, k.shape[1]
    queries = q.reshape(b, t, num_kv, num_heads // num_kv, hd)  # q head h reads KV head h // g
    step_keys = keys.reshape(-1, b, t, num_kv, hd)  # [S, B, T, n_kv, hd]
    step_values = values.reshape(-1, b, t, num_kv, hd)
    causal = jnp.einsum("btngd,bsnd->bngts", queries, step_keys[0],
                        preferred_element_type=jnp.float32) * scale  # f32[B, n_kv, g, T, T]
    visible = jnp.tril(jnp.ones((t, t), bool))
    causal = jnp.where(visible, causal, _MASKED)
    own = jnp.einsum("btngd,jbtnd->bngtj", queries, step_keys[1:],
                     preferred_element_type=jnp.float32) * scale  # f32[B, n_kv, g, T, S-1]
    probs = jax.nn.softmax(jnp.concatenate([causal, own], axis=-1), axis=-1).astype(q.dtype)
    out = (jnp.einsum("bngts,bsnd->btngd", probs[..., :t], step_values[0])
           + jnp.einsum("bngtj,jbtnd->btngd", probs[..., t:], step_values[1:]))
    return out.reshape(n, num_heads, hd), (keys, values)


def ttt_logits(
    params: Params,  # the draft layer's parameters (llama_eagle3 layout)
    embed: jax.Array,  # [V, H]: the target's embedding (frozen)
    lm_head: jax.Array,  # [Vd, H]
    features: jax.Array,  # f[B, T, 3*Ht]: the target's captured states at each position
    input_ids: jax.Array,  # i32[B, T]: the sequence (token t at index t)
    *,
    config: Eagle3Config,
    length: int,
) -> jax.Array:
    """f32[length, B, T, Vd]: step k's draft logits at index t predict token t + k + 2."""
    b, t = input_ids.shape
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)  # i32[B*T]
    kv = StepCache.empty(1)
    hidden = features.reshape(b * t, -1)
    tokens = input_ids
    logits = []
    for k in range(length):
        tokens = _shift_left(tokens)  # token t + k + 1 at index t
        hidden, kv = llama_eagle3.forward(
            params, kv, tokens.reshape(-1), positions + k, hidden, DenseBatch(b),
            config=config, attention=ttt_attention, embed=embed, from_target=k == 0)
        logits.append(llama_eagle3.compute_logits(params, hidden, config, lm_head))
    return jnp.stack(logits).reshape(length, b, t, -1)


def _shift_left(tokens: jax.Array) -> jax.Array:
    """i32[B, T] -> tokens one place left, a padding id 0 entering at the end."""
    return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
