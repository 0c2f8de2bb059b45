"""GGUF checkpoints (llama.cpp's single-file format) for Llama, Qwen2 and Qwen3.

A GGUF file carries the config, the tokenizer and the chat template as metadata and the
weights as (often quantized) tensors under llama.cpp's names. The first load reads the
metadata with the `gguf` library and writes, into the user cache, a Hugging Face directory
(config.json, generation_config.json, the tokenizer) plus a table of the tensors (name, type,
shape, offset in the file), so the rest of the project reads the model as it reads any, and
later loads skip parsing the metadata (1.6 s for a 49k-token vocabulary). Tensors are sliced
from a memory map of the file and dequantized with `gguf.quants`, renamed to the Hugging Face
names the architectures expect, and Llama's q/k rows are put back in the order the converter
permuted them out of. For a model whose float32 tensors fit in `_KEPT_LIMIT` the first load
also keeps them, dequantized, beside the metadata (`_KeptTensors`): later loads map that file
instead of dequantizing (about a second of a start for the demo model on a 2-core CPU).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sgl_jax.cache import user_cache_dir
from sgl_jax.layers.weights import WeightSpec
from sgl_jax.version import __version__

logger = logging.getLogger(__name__)

# GGUF's general.architecture -> the Hugging Face architecture that implements it here.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# Tensor types dequantized here; others (IQ*, TQ*, ...) are refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                   "Q4_K", "Q5_K", "Q6_K")
# Bumped when the files written into the cache change.
_METADATA_FORMAT = 2

# llama.cpp tensor name -> Hugging Face name ("{i}" is the layer).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
    ) for kind in ("weight", "bias")},
}
_TENSOR_TABLE = "gguf_tensors.json"
_READ_AHEAD = 4  # dequantized tensors waiting for the loader at most
# The dequantized copy a load keeps for the next (_KeptTensors): float32 tensors back to
# back, and their index (written last: a copy without one is incomplete and ignored).
_KEPT_TENSORS, _KEPT_INDEX = "dequantized.f32", "dequantized.json"
_KEPT_LIMIT = 2 << 30  # bytes; a larger model dequantizes at every load instead
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
# Buffers that carry no learned weights: llama3 rope factors become rope_scaling instead.
_METADATA_TENSORS = ("rope_freqs.weight",)


class GGUFError(ValueError):
    """A GGUF file this project cannot serve; the message names what and why."""


def find_gguf_file(model_path: str | Path) -> Path | None:
    """`model_path` if it is a .gguf file, the one .gguf in a directory without config.json,
    else None (not a GGUF checkpoint)."""
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"{str(path)!r} holds {len(found)} GGUF files ({names}); pass the "
                        "path of the one to serve")
    return found[0] if found else None


class GGUFCheckpoint:
    """The tensors of one GGUF file under Hugging Face names (a loader TensorSource); its
    metadata, converted once, lives in `model_dir`."""

    def __init__(self, path: Path):
        self.path = path
        self.model_dir = metadata_dir(path)
        if not (self.model_dir / _TENSOR_TABLE).is_file():
            _GGUFMetadata(path).write(self.model_dir)
        self.config = json.loads((self.model_dir / "config.json").read_text())
        self.arch = self.config["model_type"]
        self._table = json.loads((self.model_dir / _TENSOR_TABLE).read_text())
        self._file = np.memmap(path, np.uint8, mode="r")

    def names(self) -> list[str]:
        return list(self._table)

    def check(self, names: list[str], specs: dict[str, WeightSpec]) -> None:
        for name in names:
            entry = self._table[name]
            if entry["type"] not in SUPPORTED_TYPES:
                raise GGUFError(f"tensor {entry['name']!r} of {self.path.name} is stored as "
                                f"{entry['type']}, which is not supported; supported GGUF "
                                f"types: {', '.join(SUPPORTED_TYPES)}")
            if tuple(entry["shape"]) != specs[name].shape:
                raise GGUFError(f"tensor {entry['name']!r} of {self.path.name} has shape "
                                f"{entry['shape']}, but its metadata implies "
                                f"{list(specs[name].shape)}")

    def read(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """The tensors `names` in order, dequantized: from the copy an earlier load kept
        when it has them all (read-only views of a memory map), else from the file (and
        kept, when they fit in `_KEPT_LIMIT`)."""
        if not names:
            return
        kept = _KeptTensors(self.model_dir)
        if kept.has(names):
            yield from ((name, kept.tensor(name)) for name in names)
            return
        total = sum(4 * int(np.prod(self._table[name]["shape"])) for name in names)
        if total > _KEPT_LIMIT:
            yield from self._dequantize(names)
            return
        writer = _KeptWriter(self.model_dir)
        try:
            for name, array in self._dequantize(names):
                writer.keep(name, array)
                yield name, array
            writer.publish()
        finally:
            writer.discard()

    def _dequantize(self, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        """Dequantized in order, two tensors at a time (numpy lets go of the GIL), at most
        `_READ_AHEAD` of them waiting, so a large model never sits in host memory whole."""
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="gguf") as pool:
            pending: collections.deque = collections.deque()
            for name in names:
                pending.append(pool.submit(self._dequantized, name))
                if len(pending) > _READ_AHEAD:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _dequantized(self, name: str) -> tuple[str, np.ndarray]:
        from gguf import GGMLQuantizationType, quants

        entry = self._table[name]
        raw = self._file[entry["offset"]:entry["offset"] + entry["bytes"]]
        # One row: the library dequantizes 16 rows at a time, which for small rows costs
        # more in numpy calls than in arithmetic.
        array = quants.dequantize(raw.reshape(1, -1), GGMLQuantizationType[entry["type"]])
        return name, self._unpermute(name, array.reshape(entry["shape"]))

    def _unpermute(self, name: str, array: np.ndarray) -> np.ndarray:
        """llama.cpp's converter reorders Llama's q/k rows within each head from rotate-half
        pairs (i, i + d/2) to interleaved ones (2i, 2i + 1); undo it."""
        if self.arch != "llama":
            return array
        if ".self_attn.q_proj." in name:
            return unpermute_rows(array, self.config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_rows(array, self.config["num_key_value_heads"])
        return array


class _KeptTensors:
    """Dequantized tensors an earlier load kept in `directory` (the file's metadata
    directory, keyed by its path, size and modification time): float32, whatever the
    file stored (every GGUF type dequantizes exactly into it)."""

    def __init__(self, directory: Path):
        self._directory = directory
        index = directory / _KEPT_INDEX
        self._index: dict[str, list] = json.loads(index.read_text()) if index.is_file() else {}
        self._values: np.ndarray | None = None

    def has(self, names: list[str]) -> bool:
        return (all(name in self._index for name in names)
                and (self._directory / _KEPT_TENSORS).is_file())

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of the kept file (mapped once, on the first tensor read)."""
        if self._values is None:
            self._values = np.memmap(self._directory / _KEPT_TENSORS, np.float32, mode="r")
        offset, shape = self._index[name]
        return self._values[offset:offset + int(np.prod(shape))].reshape(shape)


class _KeptWriter:
    """Writes a _KeptTensors copy as the tensors arrive. It is published (renamed into
    place, the index last) only once the load read every tensor; a copy that cannot be
    written (a full disk, a read-only cache) is given up with a warning, the load goes on."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._partial = directory / f"{_KEPT_TENSORS}.{os.getpid()}.partial"
        self._index: dict[str, list] = {}
        self._offset = 0
        self._out: BinaryIO | None = None
        try:
            self._out = self._partial.open("wb")
        except OSError as error:
            self._give_up(error)

    def keep(self, name: str, array: np.ndarray) -> None:
        if self._out is None:
            return
        values = np.ascontiguousarray(array, np.float32)
        try:
            self._out.write(values.data)
        except OSError as error:
            self._give_up(error)
            return
        self._index[name] = [self._offset, list(values.shape)]
        self._offset += values.size

    def publish(self) -> None:
        if self._out is None:
            return
        index = self._partial.with_suffix(".json")
        try:
            self._out.close()
            os.replace(self._partial, self._directory / _KEPT_TENSORS)
            index.write_text(json.dumps(self._index))
            os.replace(index, self._directory / _KEPT_INDEX)
        except OSError as error:
            self._give_up(error)
        self._out = None

    def discard(self) -> None:
        """Remove what was not published (after publish: nothing left)."""
        if self._out is not None:
            self._out.close()
            self._out = None
        for leftover in (self._partial, self._partial.with_suffix(".json")):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)

    def _give_up(self, error: OSError) -> None:
        logger.warning("Not keeping the dequantized weights in %s: %s", self._directory, error)
        self.discard()


class _GGUFMetadata:
    """What a GGUF file's header says, read with the `gguf` library (once per file)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        try:
            self._reader = GGUFReader(str(path))
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"GGUF architecture {self.arch!r} in {path.name} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)}")
        self._tensors = {_hf_name(t.name): t for t in self._reader.tensors
                         if t.name not in _METADATA_TENSORS}

    def write(self, target: Path) -> None:
        """config.json, generation_config.json, the tokenizer and the tensor table."""
        logger.info("Converting the tokenizer and config of %s (once; cached in %s)",
                    self.path.name, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the target and renamed, so a crash never leaves half a directory.
        staging = Path(tempfile.mkdtemp(dir=target.parent))
        config = self.hf_config()
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", {
            k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None})
        self._tokenizer().save_pretrained(str(staging))
        _write_json(staging / _TENSOR_TABLE, self.tensor_table())
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)

    def tensor_table(self) -> dict[str, dict[str, Any]]:
        """Per Hugging Face name: the GGUF name, type, [out, in] shape and byte span."""
        return {name: {"name": t.name, "type": t.tensor_type.name,
                       "shape": [int(d) for d in reversed(t.shape)],
                       "offset": int(t.data_offset), "bytes": int(t.n_bytes)}
                for name, t in self._tensors.items()}

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The config.json a Hugging Face export of this model would have."""
        heads = self._arch_field("attention.head_count")
        hidden = self._arch_field("embedding_length")
        vocab = self._arch_field("vocab_size") or len(self._field("tokenizer.ggml.tokens", []))
        head_dim = self._arch_field("attention.key_length",
                                    self._arch_field("rope.dimension_count", hidden // heads))
        config = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"),
            "num_hidden_layers": self._arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch_field("rope.freq_base", 10000.0),
            "max_position_embeddings": self._arch_field("context_length", 4096),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.o_proj.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": self._stored_dtype(),
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling:
            config["rope_scaling"] = rope_scaling
        return config

    def _stored_dtype(self) -> str | None:
        """The float dtype the matrices are stored in, or None when quantized or mixed."""
        kinds = {t.tensor_type.name for t in self._tensors.values() if len(t.shape) > 1}
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(
            kinds.pop() if len(kinds) == 1 else "")

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type")
        factor = self._arch_field("rope.scaling.factor")
        if kind == "linear" and factor:
            return {"rope_type": "linear", "factor": float(factor)}
        if kind not in (None, "none"):
            raise GGUFError(f"rope scaling {kind!r} in {self.path.name} is not supported")
        freqs = next((t for t in self._reader.tensors if t.name in _METADATA_TENSORS), None)
        return None if freqs is None else self._llama3_rope(np.asarray(freqs.data, np.float64))

    def _llama3_rope(self, divisors: np.ndarray) -> dict[str, Any]:
        """llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors (rope_freqs);
        recover the llama3 parameters and check they give back every divisor."""
        scaling = {
            "rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings":
                int(self._arch_field("rope.scaling.original_context_length", 8192)),
        }
        head_dim = 2 * len(divisors)
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        if not np.allclose(llama3_rope_divisors(theta, head_dim, scaling), divisors, rtol=1e-3):
            raise GGUFError(f"the rope_freqs tensor of {self.path.name} is not llama3 rope "
                            "scaling with low/high frequency factors 1 and 4; not supported")
        return scaling

    def _tokenizer(self):
        """Built with transformers' GGUF vocabulary converter, from the fields read here:
        its own GGUF entry point reads files through torch, which serving does not need."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        fields = {key.removeprefix("tokenizer."): self._field(key)
                  for key in self._reader.fields if key.startswith("tokenizer.")}
        vocabulary, settings = ({name: fields[key] for key, name in renames.items()
                                 if key in fields}
                                for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"],
                                                GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
        if vocabulary.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece
            settings.setdefault("add_bos_token", True)
        for role in ("bos", "eos", "unknown", "padding"):
            token_id = fields.get(f"ggml.{role}_token_id")
            name = {"unknown": "unk", "padding": "pad"}.get(role, role) + "_token"
            settings[name] = None if token_id is None else vocabulary["tokens"][token_id]
        try:
            backend, extra = convert_gguf_tokenizer(self.arch, vocabulary)
        except (ValueError, KeyError) as exc:
            raise GGUFError(f"cannot build a tokenizer from the metadata of {self.path.name}: "
                            f"{exc}") from exc
        return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: rows [heads * head_dim, ...] (or a bias)."""
    shape = weight.shape
    half = shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (what its converter writes)."""
    shape = weight.shape
    half = shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_divisors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling (f64[head_dim / 2]), as llama.cpp
    stores them in rope_freqs."""
    freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelengths = 2 * np.pi / freqs
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = np.clip((original / wavelengths - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / scaling["factor"] + smooth)


def is_metadata_dir(path: str | Path) -> bool:
    """Whether `path` is a directory of converted metadata written here (metadata_dir)."""
    return (Path(path) / _TENSOR_TABLE).is_file()


def metadata_dir(path: Path) -> Path:
    """Where the converted metadata of this exact file (path, size, mtime) is cached."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_METADATA_FORMAT}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return user_cache_dir() / "gguf" / f"{path.stem}-{digest}-{__version__}"


def _hf_name(name: str) -> str:
    """A llama.cpp tensor name in Hugging Face spelling; unknown names stay as they are, so
    the loader reports them as unexpected."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return name


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
