"""Gated DeltaNet: the chunked rule against the recurrent one, both against transformers'
PyTorch fallbacks; the whole layer against transformers' Qwen3NextGatedDeltaNet (float32, CPU);
prefill / decode / verify agreeing with each other; draft trees against a float64 reference
that walks each root-to-node path; padding that leaves states alone; the layer over a pool of
state slots and the server's ragged block layout; checkpoint names."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from sgl_jax.layers import gated_delta_net as gdn
from sgl_jax.layers.gated_delta_net import GdnConfig, GdnState
from sgl_jax.layers.weights import checkpoint_tensors

NK, NV, DK, DV, K, H = 4, 8, 16, 16, 4, 64
CONFIG = GdnConfig(H, NK, NV, DK, DV, K)
R = NV // NK
ATOL = 2e-5

chunked_rule = jax.jit(gdn.chunked_rule)
recurrent_rule = jax.jit(gdn.recurrent_rule)
tree_rule = jax.jit(gdn.tree_rule)
tree_conv = jax.jit(gdn.tree_conv)
causal_conv = jax.jit(gdn.causal_conv)
conv_step = jax.jit(gdn.conv_step)
prefill = jax.jit(partial(gdn.prefill, config=CONFIG))
decode = jax.jit(partial(gdn.decode, config=CONFIG))
verify = jax.jit(partial(gdn.verify, config=CONFIG))
select_node = jax.jit(gdn.select_node)
forward_slots = jax.jit(partial(gdn.forward_slots, config=CONFIG))

TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8]  # two children per node near the root; depths up to 4
CHAIN = [-1, 0, 1, 2, 3, 4]


# ---------------------------------------------------------------- inputs and references


def raw_rule_inputs(num_tokens: int, seed: int):
    """q, k [T, nk, dk] (not normalised), v [T, nv, dv], g, beta [T, nv], a state [nv, dk, dv]."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(num_tokens, NK, DK)).astype(np.float32)
    k = rng.normal(size=(num_tokens, NK, DK)).astype(np.float32)
    v = rng.normal(size=(num_tokens, NV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 1.0, size=(num_tokens, NV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(num_tokens, NV)).astype(np.float32)
    state = rng.normal(size=(NV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def rule_inputs(num_tokens: int, seed: int):
    """What the rules take: q, k normalised and repeated over the value heads."""
    q, k, v, g, beta, state = raw_rule_inputs(num_tokens, seed)
    q, k = gdn.normalize_qk(jnp.asarray(q), jnp.asarray(k), R)
    return q, k, v, g, beta, state


def ref_rule_path(q, k, v, g, beta, state, path):
    """The recurrence in float64 along `path` (token indices): last output, state after."""
    s = np.asarray(state, np.float64)
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    o = np.zeros(s.shape[::2])
    for t in path:
        s = s * np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * delta[:, None, :]
        o = np.einsum("hkv,hk->hv", s, q[t])
    return o, s


def ref_conv_path(x, window, weight, path):
    """SiLU(conv) of the last token of `path` over window rows then x[path], float64; the
    window after it."""
    rows = np.concatenate([np.asarray(window, np.float64), np.asarray(x, np.float64)[path]])
    y = np.sum(rows[-K:] * np.asarray(weight, np.float64), axis=0)
    return y / (1 + np.exp(-y)), rows[-(K - 1):]


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def hf_grouped(channels: np.ndarray) -> np.ndarray:
    """transformers' conv channel order (q | k | v over all heads) -> ours (per key head)."""
    q, k, v = np.split(channels, [NK * DK, 2 * NK * DK], axis=-1)
    lead = channels.shape[:-1]
    parts = [x.reshape(*lead, NK, -1) for x in (q, k, v)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def hf_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        hidden_size=H, linear_num_key_heads=NK, linear_num_value_heads=NV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=K,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=32,
    )


def place(tensors: dict[str, np.ndarray], specs) -> dict[str, np.ndarray]:
    """Checkpoint tensors -> the parameter dict, as the loader places them."""
    params = {}
    for name, spec in specs.items():
        leaf = spec.path[-1]
        if spec.part is None:
            params[leaf] = tensors[name]
        else:
            params.setdefault(leaf, np.empty(spec.part.param_shape, np.float32))
            spec.part.write(params[leaf], tensors[name])
    return params


@pytest.fixture(scope="module")
def layer():
    """transformers' module with random weights (norm weight and dt_bias too) and our params."""
    torch.manual_seed(0)
    module = hf.Qwen3NextGatedDeltaNet(hf_config(), 0).float().eval()
    with torch.no_grad():
        module.dt_bias.normal_()
        module.norm.weight.uniform_(0.5, 1.5)
    tensors = {f"model.layers.0.linear_attn.{n}": t.numpy() for n, t in
               module.state_dict().items()}
    specs = gdn.linear_attn_specs(CONFIG, "model.layers.0.", ())
    return module, jax.tree.map(jnp.asarray, place(tensors, specs)), tensors, specs


def hidden(batch: int, num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, num_tokens, H)).astype(np.float32)


def hf_forward(module, x: np.ndarray, cache=None) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(x), cache_params=cache).numpy()


def ones(*shape):
    return jnp.ones(shape, bool)


def random_state(batch: int, seed: int) -> GdnState:
    rng = np.random.default_rng(seed)
    conv = rng.normal(size=(batch, K - 1, CONFIG.conv_dim)).astype(np.float32)
    ssm = rng.normal(size=(batch, NV, DK, DV)).astype(np.float32) * 0.3
    return GdnState(jnp.asarray(conv), jnp.asarray(ssm))


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=0)


# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize("num_tokens", [3, 64, 65, 130])
@pytest.mark.parametrize("initial", ["zero", "random"])
def test_chunked_rule_equals_recurrent(num_tokens, initial):
    q, k, v, g, beta, state = rule_inputs(num_tokens, seed=num_tokens)
    state = state * (initial == "random")
    valid = ones(num_tokens)
    o_chunk, s_chunk = chunked_rule(q, k, v, g, beta, state, valid)
    o_rec, s_rec = recurrent_rule(q, k, v, g, beta, state, valid)
    close(o_chunk, o_rec, 1e-5)
    close(s_chunk, s_rec, 1e-5)
    o_ref, s_ref = ref_rule_path(q, k, v, g, beta, state, range(num_tokens))
    close(o_rec[-1], o_ref, 1e-5)
    close(s_rec, s_ref, 1e-5)


@pytest.mark.parametrize("num_tokens", [3, 65, 130])
def test_rules_match_transformers(num_tokens):
    raw = raw_rule_inputs(num_tokens, seed=100 + num_tokens)
    q, k, v, g, beta, state = (torch.from_numpy(x) for x in raw)
    batched = [x[None] for x in (q, k, v, g, beta)]
    kwargs = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_chunk = hf.torch_chunk_gated_delta_rule(*batched, **kwargs)
    hf_rec = hf.torch_recurrent_gated_delta_rule(*batched, **kwargs)
    ours = rule_inputs(num_tokens, seed=100 + num_tokens)
    o_chunk, s_chunk = chunked_rule(*ours, ones(num_tokens))
    o_rec, s_rec = recurrent_rule(*ours, ones(num_tokens))
    for (o, s), (o_hf, s_hf) in [((o_chunk, s_chunk), hf_chunk), ((o_rec, s_rec), hf_rec)]:
        close(o, o_hf[0].numpy())
        close(s, s_hf[0].numpy())


def test_invalid_tokens_are_skipped_by_the_rules():
    q, k, v, g, beta, state = rule_inputs(20, seed=7)
    valid = np.ones(20, bool)
    valid[[2, 3, 9, 17, 18, 19]] = False
    # Garbage in skipped tokens must not leak.
    q, k = q.at[3].set(jnp.nan), k.at[9].set(1e30)
    kept = np.flatnonzero(valid)
    compact = [np.asarray(x)[kept] for x in (q, k, v, g, beta)]
    o_ref, s_ref = recurrent_rule(*compact, state, ones(len(kept)))
    for rule in (chunked_rule, recurrent_rule):
        o, s = rule(q, k, v, g, beta, state, jnp.asarray(valid))
        close(np.asarray(o)[kept], o_ref, 1e-5)
        close(s, s_ref, 1e-5)
    for rule in (chunked_rule, recurrent_rule):  # nothing valid: the state comes back as is
        _, s = rule(q, k, v, g, beta, state, jnp.zeros(20, bool))
        np.testing.assert_array_equal(s, state)


@pytest.mark.parametrize("parents", [TREE, CHAIN], ids=["tree", "chain"])
def test_tree_rule_and_conv_against_path_walks(parents):
    num_tokens = len(parents)
    q, k, v, g, beta, state = rule_inputs(num_tokens, seed=3)
    o, states = tree_rule(q, k, v, g, beta, state, jnp.asarray(parents), ones(num_tokens))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(num_tokens, 24)).astype(np.float32)
    window = rng.normal(size=(K - 1, 24)).astype(np.float32)
    weight = rng.normal(size=(K, 24)).astype(np.float32)
    y, windows = tree_conv(x, window, weight, jnp.asarray(parents), ones(num_tokens))
    for node in range(num_tokens):
        path = path_to(parents, node)
        o_ref, s_ref = ref_rule_path(q, k, v, g, beta, state, path)
        close(o[node], o_ref, 1e-5)
        close(states[node], s_ref, 1e-5)
        y_ref, window_ref = ref_conv_path(x, window, weight, path)
        close(y[node], y_ref, 1e-5)
        close(windows[node], window_ref, 0)


def test_causal_conv_equals_conv_steps_and_skips_invalid_tokens():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(9, 24)).astype(np.float32)
    window = rng.normal(size=(K - 1, 24)).astype(np.float32)
    weight = rng.normal(size=(K, 24)).astype(np.float32)
    valid = np.array([1, 0, 1, 1, 0, 0, 1, 0, 0], bool)
    y, after = causal_conv(x, window, weight, jnp.asarray(valid))
    w = window
    for t in range(9):
        y_t, w = conv_step(x[t], w, weight, valid[t])
        if valid[t]:
            close(y[t], y_t, 1e-6)
    np.testing.assert_array_equal(after, w)
    kept = x[valid]
    np.testing.assert_array_equal(after, np.concatenate([window, kept])[-(K - 1):])
    _, after = causal_conv(x, window, weight, jnp.zeros(9, bool))
    np.testing.assert_array_equal(after, window)


# ---------------------------------------------------------------- the layer


def test_layer_matches_transformers(layer):
    module, params, _, _ = layer
    x = hidden(1, 70, seed=10)
    cache = DynamicCache(config=hf_config())
    expected = hf_forward(module, x, cache)
    y, state = prefill(params, x, gdn.zero_state(CONFIG, 1, jnp.float32), ones(1, 70))
    close(y, expected)
    close(state.ssm[0], cache.get_recurrent_state(0)[0].numpy())
    hf_window = cache.get_conv_state(0)[0].numpy().T[1:]  # [K, conv_dim]: the last K inputs
    close(state.conv[0], hf_grouped(hf_window))


def test_continuation_equals_one_shot_prefill(layer):
    """Prefill part of the prompt, then the rest as a second chunk, or token by token: the
    outputs and final state of transformers' one-shot prefill."""
    module, params, _, _ = layer
    x = hidden(1, 70, seed=11)
    cache = DynamicCache(config=hf_config())
    expected = hf_forward(module, x, cache)
    y_head, head = prefill(params, x[:, :35], gdn.zero_state(CONFIG, 1, jnp.float32), ones(1, 35))
    close(y_head, expected[:, :35])
    y_tail, state = prefill(params, x[:, 35:], head, ones(1, 35))
    close(y_tail, expected[:, 35:])
    close(state.ssm[0], cache.get_recurrent_state(0)[0].numpy())
    state = head
    for t in range(35, 70):
        y, state = decode(params, x[:, t], state, ones(1))
        close(y[0], expected[0, t])
    close(state.ssm[0], cache.get_recurrent_state(0)[0].numpy())
    close(state.conv[0], hf_grouped(cache.get_conv_state(0)[0].numpy().T[1:]))


def test_cached_window_equals_one_token_at_a_time(layer):
    """What verify does on a chain: several tokens after a cached state, each token's output and
    state equal to decoding them one by one; prefill of the same tokens agrees too."""
    _, params, _, _ = layer
    start = random_state(2, seed=12)
    x = hidden(2, len(CHAIN), seed=13)
    parents = jnp.asarray([CHAIN, CHAIN])
    y_tree, nodes = verify(params, x, start, parents, ones(2, len(CHAIN)))
    y_pre, state_pre = prefill(params, x, start, ones(2, len(CHAIN)))
    state = start
    for t in range(len(CHAIN)):
        y, state = decode(params, x[:, t], state, ones(2))
        close(y_tree[:, t], y)
        close(y_pre[:, t], y)
        close(nodes.ssm[:, t], state.ssm)
        close(nodes.conv[:, t], state.conv)
    close(state_pre.ssm, state.ssm)
    close(state_pre.conv, state.conv)


def test_verify_tree_and_commit(layer):
    """Every node of a branching tree (sequence 0) and a chain (sequence 1) equals decoding its
    root-to-node path; committing a node and decoding on equals decoding that path and on."""
    _, params, _, _ = layer
    start = random_state(2, seed=14)
    parents = np.array([TREE, CHAIN + [-1] * (len(TREE) - len(CHAIN))])
    valid = np.array([[True] * len(TREE), [True] * len(CHAIN) + [False] * 4])
    x = hidden(2, len(TREE), seed=15)
    y_tree, nodes = verify(params, x, start, jnp.asarray(parents), jnp.asarray(valid))
    path_states = {}
    for b in range(2):
        for node in np.flatnonzero(valid[b]):
            state = jax.tree.map(lambda s, b=b: s[b : b + 1], start)
            for t in path_to(parents[b].tolist(), node):
                y, state = decode(params, x[b : b + 1, t], state, ones(1))
            close(y_tree[b, node], y[0])
            close(nodes.ssm[b, node], state.ssm[0])
            close(nodes.conv[b, node], state.conv[0])
            path_states[b, node] = state
    accepted = (8, 4)  # tree path 0 -> 2 -> 5 -> 8; chain path 0 -> ... -> 4
    committed = select_node(nodes, jnp.asarray(accepted))
    nxt = hidden(2, 1, seed=16)[:, 0]
    y, after = decode(params, nxt, committed, ones(2))
    for b in range(2):
        y_ref, after_ref = decode(params, nxt[b : b + 1], path_states[b, accepted[b]], ones(1))
        close(y[b], y_ref[0])
        close(after.ssm[b], after_ref.ssm[0])
        close(after.conv[b], after_ref.conv[0])


def test_padding_leaves_states_unchanged(layer):
    _, params, _, _ = layer
    start = random_state(2, seed=17)
    # decode: a padded batch slot keeps its state exactly
    _, state = decode(params, hidden(2, 1, seed=18)[:, 0], start, jnp.asarray([False, True]))
    for field in range(2):
        np.testing.assert_array_equal(state[field][0], start[field][0])
        assert not np.allclose(state[field][1], start[field][1])
    # prefill: a fully padded row keeps its state; holes and a padded tail are skipped
    x = hidden(2, 12, seed=19)
    valid = np.ones((2, 12), bool)
    valid[0] = False
    valid[1, [3, 4, 8, 9, 10, 11]] = False
    y, state = prefill(params, x, start, jnp.asarray(valid))
    for field in range(2):
        np.testing.assert_array_equal(state[field][0], start[field][0])
    kept = np.flatnonzero(valid[1])
    y_ref, ref = prefill(params, x[[1, 1]][:, kept], start, ones(2, len(kept)))
    close(y[1, kept], y_ref[1])
    close(state.ssm[1], ref.ssm[1])
    close(state.conv[1], ref.conv[1])
    # verify: an invalid node's state is its parent's
    valid = np.ones((2, len(TREE)), bool)
    valid[0, 5] = False  # node 5 (parent 2), whose child 8 then starts from node 2's state
    x = hidden(2, len(TREE), seed=20)
    _, nodes = verify(params, x, start, jnp.asarray([TREE] * 2), jnp.asarray(valid))
    for field in range(2):
        np.testing.assert_array_equal(nodes[field][0, 5], nodes[field][0, 2])


def test_halves_of_the_key_heads_sum_to_the_layer(layer):
    """Split for tensor parallelism: each half of the key heads (their parameters, window
    channels and value heads) runs the same code, and the two out_proj outputs add up."""
    _, params, _, _ = layer
    start = random_state(2, seed=21)
    x = hidden(2, 1, seed=22)[:, 0]
    y, state = decode(params, x, start, ones(2))
    half_c, half_v = CONFIG.conv_dim // 2, NV // 2
    total = 0
    for i in range(2):
        c, v = slice(i * half_c, (i + 1) * half_c), slice(i * half_v, (i + 1) * half_v)
        heads = slice(i * NK // 2, (i + 1) * NK // 2)
        part = {
            "w_in": params["w_in"][heads], "conv_w": params["conv_w"][heads],
            "dt_bias": params["dt_bias"][v], "a_log": params["a_log"][v], "norm": params["norm"],
            "w_out": params["w_out"][:, i * half_v * DV : (i + 1) * half_v * DV],
        }
        y_part, s_part = decode(part, x, GdnState(start.conv[..., c], start.ssm[:, v]), ones(2))
        close(s_part.conv, state.conv[..., c])
        close(s_part.ssm, state.ssm[:, v])
        total = total + y_part
    close(total, y)


# ---------------------------------------------------------------- over a pool of slots

BLOCK = 16


def random_pool(num_slots: int, seed: int) -> GdnState:
    """Random states in every slot but the null slot 0, which stays zero."""
    pool = random_state(num_slots, seed)
    return GdnState(*(x.at[0].set(0.0) for x in pool))


def test_extend_blocks_continue_each_sequence_from_its_slot(layer):
    """A ragged extend batch: A (slot 2, fresh, 20 tokens over two blocks), B (slot 4, a
    second chunk of 5 tokens after its saved state), C (slot 1, 16 tokens), then a padding
    block: each equals prefill of that sequence alone, and only slots 2, 4 and 1 change."""
    _, params, _, _ = layer
    pool = random_pool(6, seed=30)
    seqs = [(2, True, 20), (4, False, 5), (1, False, 16)]  # slot, fresh, tokens
    x = hidden(1, 5 * BLOCK, seed=31)[0]
    slot, first, last, fresh = [], [], [], []
    valid = np.zeros((5, BLOCK), bool)
    block, spans = 0, []
    for s, f, n in seqs:
        blocks = -(-n // BLOCK)
        spans.append((block * BLOCK, n))
        for j in range(blocks):
            slot.append(s), first.append(j == 0), last.append(j == blocks - 1), fresh.append(f)
            valid[block + j] = np.arange(BLOCK) < n - j * BLOCK
        block += blocks
    slot.append(0), first.append(False), last.append(False), fresh.append(False)  # padding
    layout = gdn.SlotLayout(*(jnp.asarray(a) for a in (slot, first, last, fresh, valid)))
    y, after = forward_slots(params, x, pool, layout)
    for (s, f, n), (start, _) in zip(seqs, spans, strict=True):
        begin = jax.tree.map(lambda p, s=s, f=f: p[s : s + 1] * (not f), pool)
        y_ref, ref = prefill(params, x[None, start : start + n], begin, ones(1, n))
        close(y[start : start + n], y_ref[0])
        close(after.ssm[s], ref.ssm[0])
        close(after.conv[s], ref.conv[0])
    for untouched in (0, 3, 5):
        for field in range(2):
            np.testing.assert_array_equal(after[field][untouched], pool[field][untouched])


def test_decode_rows_read_and_write_their_slots(layer):
    """A decode batch (blocks of one token): rows in slots 3, 5 (fresh) and 1, one padding
    row; the padding row writes nothing, not even the null slot."""
    _, params, _, _ = layer
    pool = random_pool(6, seed=32)
    x = hidden(4, 1, seed=33)[:, 0]
    slot, fresh, live = [3, 0, 5, 1], [False, False, True, False], [True, False, True, True]
    layout = gdn.SlotLayout(jnp.asarray(slot), jnp.asarray(live), jnp.asarray(live),
                            jnp.asarray(fresh), jnp.asarray(live)[:, None])
    y, after = forward_slots(params, x, pool, layout)
    for row in (0, 2, 3):
        s = slot[row]
        begin = jax.tree.map(lambda p, s=s, row=row: p[s : s + 1] * (not fresh[row]), pool)
        y_ref, ref = decode(params, x[row : row + 1], begin, ones(1))
        close(y[row], y_ref[0])
        close(after.ssm[s], ref.ssm[0])
        close(after.conv[s], ref.conv[0])
    for untouched in (0, 2, 4):
        for field in range(2):
            np.testing.assert_array_equal(after[field][untouched], pool[field][untouched])


# ---------------------------------------------------------------- names, shapes, sizes


def test_weight_specs_name_every_tensor_and_round_trip(layer):
    _, params, tensors, specs = layer
    assert {n: s.shape for n, s in specs.items()} == {n: t.shape for n, t in tensors.items()}
    back = checkpoint_tensors(jax.tree.map(np.asarray, params), specs)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(back[name], tensor)
    shapes = {name: p.shape for name, p in params.items()}
    assert shapes == {
        "w_in": (NK, 2 * DK + 2 * R * DV + 2 * R, H), "conv_w": (NK, 2 * DK + R * DV, K),
        "dt_bias": (NV,), "a_log": (NV,), "norm": (DV,), "w_out": (H, NV * DV),
    }


def test_state_sizes_of_qwen3_next():
    config = GdnConfig.from_hf(Qwen3NextConfig().to_dict())  # 16 key, 32 value heads of 128
    shapes = gdn.state_shapes(config, jnp.bfloat16)
    assert shapes.conv.shape == (3, 2 * 16 * 128 + 32 * 128) and shapes.conv.dtype == jnp.bfloat16
    assert shapes.ssm.shape == (32, 128, 128) and shapes.ssm.dtype == jnp.float32
    assert gdn.state_bytes(config, jnp.bfloat16) == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    zeros = gdn.zero_state(config, 2, jnp.bfloat16)
    assert zeros.conv.shape == (2, 3, 8192) and zeros.ssm.shape == (2, 32, 128, 128)
    with pytest.raises(ValueError, match="multiple"):
        GdnConfig(64, 3, 8, 16, 16)
