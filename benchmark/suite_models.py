"""Random checkpoints for benchmark/gpu_suite.sh, written once and reused while they match.

    python benchmark/suite_models.py llama8b DIR          # DIR/llama8b and DIR/llama8b_eagle3
    python benchmark/suite_models.py llama8b DIR --tiny   # the same layout at a CPU's size
    python benchmark/suite_models.py smollm2 DIR          # DIR/smollm2_shape

`llama8b`: Llama-3.1-8B's shape (hidden 4096, 32 layers, 14336 intermediate, 32/8 heads,
vocabulary 128256) in bfloat16, each matrix filled from one random block (written at disk
speed: timings do not depend on the values), and an EAGLE3 head of the published shape for
it (one layer, 32/8 heads, 14336 intermediate, a 32000-token draft vocabulary), random.
`--tiny`: hidden 256, 4 layers (EAGLE3 reads three), vocabulary 1024, a head to match, for
a check on a CPU.
`smollm2`: the demo model's shape (SmolLM2-135M: hidden 576, 30 layers, 9/3 heads, 1536
intermediate, vocabulary 49152, tied embeddings), random, float32: the demo's step cost
where the demo itself is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import sgl_jax  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft

LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=8192, rope_theta=500000.0)
LLAMA8B_HEAD = dict(num_heads=32, num_kv_heads=8, intermediate_size=14336,
                    draft_vocab_size=32000)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=1024,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rope_theta=500000.0)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)
TINY_HEAD = dict(num_heads=4, num_kv_heads=2, intermediate_size=512, draft_vocab_size=512)
DTYPE = "bfloat16"


def write_llama8b(directory: Path, tiny: bool) -> tuple[Path, Path]:
    """(target, EAGLE3 head) under `directory`, written unless already there as wanted."""
    shape, head = (TINY, TINY_HEAD) if tiny else (LLAMA8B, LLAMA8B_HEAD)
    target, draft = directory / "llama8b", directory / "llama8b_eagle3"
    if not _holds(target, {k: v for k, v in shape.items() if k != "rope_theta"},
                  dtype=DTYPE):
        print(f"writing {target}", flush=True)
        write_tiny_checkpoint(target, "llama", dtype=DTYPE, backend="numpy",
                              repeat_block=1 << 24, **shape)
    if not _holds(draft, {"hidden_size": shape["hidden_size"],
                          "draft_vocab_size": head["draft_vocab_size"]}):
        print(f"writing {draft}", flush=True)
        write_tiny_eagle3_draft(draft, json.loads((target / "config.json").read_text()), **head)
    return target, draft


def write_smollm2_shape(directory: Path) -> Path:
    target = directory / "smollm2_shape"
    if not _holds(target, {k: v for k, v in SMOLLM2.items() if k != "rope_theta"},
                  dtype="float32"):
        print(f"writing {target}", flush=True)
        write_tiny_checkpoint(target, "llama", dtype="float32", backend="numpy",
                              repeat_block=1 << 22, **SMOLLM2)
    return target


def _holds(path: Path, wanted: dict, dtype: str | None = None) -> bool:
    config = path / "config.json"
    if not config.is_file() or not list(path.glob("*.safetensors")):
        return False
    found = json.loads(config.read_text())
    if dtype is not None and found.get("dtype", found.get("torch_dtype")) != dtype:
        return False
    return all(found.get(key) == value for key, value in wanted.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["llama8b", "smollm2"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a CPU's size, same layout")
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        write_smollm2_shape(args.directory)
    else:
        write_llama8b(args.directory, args.tiny)


if __name__ == "__main__":
    main()
