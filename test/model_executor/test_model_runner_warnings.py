"""On CPU the runner says at start-up when a setting makes it slow (the tests run on CPU)."""

import logging

import pytest

from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models.loader import load_model
from sgl_jax.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", with_tokenizer=False)


def runner_warnings(model_dir, caplog, *, dtype: str, backend: str | None,
                    quantization: str | None = None) -> list[str]:
    model = load_model(str(model_dir), dtype=dtype, progress=False, quantization=quantization)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgl_jax.model_executor.model_runner"):
        ModelRunner(model, num_pages=4, page_size=16, attention_backend=backend)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("backend", ["fa", "triton"])
def test_pallas_backend_on_cpu_warns_about_interpret_mode(model_dir, caplog, backend):
    (message,) = runner_warnings(model_dir, caplog, dtype="float32", backend=backend)
    assert f"attention backend {backend} on CPU" in message and "interpret mode" in message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_dtype_on_cpu_warns(model_dir, caplog, dtype):
    (message,) = runner_warnings(model_dir, caplog, dtype=dtype, backend="native")
    assert f"--dtype {dtype} on CPU is slow" in message and "float32" in message


@pytest.mark.parametrize("quantization", ["int8", "w8a8_int8"])
def test_8_bit_weights_on_cpu_warn_with_the_figures(model_dir, caplog, quantization):
    (message,) = runner_warnings(model_dir, caplog, dtype="float32", backend="native",
                                 quantization=quantization)
    assert f"{quantization} weights on CPU are slow" in message
    assert "5.6 tokens/s" in message and "34.8 in float32" in message


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_cpu_defaults_do_not_warn(model_dir, caplog, dtype):
    assert runner_warnings(model_dir, caplog, dtype=dtype, backend=None) == []
