"""How big the pools are: KV pages and, for hybrid models, recurrent-state slots, from the
memory a device has left after the weights (or the flags' sizes)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import numpy as np

from sgl_jax.mem_cache.kv_cache import kv_bytes_per_token, kv_cache_dtype, kv_pool_pages
from sgl_jax.mem_cache.state_pool import state_bytes_per_slot
from sgl_jax.model_executor.forward_batch import Buckets
from sgl_jax.models.loader import LoadedModel
from sgl_jax.parallel import bytes_per_device
from sgl_jax.server_args import ServerArgs
from sgl_jax.speculative.drafters.interface import DraftCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int  # KV pages, the null page included
    num_state_slots: int  # recurrent-state slots, the null slot included (0: none)
    kv_dtype: np.dtype  # what the pages store (the target's and a draft's alike)
    state_bytes: int  # the state pool's bytes per device


def size_pools(args: ServerArgs, model: LoadedModel, buckets: Buckets, context_length: int,
               draft_params: object = None, draft_cache: DraftCache | None = None
               ) -> PoolSizes:
    """The pools of this model (and draft): a hybrid model's state slots (one per running
    request plus the null slot) are taken from the budget before any KV page is counted; a
    draft's cache shares the page ids, so a page costs the target's and the draft's K/V."""
    config, tp, dtype = model.config, model.tp, model.dtype
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    num_state_slots = buckets.max_seqs + 1 if config.is_hybrid else 0
    state_bytes = num_state_slots * (
        state_bytes_per_slot(config, dtype, tp)
        + (draft_cache.state_bytes_per_slot(dtype, tp) if draft_cache else 0))
    bytes_per_token = kv_bytes_per_token(config, kv_dtype, tp) + (
        draft_cache.bytes_per_token(kv_dtype, tp) if draft_cache else 0)
    num_pages = kv_pool_pages(
        page_size=args.page_size, bytes_per_token=bytes_per_token,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static or default_mem_fraction(),
        param_bytes=_distinct_bytes(jax.tree.leaves((model.params, draft_params))),
        max_useful_tokens=buckets.max_seqs * context_length, state_bytes=state_bytes)
    sizes = PoolSizes(num_pages, num_state_slots, kv_dtype, state_bytes)
    _log_sizes(sizes, args.page_size, buckets)
    return sizes


def default_mem_fraction() -> float:
    # On a CPU the "device memory" is the host's RAM, shared with everything else.
    return 0.1 if jax.default_backend() == "cpu" else 0.8


def _distinct_bytes(arrays: Iterable[jax.Array]) -> int:
    """Bytes per device of `arrays`, each counted once (a draft shares target arrays)."""
    return bytes_per_device({id(x): x for x in arrays}.values())


def _log_sizes(sizes: PoolSizes, page_size: int, buckets: Buckets) -> None:
    logger.info("KV pool: %d pages of %d tokens in %s; buckets: tokens %s, batch sizes %s",
                sizes.num_pages - 1, page_size, sizes.kv_dtype.name, buckets.token_paddings,
                buckets.bs_paddings)
    if sizes.num_state_slots:
        logger.info("Recurrent-state pool: %d slots of %.2f MiB per device (%.2f GiB)",
                    sizes.num_state_slots - 1,
                    sizes.state_bytes / sizes.num_state_slots / 2**20, sizes.state_bytes / 2**30)
