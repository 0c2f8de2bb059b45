"""Drop two log records of our dependencies that read as errors but are not.

- transformers warns "PyTorch was not found..." when torch is not installed: this project
  never needs PyTorch (tokenizers and configs work without it).
- JAX logs "Unable to initialize backend 'tpu'" while probing platforms on a machine without
  a TPU. Asking for a TPU (--device tpu) still fails loudly: JAX then raises instead of logging.

Filters sit on the exact loggers and match the exact message starts, so every other record of
those loggers still shows.
"""

from __future__ import annotations

import logging

_NOISE = {  # logger name -> start of the message to drop
    "transformers": "PyTorch was not found.",
    "jax._src.xla_bridge": "Unable to initialize backend 'tpu'",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def silence_import_noise() -> None:
    """Install the filters (idempotent); must run before transformers is imported."""
    for name, prefix in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
