"""Load a checkpoint into a parameter pytree: a Hugging Face safetensors directory (local or a
hub id) or a GGUF file (see `gguf`).

Every problem is reported before any tensor data is read: the whole checkpoint is validated
against the tensors the architecture expects (names, shapes, dtypes) from the file headers.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from sgl_jax.layers.quantization import QuantizedWeight, quantize_param
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.models import dflash, dspark, llama_eagle, llama_eagle3, qwen3_next_mtp
from sgl_jax.models.config import ModelConfig, check_tensor_parallel
from sgl_jax.models.dflash import DFlashConfig
from sgl_jax.models.gguf import GGUFCheckpoint, find_gguf_file
from sgl_jax.models.llama_eagle3 import Eagle3Config
from sgl_jax.models.registry import ModelImpl, get_model_impl
from sgl_jax.parallel.sharding import TensorParallel, split_in_features

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
_CHECKPOINT_DTYPES = {"F32", "F16", "BF16", "F64"}
_INDEX_DTYPES = {"I64", "I32"}
_FP8_DTYPE = "F8_E4M3"
_FP8_SCALE_SUFFIX = "_scale_inv"  # X.weight_scale_inv: the block scales of X.weight
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")
# Buffers some exporters save that carry no learned weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match what its config.json describes."""


class TensorSource(Protocol):
    """Where a checkpoint's tensors come from, under Hugging Face names."""

    def names(self) -> list[str]: ...

    def check(self, names: list[str], specs: dict[str, WeightSpec]) -> None:
        """Raise if a tensor's stored shape or type does not fit its spec; reads no data."""

    def read(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]: ...


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path  # config.json, generation_config.json and the tokenizer
    tensors: TensorSource


def open_checkpoint(model_path: str, revision: str | None = None) -> Checkpoint:
    """A GGUF file (or a directory holding one), else a safetensors directory or hub id."""
    gguf_file = find_gguf_file(model_path)
    if gguf_file is not None:
        gguf = GGUFCheckpoint(gguf_file)
        return Checkpoint(gguf.model_dir, gguf)
    model_dir = resolve_model_dir(model_path, revision)
    return Checkpoint(model_dir, SafetensorsSource(model_dir))


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint's projections (`quantization.quantized_params`) are kept once
    loaded: float, quantized here per output channel (`quantize`: int8, w8a8_int8 or fp8),
    or as an FP8 checkpoint stores them (`fp8_block`: its [out, in] scale block)."""

    quantize: str | None = None
    fp8_block: tuple[int, int] | None = None

    @property
    def name(self) -> str | None:
        return "fp8" if self.fp8_block else self.quantize


def weight_format(hf_config: dict[str, Any], quantization: str | None, what: str
                  ) -> WeightFormat:
    """--quantization against the checkpoint's own `quantization_config`: a float checkpoint
    is quantized as asked; a block-wise FP8 one (Qwen's `*-FP8`) loads as it is stored."""
    stored = hf_config.get("quantization_config")
    if stored is None:
        return WeightFormat(quantize=quantization)
    method = stored.get("quant_method")
    block = stored.get("weight_block_size")
    if method != "fp8" or not block or stored.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"{what} is quantized with quantization_config {stored}; this "
            "version loads float checkpoints (--quantization int8, w8a8_int8 or fp8 stores "
            "them in 8 bits) and block-wise FP8 ones (quant_method fp8, weight_block_size, "
            "dynamic activations)")
    if quantization not in (None, "fp8"):
        raise CheckpointError(
            f"{what} is an FP8 checkpoint (blocks {block}); --quantization "
            f"{quantization} does not apply to it: leave --quantization out or pass fp8")
    return WeightFormat(fp8_block=(int(block[0]), int(block[1])))


@dataclass(frozen=True)
class LoadedModel:
    impl: ModelImpl
    config: ModelConfig
    params: dict[str, Any]
    model_dir: Path
    dtype: Any
    tp: TensorParallel  # the mesh the parameters are split over
    weights: WeightFormat = WeightFormat()  # how the projections are stored


def load_model(
    model_path: str, *, dtype: str = "auto", revision: str | None = None, progress: bool = True,
    tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedModel:
    """`tp`: the mesh to load onto, split by its rules (default: the first device);
    `quantization`: --quantization (see `weight_format`)."""
    checkpoint = open_checkpoint(model_path, revision)
    hf_config = read_hf_config(checkpoint.model_dir)
    impl = get_model_impl(hf_config)
    config = impl.config_from_hf(hf_config)
    jax_dtype = resolve_dtype(dtype, config.checkpoint_dtype)
    tp = tp or TensorParallel.of_size(1)
    specs = impl.hf_weight_specs(config, checkpoint.tensors.names())
    what = f"the model in {model_path!r}"
    weights = weight_format(hf_config, quantization, what)
    params = load_params(checkpoint.tensors, specs, jax_dtype,
                         progress=progress, tp=tp, config=config,
                         ignored_prefixes=impl.ignored_tensor_prefixes, what=what,
                         weights=weights)
    return LoadedModel(impl, config, params, checkpoint.model_dir, jax_dtype, tp, weights)


@dataclass(frozen=True)
class LoadedDraft:
    # An EAGLE3 or DFlash head, or the layers of an EAGLE or MTP head.
    config: Eagle3Config | DFlashConfig | ModelConfig
    params: dict[str, Any]
    model_dir: Path
    dtype: Any


def load_eagle3_draft(
    model_path: str, *, dtype: str = "auto", revision: str | None = None, progress: bool = True,
    tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedDraft:
    """An EAGLE3 draft head in any of the accepted tensor spellings."""
    model_dir = resolve_model_dir(model_path, revision)
    hf_config = read_hf_config(model_dir)
    if not llama_eagle3.is_eagle3_draft(hf_config):
        raise CheckpointError(
            f"{model_path!r} is not an EAGLE3 draft: its config.json says architectures="
            f"{hf_config.get('architectures')} with {hf_config.get('num_hidden_layers')} layers "
            "(expected LlamaForCausalLMEagle3, or a one-layer LlamaForCausalLM)"
        )
    config = llama_eagle3.config_from_hf(hf_config)
    source = SafetensorsSource(model_dir)
    specs = llama_eagle3.hf_weight_specs(config, source.names())
    jax_dtype = resolve_dtype(dtype, config.layer.checkpoint_dtype)
    what = f"the draft in {model_path!r}"
    params = load_params(source, specs, jax_dtype, progress=progress, tp=tp,
                         config=config.layer, ignored=llama_eagle3.TRAINING_ONLY_TENSORS,
                         what=what, weights=weight_format(hf_config, quantization, what))
    return LoadedDraft(config, params, model_dir, jax_dtype)


def load_eagle_draft(
    model_path: str, *, dtype: str = "auto", revision: str | None = None, progress: bool = True,
    tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedDraft:
    """An EAGLE (v1 / v2) draft head: fc [H, 2H] and Llama layers (see llama_eagle)."""
    model_dir = resolve_model_dir(model_path, revision)
    hf_config = read_hf_config(model_dir)
    source = SafetensorsSource(model_dir)
    names = source.names()
    if any("hidden_norm" in n for n in names):
        raise CheckpointError(f"{model_path!r} is not an EAGLE draft but an EAGLE3 one (it has "
                              "hidden_norm weights): use --speculative-algorithm EAGLE3")
    if not any(n.removeprefix("model.") == "fc.weight" for n in names):
        raise CheckpointError(f"{model_path!r} is not an EAGLE draft: it has no fc.weight")
    config = llama_eagle.config_from_hf(hf_config)
    specs, ignored = llama_eagle.hf_weight_specs(config, names)
    jax_dtype = resolve_dtype(dtype, config.checkpoint_dtype)
    what = f"the draft in {model_path!r}"
    params = load_params(source, specs, jax_dtype, progress=progress, tp=tp, config=config,
                         ignored=ignored, what=what,
                         weights=weight_format(hf_config, quantization, what))
    return LoadedDraft(config, params, model_dir, jax_dtype)


def load_dflash_draft(
    model_path: str, *, dtype: str = "auto", revision: str | None = None, progress: bool = True,
    tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedDraft:
    """A DFlash draft head in the z-lab / SpecForge layout (see models/dflash.py)."""
    return _load_block_draft(dflash, "DFlash", model_path, dtype=dtype, revision=revision,
                             progress=progress, tp=tp, quantization=quantization)


def load_dspark_draft(
    model_path: str, *, dtype: str = "auto", revision: str | None = None, progress: bool = True,
    tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedDraft:
    """A DSpark draft head in DeepSpec's layout (see models/dspark.py)."""
    return _load_block_draft(dspark, "DSpark", model_path, dtype=dtype, revision=revision,
                             progress=progress, tp=tp, quantization=quantization)


def _load_block_draft(module: Any, kind: str, model_path: str, *, dtype: str,
                      revision: str | None, progress: bool, tp: TensorParallel | None,
                      quantization: str | None) -> LoadedDraft:
    """A head of a DFlash backbone: `module` (models.dflash or models.dspark) reads its
    config and names its tensors."""
    model_dir = resolve_model_dir(model_path, revision)
    hf_config = read_hf_config(model_dir)
    if module.ARCHITECTURE not in (hf_config.get("architectures") or ()):
        raise CheckpointError(
            f"{model_path!r} is not a {kind} draft: its config.json says architectures="
            f"{hf_config.get('architectures')} (expected {module.ARCHITECTURE})")
    config = module.config_from_hf(hf_config)
    layer = config.layer if isinstance(config, DFlashConfig) else config.backbone.layer
    source = SafetensorsSource(model_dir)
    specs = module.hf_weight_specs(config, source.names())
    jax_dtype = resolve_dtype(dtype, layer.checkpoint_dtype)
    what = f"the {kind} draft in {model_path!r}"
    params = load_params(source, specs, jax_dtype, progress=progress, tp=tp, config=layer,
                         what=what, weights=weight_format(hf_config, quantization, what))
    return LoadedDraft(config, params, model_dir, jax_dtype)


def load_nextn_draft(
    model_path: str, target: ModelConfig, *, dtype: Any, revision: str | None = None,
    progress: bool = True, tp: TensorParallel | None = None, quantization: str | None = None,
) -> LoadedDraft:
    """A Qwen3-Next checkpoint's multi-token-prediction module (its `mtp.*` tensors, which
    loading the target leaves out), shaped by the target's config (qwen3_next_mtp)."""
    source = SafetensorsSource(resolve_model_dir(model_path, revision))
    names = source.names()
    if not qwen3_next_mtp.has_mtp(names):
        raise CheckpointError(
            f"{model_path!r} holds no multi-token-prediction module (no {qwen3_next_mtp.PREFIX}* "
            "tensors): NEXTN needs a checkpoint that ships one, as Qwen3-Next's and "
            "Qwen3-Coder-Next's do")
    config = qwen3_next_mtp.layer_config(target, names)
    specs = qwen3_next_mtp.hf_weight_specs(config, names)
    others = frozenset(n for n in names if not n.startswith(qwen3_next_mtp.PREFIX))
    what = f"the MTP module in {model_path!r}"
    params = load_params(source, specs, dtype, progress=progress, tp=tp, config=config,
                         ignored=others, what=what,
                         weights=weight_format(read_hf_config(source.model_dir), quantization,
                                               what))
    return LoadedDraft(config, params, source.model_dir, dtype)


def resolve_model_dir(model_path: str, revision: str | None = None) -> Path:
    """A local directory as is; otherwise a hub id fetched (or found in the cache)."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"model path {model_path!r} is a file, not a directory (nor a "
                                 ".gguf file)")
    if not _HUB_ID.match(model_path):
        raise FileNotFoundError(f"model directory {model_path!r} does not exist")
    return _download_from_hub(model_path, revision)


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=_HUB_FILES, local_files_only=offline
        )
    except Exception as exc:  # the hub raises many types; all mean "not obtainable"
        where = "in the local cache (HF_HUB_OFFLINE is set)" if offline else "on the hub"
        rev = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory and was not found {where}{rev}: {exc}"
        ) from exc
    return Path(path)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
    with open(path) as f:
        return json.load(f)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> Any:
    """'auto' keeps a 16-bit checkpoint's dtype on accelerators; CPUs always compute in float32."""
    if dtype not in DTYPE_CHOICES:
        choices = ", ".join(DTYPE_CHOICES)
        raise ValueError(f"dtype {dtype!r} is not supported; choose from {choices}")
    if dtype != "auto":
        return DTYPES[dtype]
    if jax.default_backend() == "cpu":
        return jnp.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return DTYPES[checkpoint_dtype]
    return jnp.bfloat16


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"shard {shard.name!r} listed in {index_path} is missing")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        others = sorted(p.name for p in model_dir.glob("*.bin")) or ["nothing"]
        raise FileNotFoundError(
            f"no *.safetensors files in {str(model_dir)!r} (found {', '.join(others)}); "
            "only safetensors checkpoints are supported"
        )
    files = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            files.update({name: shard for name in f.keys()})  # noqa: SIM118 (not a dict)
    return files


def load_params(
    source: TensorSource, specs: dict[str, WeightSpec], dtype: Any, *, config: ModelConfig,
    tp: TensorParallel | None = None, progress: bool = True,
    ignored: frozenset[str] = frozenset(), ignored_prefixes: tuple[str, ...] = (),
    what: str = "the model", weights: WeightFormat = WeightFormat(),
) -> dict[str, Any]:
    """`config`: the layers' shapes, checked against `tp` before any tensor is read;
    `ignored` / `ignored_prefixes`: tensors a checkpoint may hold that inference does not
    use (by name / by the start of their name); `weights`: how projections are kept."""
    tp = tp or TensorParallel.of_size(1)
    check_tensor_parallel(config, tp.size, what)
    all_names = source.names()
    scales = fp8_scale_specs(specs, all_names, weights.fp8_block, tp.size, what)
    names = [n for n in all_names
             if n in specs or n in scales or not (n.endswith(_IGNORED_SUFFIXES) or n in ignored
                                                  or n.startswith(ignored_prefixes))]
    _check_tensor_names([n for n in names if n not in scales], specs)
    names = [n for n in names if n in specs or n in scales]
    source.check(names, {**specs, **scales})
    host = _read_params(source, names, specs, scales, dtype, weights.fp8_block, progress)
    if weights.quantize:
        host = {path: quantize_param(path[-1], a, weights.quantize)
                if isinstance(a, np.ndarray) else a for path, a in host.items()}
    return _unflatten(tp.shard_params(host, head_dim=config.head_dim))


def _read_params(source: TensorSource, names: list[str], specs: dict[str, WeightSpec],
                 scales: dict[str, WeightSpec], dtype: Any, block: tuple[int, int] | None,
                 progress: bool) -> dict[tuple, Any]:
    """The checkpoint's tensors placed into host parameters by pytree path: float ones in
    `dtype`, FP8 ones (those with `scales`) as `QuantizedWeight`s of their stored bytes."""
    host: dict[tuple, Any] = {}
    block_scales: dict[tuple, np.ndarray] = {}
    with tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        scale_of = dict(source.read(list(scales)))  # small: read first, used as weights arrive
        bar.update(len(scales))
        for name, array in source.read([n for n in names if n not in scales]):
            scale = scale_of.pop(name + _FP8_SCALE_SUFFIX, None)
            if scale is None:
                _place(host, array, specs[name], dtype)
            else:
                _place_fp8(host, block_scales, array, scale, specs[name], block)
            bar.update()
    for path, scale in block_scales.items():
        host[path] = QuantizedWeight(host[path], scale, np.dtype(dtype))
    return host


def fp8_scale_specs(specs: dict[str, WeightSpec], names: list[str],
                    block: tuple[int, int] | None, tp_size: int, what: str
                    ) -> dict[str, WeightSpec]:
    """An FP8 checkpoint's block-scale tensors (X.weight_scale_inv beside X.weight), as
    specs of their shapes [ceil(out / block), ceil(in / block)]. A split of a projection's
    input features that cuts its blocks stops start-up here, before anything is read,
    naming the --tp-size values that work."""
    if block is None:
        return {}
    present = set(names)
    scales = {}
    for name, spec in specs.items():
        scale_name = name + _FP8_SCALE_SUFFIX
        if scale_name not in present:
            continue
        if len(spec.shape) != 2:
            raise CheckpointError(f"{what}: {name} has block scales but is not a matrix "
                                  f"(shape {list(spec.shape)})")
        rows, features = spec.shape
        scales[scale_name] = WeightSpec(spec.path, (-(-rows // block[0]),
                                                    -(-features // block[1])))
        if split_in_features(spec.path[-1]) and features % (block[1] * tp_size):
            usable = [t for t in range(1, len(jax.devices()) + 1) if features % (block[1] * t) == 0]
            raise CheckpointError(
                f"--tp-size {tp_size} splits the {features} input features of "
                f"{name} into {features // tp_size}-wide shards, which cut its FP8 scale blocks "
                f"of {block[1]}; --tp-size values that work with this checkpoint and the "
                f"{len(jax.devices())} device(s) here: {', '.join(map(str, usable))}")
    _check_one_format(scales, specs)
    return scales


class SafetensorsSource:
    """The tensors of a directory of safetensors files (sharded or not)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._files = checkpoint_files(model_dir)

    def names(self) -> list[str]:
        return list(self._files)

    def check(self, names: list[str], specs: dict[str, WeightSpec]) -> None:
        for path, file_names in self._by_file(names).items():
            _check_headers(path, file_names, specs)

    def read(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        for path, file_names in self._by_file(names).items():
            with safe_open(path, framework="numpy") as f:
                for name in file_names:
                    if f.get_slice(name).get_dtype() == _FP8_DTYPE:
                        yield name, _read_fp8(path, name)
                    else:
                        yield name, f.get_tensor(name)

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        return by_file


def _read_fp8(path: Path, name: str) -> np.ndarray:
    """An F8_E4M3 tensor straight from the file's bytes (safetensors' numpy reader has no
    FP8 type; ml_dtypes, which JAX uses, does)."""
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_size))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + header_size + start)
        data = np.frombuffer(f.read(end - start), dtype=jnp.float8_e4m3fn)
    return data.reshape(entry["shape"])


def _check_tensor_names(names: list[str], specs: dict[str, WeightSpec]) -> None:
    missing = sorted(set(specs) - set(names))
    # lm_head is only absent from specs when tied; some exporters still save a copy of it.
    unexpected = sorted(set(names) - set(specs) - {"lm_head.weight"})
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) the config requires: "
            f"{_listing(missing)}"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {_listing(unexpected)}"
        )


def _check_headers(path: Path, names: list[str], specs: dict[str, WeightSpec]) -> None:
    with safe_open(path, framework="numpy") as f:
        present = set(f.keys())  # noqa: SIM118 (not a dict)
        for name in names:
            if name not in present:
                raise CheckpointError(
                    f"tensor {name!r} is listed in the checkpoint index under {path.name!r}, "
                    "but that file does not contain it"
                )
            tensor = f.get_slice(name)
            shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
            if shape != specs[name].shape:
                raise CheckpointError(
                    f"tensor {name!r} in {path.name} has shape {list(shape)}, but the config "
                    f"implies {list(specs[name].shape)}"
                )
            if specs[name].integer:
                if dtype not in _INDEX_DTYPES:
                    raise CheckpointError(f"tensor {name!r} in {path.name} has dtype {dtype}; "
                                          "an integer index table was expected")
            elif dtype == _FP8_DTYPE and name + _FP8_SCALE_SUFFIX in specs:
                continue  # an FP8 checkpoint's projection, read with its block scales
            elif dtype not in _CHECKPOINT_DTYPES:
                raise CheckpointError(
                    f"tensor {name!r} in {path.name} has dtype {dtype}; only floating-point "
                    f"checkpoints ({', '.join(sorted(_CHECKPOINT_DTYPES))}) are supported"
                )


def _check_one_format(scales: dict[str, WeightSpec], specs: dict[str, WeightSpec]) -> None:
    """The parts of each fused parameter (q|k|v, gate|up, ...) all FP8 or all float."""
    fp8_paths = {spec.path for spec in scales.values()}
    fp8 = {name.removesuffix(_FP8_SCALE_SUFFIX) for name in scales}
    float_parts = [n for n, spec in specs.items() if spec.path in fp8_paths and n not in fp8]
    if float_parts:
        raise CheckpointError(
            f"{', '.join(float_parts[:4])} {'is' if len(float_parts) == 1 else 'are'} not FP8, "
            "but this version fuses them into one parameter with FP8 parts; a checkpoint "
            "quantizes all the parts of q|k|v, gate|up and in_proj or none")


def _place_fp8(host: dict[tuple, Any], block_scales: dict[tuple, np.ndarray],
               values: np.ndarray, scale: np.ndarray, spec: WeightSpec, block: tuple[int, int]
               ) -> None:
    """An FP8 weight [out, in] and its block scales [out / b0, in / b1] into the parameter's
    values and f32 scales [*out, in / b1] (each block's scale repeated over its rows)."""
    rows = np.repeat(scale.astype(np.float32), block[0], axis=0)[: spec.shape[0]]
    if spec.shape[1] % block[1]:
        raise CheckpointError(f"the FP8 weight of {'.'.join(map(str, spec.path))} has "
                              f"{spec.shape[1]} input features, not a multiple of its scale "
                              f"block {block[1]}")
    _place(host, values, spec, values.dtype)
    scale_spec = spec if spec.part is None else replace(spec, part=replace(
        spec.part, param_shape=(*spec.part.param_shape[:-1], rows.shape[1]),
        view=(*spec.part.view[:-1], rows.shape[1])))
    _place(block_scales, rows, replace(scale_spec, shape=rows.shape), np.float32)


def _place(host: dict[tuple, np.ndarray], array: np.ndarray, spec: WeightSpec, dtype: Any
           ) -> None:
    """Put a checkpoint tensor (converted to dtype) into its parameter, or into its part of a
    fused parameter, which is allocated when its first piece arrives."""
    array = array.astype(np.int32 if spec.integer else dtype, copy=False)
    if spec.part is None:
        host[spec.path] = array
        return
    if spec.path not in host:
        host[spec.path] = np.empty(spec.part.param_shape, array.dtype)
    spec.part.write(host[spec.path], array)


def _unflatten(flat: dict[tuple, jax.Array]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    num_layers = 1 + max((p[1] for p in flat if p[0] == "layers"), default=-1)
    if num_layers:
        tree["layers"] = [{} for _ in range(num_layers)]
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:  # layer indices, then names of nested dicts (made on first use)
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
