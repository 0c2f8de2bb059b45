"""Block-quantized FP8 copies of tiny checkpoints, written the way Qwen's `*-FP8` checkpoints
are: every projection matrix (`*proj*.weight` of the decoder layers and of an MTP module)
stored as F8_E4M3 with `weight_scale_inv` [ceil(out / b0), ceil(in / b1)] beside it (the
scale that multiplies each block back), everything else as it was, and config.json's
`quantization_config` {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [b0, b1]}. Also the dequantized float32 copy, the oracle's checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

FP8_MAX = 448.0  # e4m3's largest finite magnitude


def is_projection(name: str, tensor: np.ndarray) -> bool:
    """A layer's linear map (q_proj, down_proj, in_proj_qkvz, out_proj, ...): FP8 in Qwen's
    checkpoints, where token tables, norms, routers and gates stay in bfloat16."""
    parts = name.split(".")
    return tensor.ndim == 2 and parts[-1] == "weight" and "proj" in parts[-2]


def quantize_blocks(weight: np.ndarray, block: tuple[int, int]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """weight f32[out, in] -> (e4m3 values [out, in], f32 scales [ceil(out/b0), ceil(in/b1)])
    with each block's largest magnitude at FP8_MAX."""
    rows, cols = weight.shape
    b0, b1 = block
    scales = np.ones((-(-rows // b0), -(-cols // b1)), np.float32)
    values = np.empty(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].astype(np.float32)
            amax = float(np.abs(part).max())
            scales[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            values[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (
                part / scales[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return values, scales


def dequantize_blocks(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]
                      ) -> np.ndarray:
    rows, cols = values.shape
    full = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return values.astype(np.float32) * full


def write_fp8_checkpoint(source: str | Path, fp8_dir: str | Path, dequantized_dir: str | Path,
                         *, block: tuple[int, int] = (128, 128)) -> tuple[Path, Path]:
    """The checkpoint in `source` block-quantized into `fp8_dir`, and what those FP8 values
    mean (values x scales, float32) into `dequantized_dir`; returns both paths."""
    source, fp8_dir, dequantized_dir = Path(source), Path(fp8_dir), Path(dequantized_dir)
    for target in (fp8_dir, dequantized_dir):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors",
                                                                     "*.index.json"))
    scale_names = set()
    for shard in sorted(source.glob("*.safetensors")):
        stored, plain = {}, {}
        for name, tensor in load_file(shard).items():
            if is_projection(name, tensor):
                values, scales = quantize_blocks(tensor, block)
                stored[name], stored[name + "_scale_inv"] = values, scales
                scale_names.add(name + "_scale_inv")
                plain[name] = dequantize_blocks(values, scales, block)
            else:
                stored[name] = plain[name] = tensor
        save_file(stored, str(fp8_dir / shard.name), metadata={"format": "pt"})
        save_file(plain, str(dequantized_dir / shard.name), metadata={"format": "pt"})
    index = source / "model.safetensors.index.json"
    if index.is_file():
        listing = json.loads(index.read_text())
        shutil.copy(index, dequantized_dir / index.name)
        weight_map = listing["weight_map"]
        weight_map.update({f"{name}_scale_inv": file for name, file in list(weight_map.items())
                           if f"{name}_scale_inv" in scale_names})
        (fp8_dir / index.name).write_text(json.dumps(listing, indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, dequantized_dir
