"""A new EAGLE3 draft head for a target: its config.json, its first weights, and its export in
the SpecForge / SGLang checkpoint layout that `load_eagle3_draft` reads.

The head is a Llama decoder layer as wide as the target (SpecForge's default), with the
target's rotary settings and `eagle_aux_hidden_state_layer_ids` written explicitly
(SpecForge's [1, L//2-1, L-4], "output of layer i"). Its lm_head starts from the target's
output rows of the draft vocabulary, so step 0 begins near the target's own prediction
(the draft's final norm starts at ones); everything else starts small and random.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from sgl_jax.layers.weights import WeightSpec, checkpoint_tensors
from sgl_jax.models import llama_eagle3
from sgl_jax.models.llama_eagle3 import Eagle3Config
from sgl_jax.models.loader import LoadedModel, load_params
from sgl_jax.parallel import TensorParallel

INIT_STD = 0.02  # Hugging Face's initializer_range for Llama
_TARGET_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "rope_scaling", "rope_parameters", "max_position_embeddings")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """SpecForge's capture layers in the 'output of layer i' convention: [1, L//2-1, L-4]."""
    n = num_target_layers
    return [1, n // 2 - 1, n - 4]


def draft_hf_config(target_hf: dict[str, Any], draft_vocab_size: int,
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The draft's config.json: the target's widths and rotary settings, one layer, the
    draft vocabulary, and explicit capture layers; `overrides` (e.g. a smaller
    intermediate_size) win."""
    config = {k: target_hf[k] for k in _TARGET_FIELDS if target_hf.get(k) is not None}
    config.update({
        "architectures": list(llama_eagle3.ARCHITECTURES),
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": target_hf["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_hf["hidden_size"],
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                         default_aux_layer_ids(target_hf["num_hidden_layers"])},
    })
    config.update(overrides or {})
    return config


def initial_tensors(config: Eagle3Config, d2t: np.ndarray, target_head: np.ndarray,
                    seed: int) -> dict[str, np.ndarray]:
    """Checkpoint tensors of a fresh head: lm_head = the target's rows of the draft ids
    (`target_head` [V, H], d2t i64[Vd]), norms at one, other matrices N(0, INIT_STD)."""
    rng = np.random.default_rng(seed)
    names = ["fc.weight", "lm_head.weight", "d2t"]
    tensors = {}
    for name, spec in llama_eagle3.hf_weight_specs(config, names).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(spec.shape, np.float32)
        elif name not in ("lm_head.weight", "d2t"):
            tensors[name] = (INIT_STD * rng.standard_normal(spec.shape)).astype(np.float32)
    draft_ids = np.arange(len(d2t))
    tensors["lm_head.weight"] = np.asarray(target_head, np.float32)[draft_ids + d2t]
    tensors["d2t"] = d2t.astype(np.int64)
    return tensors


class ArraySource:
    """Checkpoint tensors already in memory, as a `TensorSource`."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def check(self, names: list[str], specs: dict[str, WeightSpec]) -> None:
        for name in names:
            if self.tensors[name].shape != specs[name].shape:
                raise ValueError(f"tensor {name} has shape {self.tensors[name].shape}, "
                                 f"expected {specs[name].shape}")

    def read(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        for name in names:
            yield name, self.tensors[name]


def place_draft(config: Eagle3Config, tensors: dict[str, np.ndarray], dtype: Any,
                tp: TensorParallel) -> dict[str, Any]:
    """Checkpoint tensors -> the draft's parameter pytree on the mesh, through the loader."""
    specs = llama_eagle3.hf_weight_specs(config, list(tensors))
    return load_params(ArraySource(tensors), specs, dtype, config=config.layer, tp=tp,
                       progress=False, what="the draft")


def target_output_rows(target: LoadedModel) -> np.ndarray:
    """The target's output matrix [V, H] (its lm_head, or the tied embedding)."""
    params = target.params
    head = params["embed"] if target.config.tie_word_embeddings else params["lm_head"]
    return np.asarray(head, np.float32)[: target.config.vocab_size]


def export_draft(path: str | Path, hf_config: dict[str, Any], params: dict[str, Any],
                 t2d: np.ndarray, dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors (`dtype` float32 or bfloat16) with d2t and t2d,
    as SpecForge does. `params` are host arrays of the draft's pytree."""
    config = llama_eagle3.config_from_hf(hf_config)
    specs = llama_eagle3.hf_weight_specs(config, ["fc.weight", "lm_head.weight", "d2t"])
    tensors = checkpoint_tensors(params, specs)
    return save_head(path, hf_config, {name: t for name, t in tensors.items() if name != "d2t"},
                     dtype, {"d2t": tensors["d2t"].astype(np.int64),
                             "t2d": np.asarray(t2d, bool)})


def save_head(path: str | Path, hf_config: dict[str, Any], tensors: dict[str, np.ndarray],
              dtype: str, exact: dict[str, np.ndarray] | None = None) -> Path:
    """config.json and model.safetensors in `path`: float `tensors` cast to `dtype` (float32
    or bfloat16), `exact` ones (index tables) as they are."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cast = _float_caster(dtype)
    save_file({**{name: cast(t) for name, t in tensors.items()}, **(exact or {})},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}, indent=2)
                                     + "\n")
    return out


def _float_caster(dtype: str):
    if dtype == "float32":
        return lambda t: np.asarray(t, np.float32)
    if dtype == "bfloat16":
        import ml_dtypes
        return lambda t: np.asarray(t, np.float32).astype(ml_dtypes.bfloat16)
    raise ValueError(f"export dtype {dtype!r} is not supported; choose float32 or bfloat16")
