"""ModelRunner: owns the parameters and the KV cache and runs one jitted step per batch."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import numpy as np

from sgl_jax.layers.attention import LayerKV, get_attention_backend
from sgl_jax.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax.model_executor.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from sgl_jax.models.loader import LoadedModel

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        attention_backend: str = "native",
        capture_layers: tuple[int, ...] = (),
    ):
        self.model = model
        self.config = model.config
        self.page_size = page_size
        self.num_compilations = 0  # traces of the step function; steady state adds none
        self.kv_cache: list[LayerKV] = allocate_kv_cache(
            model.config, num_pages=num_pages, page_size=page_size, dtype=model.dtype
        )
        step = functools.partial(
            self._step,
            attention=get_attention_backend(attention_backend),
            capture_layers=capture_layers,
        )
        self._jitted_step = jax.jit(step, donate_argnums=(1,))

    def forward(
        self, chunks: Sequence[SeqChunk], *, all_logits: bool = False
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Run chunks through the model, updating the KV cache.

        Returns logits f32[num_chunks, V] for each chunk's last token (f32[num_tokens, V] for
        every token with all_logits) and the captured hidden states, each f[num_tokens, H].
        """
        batch = build_forward_batch(chunks, page_size=self.page_size, all_logits=all_logits)
        self.kv_cache, logits, captured = self._jitted_step(
            self.model.params, self.kv_cache, batch
        )
        num_tokens = sum(len(c.token_ids) for c in chunks)
        num_rows = num_tokens if all_logits else len(chunks)
        return np.asarray(logits)[:num_rows], tuple(np.asarray(h)[:num_tokens] for h in captured)

    def _step(self, params, kv_cache: list[LayerKV], batch: ForwardBatch, *, attention,
              capture_layers):
        self._log_compilation(batch)
        impl, config = self.model.impl, self.config
        hidden, kv_cache, captured = impl.forward(
            params, kv_cache, batch.input_ids, batch.positions, batch.attention,
            config=config, attention=attention, capture_layers=capture_layers,
        )
        logits = impl.compute_logits(params, hidden[batch.logits_indices], config)
        return kv_cache, logits, captured

    def _log_compilation(self, batch: ForwardBatch) -> None:
        # Runs only while tracing, i.e. once per new bucket of shapes.
        self.num_compilations += 1
        meta = batch.attention
        logger.info(
            "Compiling forward step #%d: tokens=%d seqs=%d pages/seq=%d max_q_len=%d logits=%d%s",
            self.num_compilations, batch.input_ids.shape[0], meta.num_seqs,
            meta.page_table.shape[1], meta.max_q_len, batch.logits_indices.shape[0],
            " tree-mask" if meta.custom_mask is not None else "",
        )
