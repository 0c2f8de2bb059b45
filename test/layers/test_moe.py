"""The mixture-of-experts MLP against a plain reference that loops over tokens and experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.layers.moe import moe_mlp, route, sort_by_expert

H, INTER, SHARED_INTER, E = 16, 12, 20, 8


def silu(x):
    return x / (1.0 + np.exp(-x))


def random_weights(seed: int, shared: bool) -> dict[str, np.ndarray]:
    """Each expert's gate/up [I, H] and down [H, I] as separate matrices, as a checkpoint
    stores them; the shared expert's likewise."""
    rng = np.random.default_rng(seed)
    w = {"router": rng.standard_normal((E, H)),
         "gate": rng.standard_normal((E, INTER, H)) / np.sqrt(H),
         "up": rng.standard_normal((E, INTER, H)) / np.sqrt(H),
         "down": rng.standard_normal((E, H, INTER)) / np.sqrt(INTER)}
    if shared:
        w |= {"shared_gate": rng.standard_normal((SHARED_INTER, H)) / np.sqrt(H),
              "shared_up": rng.standard_normal((SHARED_INTER, H)) / np.sqrt(H),
              "shared_down": rng.standard_normal((H, SHARED_INTER)) / np.sqrt(SHARED_INTER),
              "shared_expert_gate": rng.standard_normal((1, H))}
    return {k: v.astype(np.float32) for k, v in w.items()}


def layer_params(w: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The same weights in the layer's layout: gate and up of a feature side by side."""
    p = {"w_router": w["router"], "w_expert_gate_up": np.stack([w["gate"], w["up"]], axis=2),
         "w_expert_down": w["down"]}
    if "shared_gate" in w:
        p |= {"w_shared_gate_up": np.stack([w["shared_gate"], w["shared_up"]], axis=1),
              "w_shared_down": w["shared_down"], "w_shared_gate": w["shared_expert_gate"]}
    return {k: jnp.asarray(v) for k, v in p.items()}


def reference(w: dict[str, np.ndarray], x: np.ndarray, top_k: int, norm_topk_prob: bool
              ) -> np.ndarray:
    """Token by token: softmax over the router's logits, the k most probable experts
    (renormalised or not), their SiLU-gated MLPs weighted; plus the gated shared expert."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t, token in enumerate(x):
        logits = w["router"] @ token
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs)[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if norm_topk_prob else 1.0)
        for expert, weight in zip(chosen, weights, strict=True):
            hidden = silu(w["gate"][expert] @ token) * (w["up"][expert] @ token)
            out[t] += weight * (w["down"][expert] @ hidden)
        if "shared_gate" in w:
            hidden = silu(w["shared_gate"] @ token) * (w["shared_up"] @ token)
            gate = 1.0 / (1.0 + np.exp(-(w["shared_expert_gate"] @ token)[0]))
            out[t] += gate * (w["shared_down"] @ hidden)
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 2), (40, 3), (5, 1)])
def test_moe_matches_token_by_token_reference(shared, norm_topk_prob, num_tokens, top_k):
    w = random_weights(seed=num_tokens, shared=shared)
    x = np.random.default_rng(100 + num_tokens).standard_normal((num_tokens, H))
    x = x.astype(np.float32)
    layer = jax.jit(moe_mlp, static_argnames=("top_k", "norm_topk_prob"))
    got = layer(layer_params(w), jnp.asarray(x), top_k=top_k, norm_topk_prob=norm_topk_prob)
    assert got.shape == (num_tokens, H) and got.dtype == jnp.float32
    expected = reference(w, x, top_k, norm_topk_prob)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=2e-5)


def test_route_picks_the_most_probable_experts_best_first():
    w = random_weights(seed=0, shared=False)
    x = np.random.default_rng(1).standard_normal((6, H)).astype(np.float32)
    weights, experts = route(jnp.asarray(x), jnp.asarray(w["router"]), top_k=3,
                             norm_topk_prob=False)
    logits = x.astype(np.float64) @ w["router"].T.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_array_equal(experts, np.argsort(-probs, axis=-1)[:, :3])
    np.testing.assert_allclose(weights, np.take_along_axis(probs, np.asarray(experts), -1),
                               rtol=1e-5)
    renormed, _ = route(jnp.asarray(x), jnp.asarray(w["router"]), top_k=3,
                        norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(renormed).sum(-1), 1.0, rtol=1e-6)


def test_sort_by_expert_groups_slots_stably():
    experts = jnp.array([[3, 0], [0, 5], [3, 1]], jnp.int32)  # slot = token * k + j
    order, sizes = sort_by_expert(experts, num_experts=6)
    assert order.tolist() == [1, 2, 5, 0, 4, 3]  # expert 0: slots 1, 2; 1: 5; 3: 0, 4; 5: 3
    assert sizes.tolist() == [2, 1, 0, 2, 0, 1]


def test_unrouted_experts_and_one_hot_routing():
    """Every token to the same expert (the others get empty groups) still matches."""
    w = random_weights(seed=3, shared=False)
    w["router"][:] = 0.0
    w["router"][5, 0] = 50.0  # with x[:, 0] > 0, expert 5 wins by far
    x = np.abs(np.random.default_rng(4).standard_normal((7, H))).astype(np.float32)
    got = moe_mlp(layer_params(w), jnp.asarray(x), top_k=1, norm_topk_prob=False)
    np.testing.assert_allclose(np.asarray(got), reference(w, x, 1, False), atol=2e-5,
                               rtol=2e-5)
