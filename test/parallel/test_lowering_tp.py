"""TPU and GPU readiness at --tp-size 4: every program a TP-4 Engine compiles at its
accelerator warm-up lowers for TPU and for CUDA (bfloat16, the `fa` backend's Pallas kernel of
each platform run per device on its own heads under shard_map) as one SPMD module over 4
devices, with a dense target, an EAGLE3 draft, and the hybrid Qwen3-Next with its own MTP
layer (NEXTN: Gated DeltaNet state split by key head); and with 8-bit weights (w8a8_int8
over FP8 pages with EAGLE3, and a block-wise FP8 checkpoint).

The mesh is the engine's own, of 4 CPU devices (a subprocess started with
--xla_force_host_platform_device_count=4): JAX lowers a program whose arguments are sharded
over CPU devices for another platform (`Traced.lower(lowering_platforms=("tpu",))`), the
devices appearing only as the module's partition count and sharding annotations, so no
AbstractMesh is needed. What is checked is the lowering (Pallas -> Mosaic / Triton, the SPMD
annotations); compiling for the chip (XLA's partitioner, Mosaic's and Triton's backends)
needs the chip."""

import json
import subprocess
import sys
from pathlib import Path

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.fp8 import write_fp8_checkpoint
from sgl_jax.testing.mtp import write_mtp_tensors
from sgl_jax.testing.parallel import cpu_devices_env, write_tp_checkpoints

TP = 4
SETTINGS = dict(tp_size=TP, precompile_token_paddings=[16], precompile_bs_paddings=[2],
                max_prefill_tokens=16, chunked_prefill_size=16, max_total_tokens=256)
TREE = dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
# What the 8-bit cases' programs must take: the weights' and the pages' stored dtypes.
STORED_DTYPES = {"EAGLE3-w8a8-fp8kv": ("int8", "float8_e4m3fn"),
                 "plain-fp8-checkpoint": ("float8_e4m3fn",)}


def cases(root: Path) -> dict:
    """name: the target and the Engine's arguments. Another case (a drafter, a weight format,
    a page dtype) is one more entry."""
    llama, eagle3 = write_tp_checkpoints(root, "llama")  # 8 heads, 2 KV heads (copied to 4)
    qwen3_next = write_tiny_checkpoint(root / "qwen3_next", "qwen3_next")
    write_mtp_tensors(qwen3_next)
    # Blocks of 16: each device's 32 input features of o_proj / down_proj hold two.
    fp8_llama, _ = write_fp8_checkpoint(llama, root / "llama-fp8", root / "llama-dequantized",
                                        block=(16, 16))
    eagle3_round = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(eagle3),
                        **TREE)
    return {  # a plain bf16 engine's programs: EAGLE3's target step, the fp8 case's others
        # per-request lengths add the packed round of the chain 2/1/3
        "EAGLE3": (llama, {**eagle3_round, "speculative_per_request_lengths": True}),
        "NEXTN": (qwen3_next, dict(speculative_algorithm="NEXTN", **TREE)),
        # Per-row int8 weights (the draft's too) with int8 inputs split by device, FP8 pages.
        "EAGLE3-w8a8-fp8kv": (llama, dict(quantization="w8a8_int8", kv_cache_dtype="fp8_e4m3",
                                          **eagle3_round)),
        # Block scales split with their blocks, dequantized inside the step.
        "plain-fp8-checkpoint": (fp8_llama, {}),
    }


def test_every_tp4_program_lowers_for_tpu_and_cuda(tmp_path):
    arg = {name: {"model_path": str(target), "engine": {**SETTINGS, **engine}}
           for name, (target, engine) in cases(tmp_path).items()}
    out = tmp_path / "lowered.json"
    completed = subprocess.run(
        [sys.executable, "-m", "sgl_jax.testing.lowering", "--cases", json.dumps(arg),
         "--out", str(out)], env=cpu_devices_env(TP), capture_output=True, text=True,
        timeout=900)
    assert completed.returncode == 0, completed.stderr[-6000:]
    for name, result in json.loads(out.read_text()).items():
        outcomes = result["outcomes"]
        assert outcomes, name
        failed = [f"{o['program']} for {o['platform']}:\n{o['error']}" for o in outcomes
                  if o["error"]]
        assert not failed, f"{name}:\n" + "\n\n".join(failed)
        assert not result["resharded"], (name, result["resharded"])
        assert set(STORED_DTYPES.get(name, ())) <= set(result["argument_dtypes"]), name
        assert {o["partitions"] for o in outcomes} == {TP}, name
        forwards = [o for o in outcomes if o["function"] in (
            "ModelRunner._sampling_step_impl", "SpecRunner._round_impl")]
        assert forwards and all(o["kernel_calls"] for o in forwards), name
