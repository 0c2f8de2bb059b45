"""PyTorch building blocks for the reference implementations tests compare against
(imports torch: for tests only)."""

from __future__ import annotations

import torch
from safetensors.numpy import load_file


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding (rotate-half form) on x [T, heads, hd]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = positions[:, None].double() * inv_freq[None]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None].float()
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None].float()
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def torch_tensors(path) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in load_file(str(path)).items()}


def causal_self_attention(w: dict[str, torch.Tensor], prefix: str, a: torch.Tensor, *,
                          heads: int, kv_heads: int, head_dim: int, theta: float
                          ) -> torch.Tensor:
    """Llama attention of one sequence a [T, in] with its own q/k/v/o projections
    (`{prefix}self_attn.*_proj.weight`), rope at positions 0..T-1 and a causal mask."""
    n, hd = a.shape[0], head_dim
    positions = torch.arange(n)
    q = rope((a @ w[prefix + "self_attn.q_proj.weight"].T).view(n, heads, hd), positions, theta)
    k = rope((a @ w[prefix + "self_attn.k_proj.weight"].T).view(n, kv_heads, hd), positions,
             theta)
    v = (a @ w[prefix + "self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
    return attn @ w[prefix + "self_attn.o_proj.weight"].T


def dflash_block_hidden(w: dict[str, torch.Tensor], cfg: dict, features: torch.Tensor,
                        block_ids: torch.Tensor, embed: torch.Tensor, *,
                        windows: bool = True) -> torch.Tensor:
    """One DFlash block's final-normed output [B, H]: `block_ids` at positions C..C+B-1 after
    the whole context of `features` [C, L*H] (torch_block_forward with one block anchored at
    C). windows=False ignores the config's sliding windows (to show that they cut
    something)."""
    if not windows:
        cfg = {**cfg, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}
    return torch_block_forward(w, cfg, features, embed[block_ids][None],
                               torch.tensor([features.shape[0]]))[0]


def torch_block_forward(w: dict[str, torch.Tensor], config: dict, features: torch.Tensor,
                        block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """A DFlash backbone: blocks [A, B, H] anchored at positions `anchors` [A] over one
    sequence's context features [L, F] -> the final-normed block states [A, B, H]. Query
    (a, k) sees the context before anchor a and every key of block a (a sliding layer of
    window W: only keys less than W positions behind it)."""
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    heads, kv_heads, hd = (config["num_attention_heads"], config["num_key_value_heads"],
                           config["head_dim"])
    num_blocks, width, h = block_embeds.shape
    ctx_len = features.shape[0]
    c = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(ctx_len)
    blk_pos = (anchors[:, None] + torch.arange(width)[None, :]).reshape(-1)
    # Query (a, k) sees context before anchor a and every key of block a.
    sees_ctx = ctx_pos[None, :] < anchors.repeat_interleave(width)[:, None]  # [A*B, L]
    block_of = torch.arange(num_blocks).repeat_interleave(width)
    sees_blk = block_of[:, None] == block_of[None, :]  # [A*B, A*B]
    visible = torch.cat([sees_ctx, sees_blk], 1)
    # A sliding layer also hides keys W or more positions behind the query.
    behind = blk_pos[:, None] - torch.cat([ctx_pos, blk_pos])[None, :]  # [A*B, L + A*B]
    x = block_embeds.reshape(-1, h)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        layer_visible = visible
        if config["layer_types"][i] == "sliding_attention":
            layer_visible = visible & (behind < config["sliding_window"])

        def project(t, name, count, p=p):
            return (t @ w[p + f"self_attn.{name}_proj.weight"].T).view(t.shape[0], count, hd)

        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms_norm(project(a, "q", heads), w[p + "self_attn.q_norm.weight"], eps),
                 blk_pos, theta)
        k = torch.cat([rope(rms_norm(project(src, "k", kv_heads),
                                     w[p + "self_attn.k_norm.weight"], eps), pos, theta)
                       for src, pos in ((c, ctx_pos), (a, blk_pos))])
        v = torch.cat([project(c, "v", kv_heads), project(a, "v", kv_heads)])
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        scores = scores.masked_fill(~layer_visible[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["norm.weight"], eps).view(num_blocks, width, h)


def dspark_heads(w: dict[str, torch.Tensor], cfg: dict, hidden: torch.Tensor,
                 previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DSpark head's draft logits [B, V] and confidence logits [B] of one block's outputs
    hidden [B, H], the token before each slot `previous` [B] (the Markov heads by their
    definitions: vanilla W2 W1[x], gated W2 (sigmoid(G [h; e] + g) * e), rnn a gated state
    along the block)."""
    kind = cfg.get("markov_head_type") if cfg["markov_rank"] else None
    m = "markov_head."
    state = torch.zeros(cfg["markov_rank"])
    logits, features = [], []
    for h, prev in zip(hidden, previous, strict=True):
        z = w["lm_head.weight"] @ h
        e = w[m + "markov_w1.weight"][prev] if kind else torch.zeros(0)
        if kind == "vanilla":
            z = z + w[m + "markov_w2.weight"] @ e
        elif kind == "gated":
            gate = torch.sigmoid(w[m + "gate_proj.weight"] @ torch.cat([h, e])
                                 + w[m + "gate_proj.bias"])
            z = z + w[m + "markov_w2.weight"] @ (gate * e)
        elif kind == "rnn":
            joint = w[m + "joint_proj.weight"] @ torch.cat([state, e, h]) + w[m + "joint_proj.bias"]
            gate, candidate, output = joint.chunk(3)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
            z = z + w[m + "markov_w2.weight"] @ torch.tanh(output)
        logits.append(z)
        features.append(torch.cat([h, e]) if cfg.get("confidence_head_with_markov") else h)
    confidence = torch.stack(features) @ w["confidence_head.proj.weight"][0]
    return torch.stack(logits), confidence + w["confidence_head.proj.bias"][0]
