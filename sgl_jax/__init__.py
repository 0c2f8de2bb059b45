"""sgl-jax: a JAX inference server for large language models with EAGLE3 speculative decoding."""

from typing import Any

from sgl_jax.import_noise import silence_import_noise
from sgl_jax.version import __version__

# Here, not in the launcher: the launcher and the Engine both import transformers early.
silence_import_noise()

__all__ = ["LLM", "Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import sgl_jax.testing` does not pull in JAX and transformers.
    # `LLM` is the Engine under the name SGLang's examples use (`sgl.LLM(model=...)`).
    if name in ("Engine", "LLM"):
        from sgl_jax.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sgl_jax' has no attribute {name!r}")
