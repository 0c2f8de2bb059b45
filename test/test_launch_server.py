"""The launcher's first-run behaviour: bad values are one `cannot start:` line with exit status
2, and start-up logs no dependency noise that reads like an error."""

import logging
import os
import subprocess
import sys

import pytest

from sgl_jax import launch_server
from sgl_jax.entrypoints import router
from sgl_jax.server_args import ServerArgs
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import launch_server as start_server

BAD_VALUES = [
    (["--model-path", "m", "--speculative-algorithm", "EAGLE3"],
     "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
      "--speculative-num-draft-tokens", "8", "--speculative-eagle-topk", "1"],
     "must be num_steps + 1"),
    (["--page-size", "0"], "page_size must be >= 1, got 0"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
      "--speculative-accept-threshold-acc", "0"], "speculative_accept_threshold_acc"),
    (["--dp-size", "0"], "dp_size must be >= 1, got 0"),
    (["--dp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--dp-size 3 replicas do not split evenly over --nnodes 2"),
    (["--dp-size", "2", "--device", "tpu"], "--dp-size on TPU is not supported"),
    (["--dp-size", "2", "--tp-size", "2", "--device", "gpu"], "needs 4 GPUs"),
]
TORCH_MESSAGE = "PyTorch was not found"
TPU_MESSAGE = "Unable to initialize backend 'tpu'"


@pytest.mark.parametrize("argv, message", BAD_VALUES)
def test_a_bad_value_is_one_cannot_start_line(argv, message, caplog):
    caplog.set_level(logging.ERROR)
    assert launch_server.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("cannot start: ")
    assert message in errors[0]


def test_dp_size_without_the_router_names_the_extra(caplog, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "sglang_router"
                        else find_spec(name, *rest))
    caplog.set_level(logging.ERROR)
    assert launch_server.main(["--dp-size", "2"]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error == ("cannot start: --dp-size needs SGLang's router, which is not installed: "
                     'pip install "sgl-jax[router]"')


def test_replicas_get_the_flags_but_the_launchers_and_their_nodes_own_gpus(monkeypatch):
    argv = ["--model-path", "m", "--dp-size", "2", "--port=30000", "--tp", "2", "--host",
            "0.0.0.0", "--router-policy=random", "--nnodes", "2", "--node-rank=1",
            "--dist-init-addr", "10.0.0.1:5000", "--dtype", "float32",
            "--router-request-timeout-secs", "60", "--router-cb-timeout-duration-secs=5"]
    assert router.replica_argv(argv) == ["--model-path", "m", "--tp", "2", "--dtype",
                                         "float32"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    args = ServerArgs(dp_size=2, tp_size=2, device="gpu")
    assert router.replica_device_envs(args) == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert router.replica_device_envs(ServerArgs(dp_size=3, device="cpu")) == [{}] * 3
    over_two_nodes = ServerArgs(dp_size=4, tp_size=2, device="gpu", nnodes=2, node_rank=1,
                                dist_init_addr="10.0.0.1:5000")  # 2 replicas on each node
    assert router.replica_device_envs(over_two_nodes) == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                          {"CUDA_VISIBLE_DEVICES": "6,7"}]


def test_a_bad_value_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "sgl_jax.launch_server", "--page-size", "0",
                             "--log-level", "warning"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot start: page_size must be >= 1, got 0" in lines[0]


def hide_packages(tmp_path, *names: str) -> dict[str, str]:
    """An environment whose Python cannot import `names`, as if they were not installed."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in names))
    paths = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def test_the_noise_is_there_without_sgl_jax(tmp_path):
    """The check below would see both messages: transformers and JAX print them by default."""
    code = ("import logging; logging.basicConfig(level='INFO'); import transformers; "
            "import jax; jax.devices()")
    result = subprocess.run([sys.executable, "-c", code], env=hide_packages(tmp_path, "torch"),
                            capture_output=True, text=True, timeout=120, check=True)
    assert TORCH_MESSAGE in result.stderr and TPU_MESSAGE in result.stderr


def test_server_start_logs_no_torch_or_tpu_probe_noise(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "model", "qwen3")
    flags = ["--model-path", str(model_dir), "--dtype", "float32", "--skip-server-warmup",
             "--precompile-token-paddings", "64", "--precompile-bs-paddings", "1",
             "--context-length", "128"]
    with start_server(flags, env=hide_packages(tmp_path, "torch")) as server:
        log = server.log()
    assert "Engine ready" in log
    assert TORCH_MESSAGE not in log and TPU_MESSAGE not in log


def test_the_noise_filters_keep_every_other_record(caplog):
    import sgl_jax  # noqa: F401  (installs the filters)

    caplog.set_level(logging.INFO)
    logging.getLogger("transformers").warning("%s. Models won't be available", TORCH_MESSAGE)
    logging.getLogger("jax._src.xla_bridge").info("%s: no libtpu", TPU_MESSAGE)
    logging.getLogger("transformers").warning("a real transformers warning")
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'cuda': x")
    assert [r.getMessage() for r in caplog.records] == [
        "a real transformers warning", "Unable to initialize backend 'cuda': x"]


def test_the_routers_settings_reach_it_under_its_own_names():
    args = ServerArgs.from_cli(["--dp-size", "2", "--router-request-timeout-secs", "60",
                                "--router-retry-max-retries", "2"])
    command = router.router_command(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    settings = dict(zip(command[::1], command[1:], strict=False))
    assert settings["--request-timeout-secs"] == "60"
    assert settings["--retry-max-retries"] == "2"
    assert settings["--cb-timeout-duration-secs"] == "10"  # ours, not the router's 60
    assert settings["--health-failure-threshold"] == "3"
    with pytest.raises(ValueError, match="router_request_timeout_secs must be >= 1"):
        ServerArgs(router_request_timeout_secs=0)
