"""The pieces of tensor parallelism that need no device mesh: KV-head copies, the sizes a
model can be split by, the mesh's limits, and the channel that carries rank 0's steps."""

import subprocess
import sys
import threading

import numpy as np
import pytest

from sgl_jax.layers.rotary import RopeConfig
from sgl_jax.models.config import ModelConfig, tensor_parallel_problems
from sgl_jax.parallel import make_mesh
from sgl_jax.parallel.multihost import (
    Mirrored,
    StepReceiver,
    StepSender,
    device_call,
    follow,
)
from sgl_jax.parallel.sharding import copy_kv_heads
from sgl_jax.testing.parallel import cpu_devices_env
from sgl_jax.testing.server import free_port


def config(heads=8, kv_heads=2, intermediate=128) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 512, 64, intermediate, 2, heads, kv_heads, 16, 1e-6,
                       RopeConfig(), 512, False)


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 1, 8), (8, 2, 4), (8, 2, 8), (16, 4, 8)])
def test_copied_kv_heads_serve_the_q_heads_that_read_them(heads, kv_heads, tp):
    hd, width = 4, 3
    rng = np.random.default_rng(0)
    q = rng.standard_normal((heads, hd, width))
    k, v = rng.standard_normal((2, kv_heads, hd, width))
    per_group = heads // kv_heads
    fused = np.concatenate([q.reshape(kv_heads, per_group * hd, width), k, v], axis=1)
    copied = copy_kv_heads(fused, tp // kv_heads, hd)  # [tp, (heads/tp + 2) * hd, width]
    assert copied.shape == (tp, (heads // tp + 2) * hd, width)
    q_per_device = heads // tp
    for device in range(tp):
        q_heads = range(device * q_per_device, (device + 1) * q_per_device)
        kv_head = q_heads[0] // per_group  # GQA: q head h reads KV head h // (heads / kv)
        assert all(h // per_group == kv_head for h in q_heads)
        np.testing.assert_array_equal(copied[device, : q_per_device * hd],
                                      q[list(q_heads)].reshape(-1, width))
        np.testing.assert_array_equal(copied[device, -2 * hd : -hd], k[kv_head])
        np.testing.assert_array_equal(copied[device, -hd:], v[kv_head])


@pytest.mark.parametrize("model, tp, problems", [
    (config(), 8, []),
    (config(kv_heads=1), 8, []),
    (config(heads=4), 8, ["4 attention heads do not divide by 8"]),
    (config(heads=12, kv_heads=3), 4, ["3 KV heads neither divide by 4 nor divide 4"]),
    (config(intermediate=100), 8, ["intermediate size 100 does not divide by 8"]),
])
def test_tensor_parallel_problems_name_what_does_not_divide(model, tp, problems):
    assert tensor_parallel_problems(model, tp) == problems


def test_a_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(ValueError, match="--tp-size 2 needs 2 devices, but JAX sees 1 cpu "
                                         "device.*xla_force_host_platform_device_count"):
        make_mesh(2)


def test_the_engine_refuses_a_tp_size_the_model_cannot_use(tmp_path):
    from sgl_jax.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "llama", "llama")  # 4 heads, 2 KV heads
    script = (f"from sgl_jax import Engine\nEngine(model_path={str(model)!r}, tp_size=8, "
              "max_total_tokens=256)")
    result = subprocess.run([sys.executable, "-c", script], env=cpu_devices_env(8),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert ("ValueError: --tp-size 8 cannot split the model in" in result.stderr
            and "4 attention heads do not divide by 8" in result.stderr
            and "Sizes that work with the 8 device(s) here: 1, 2, 4" in result.stderr)


class Recorder:
    def __init__(self):
        self.calls = []

    @device_call
    def step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return len(self.calls)

    def untouched(self):
        return "local only"

    @device_call
    def fails(self):
        raise RuntimeError("a step that fails on every rank")


def test_rank0_calls_reach_every_follower_in_order():
    address = ("127.0.0.1", free_port())
    followers = [Recorder(), Recorder()]
    counts = []

    def run_follower(recorder):
        receiver = StepReceiver(address, timeout=30)
        counts.append(follow(receiver, {"runner": recorder}))
        receiver.close()

    threads = [threading.Thread(target=run_follower, args=(r,)) for r in followers]
    for thread in threads:
        thread.start()
    sender = StepSender(address, num_followers=2, timeout=30)
    leader = Recorder()
    mirrored = Mirrored(leader, "runner", sender)
    big = np.arange(300_000, dtype=np.int32)  # larger than one socket read
    assert mirrored.step([1, 2], flag=True) == 1
    with pytest.raises(RuntimeError):  # rank 0 fails the step's requests and goes on ...
        mirrored.fails()
    assert mirrored.step(big) == 2  # ... and so do the followers
    assert mirrored.untouched() == "local only"
    sender.close()
    for thread in threads:
        thread.join(timeout=30)
    assert counts == [3, 3]
    for recorder in [leader, *followers]:
        assert recorder.calls[0] == (([1, 2],), {"flag": True})
        np.testing.assert_array_equal(recorder.calls[1][0][0], big)
