"""Multi-token-prediction (MTP) tensors beside a tiny Qwen3-Next checkpoint, as the hub's
Qwen3-Next checkpoints ship them (transformers drops `mtp.*` tensors when it saves a model,
so they are written here, into a file of their own).

The layer's tensors come from transformers' own Qwen3-Next decoder layer (full attention,
the sparse MoE with its gated shared expert), so their names and shapes are transformers';
fc and the three norms are drawn here (or fitted: `fit_mtp_tensors`). Needs torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

MTP_FILE = "mtp.safetensors"
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_layer_config(model_dir: str | Path) -> Any:
    """transformers' Qwen3NextConfig of the checkpoint, reduced to the MTP's one layer: full
    attention, with a mixture-of-experts MLP."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    hf.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[],
              decoder_sparse_step=1)
    config = Qwen3NextConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    config._attn_implementation = "eager"
    return config


def write_mtp_tensors(model_dir: str | Path, *, seed: int = 0, std: float = 0.2
                      ) -> dict[str, np.ndarray]:
    """Random MTP tensors written beside the checkpoint in `model_dir`; returns them."""
    config = mtp_layer_config(model_dir)
    torch.manual_seed(seed)
    layer = Qwen3NextDecoderLayer(config, 0)
    rng = np.random.default_rng(seed)
    h = config.hidden_size
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred: transformers starts them at 0
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, std)
    tensors = _per_expert(
        {f"mtp.layers.0.{name}": p.detach().numpy().copy()
         for name, p in layer.named_parameters()})
    tensors["mtp.fc.weight"] = (rng.standard_normal((h, 2 * h)) * std).astype(np.float32)
    for norm in NORMS:
        tensors[f"mtp.{norm}.weight"] = (rng.standard_normal(h) * 0.1).astype(np.float32)
    add_mtp_tensors(model_dir, tensors)
    return tensors


def _per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused expert stacks (experts.gate_up_proj [E, 2I, H], gate rows first;
    experts.down_proj [E, H, I]) in the hub's per-expert spelling."""
    out = {}
    for name, tensor in tensors.items():
        prefix, _, kind = name.rpartition("experts.")
        if kind == "gate_up_proj":
            gate, up = np.split(tensor, 2, axis=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}experts.{e}.up_proj.weight"] = up[e]
        elif kind == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def add_mtp_tensors(model_dir: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Save `tensors` (mtp.* names) as the checkpoint's MTP file, listed in its index when it
    has one."""
    from safetensors.numpy import save_file

    model_dir = Path(model_dir)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(model_dir / MTP_FILE), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        listing = json.loads(index.read_text())
        listing["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
        index.write_text(json.dumps(listing, indent=2))


def fit_mtp_tensors(model_dir: str | Path, prompts: list[list[int]], *, new_tokens: int = 48,
                    steps: int = 300, lr: float = 3e-3, seed: int = 0) -> list[list[int]]:
    """An MTP module fitted to the checkpoint's own greedy text (its continuations of
    `prompts`, all of one length), written beside it; returns those continuations
    (transformers' greedy decoding, `new_tokens` each, EOS suppressed).

    The objective is the module's first draft step: at each position t of the continuation,
    from the target's final-norm hidden state h_t and token t+1, predict token t+2."""
    torch.manual_seed(seed)
    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        prompt = torch.tensor(prompts)
        text = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False)
        hidden = target.model(text).last_hidden_state  # [B, L, H]
    module = _TorchMtp(mtp_layer_config(model_dir))
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    tokens, features, labels = text[:, 1:-1], hidden[:, :-2], text[:, 2:]
    learnt = labels[:, prompt.shape[1] - 2:]  # the continuation: the target's own text
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    for _ in range(steps):
        logits = module(embed[tokens], features)[:, prompt.shape[1] - 2:] @ lm_head.T
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), learnt.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    add_mtp_tensors(model_dir, module.tensors())
    return text[:, prompt.shape[1]:].tolist()


def _drawn(layer: torch.nn.Module) -> torch.nn.Module:
    """`layer` with every weight drawn from N(0, 1/fan_in) and every norm at zero (its
    centre). transformers leaves a bare layer's expert stacks as torch.empty (its model
    class initialises them), and a fit from that memory turned NaN in some runs."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.zero_()
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return layer


class _TorchMtp(torch.nn.Module):
    """The module for fitting: qwen3_next_mtp's forward, batched and causal."""

    def __init__(self, config: Any):
        super().__init__()
        h = config.hidden_size
        self.eps = config.rms_norm_eps
        self.layer = _drawn(Qwen3NextDecoderLayer(config, 0))
        self.rotary = Qwen3NextRotaryEmbedding(config)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.norms = torch.nn.ParameterDict(
            {name: torch.nn.Parameter(torch.zeros(h)) for name in NORMS})

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:  # zero-centred
        w = self.norms[name]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + w)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, T, H] each -> the module's normed output [B, T, H]."""
        x = self.fc(torch.cat([self.norm(embeds, "pre_fc_norm_embedding"),
                               self.norm(features, "pre_fc_norm_hidden")], -1))
        t = x.shape[1]
        positions = torch.arange(t)[None]
        mask = torch.full((1, 1, t, t), float("-inf")).triu(1)
        out = self.layer(x, position_embeddings=self.rotary(x, positions),
                         attention_mask=mask, position_ids=positions)
        return self.norm(out[0] if isinstance(out, tuple) else out, "norm")

    def tensors(self) -> dict[str, np.ndarray]:
        """The checkpoint's mtp.* tensors, experts in the hub's spelling."""
        out = _per_expert({f"mtp.layers.0.{name}": p.detach().numpy().copy()
                           for name, p in self.layer.named_parameters()})
        out["mtp.fc.weight"] = self.fc.weight.detach().numpy().copy()
        for name in NORMS:
            out[f"mtp.{name}.weight"] = self.norms[name].detach().numpy().copy()
        return out
