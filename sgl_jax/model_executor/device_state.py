"""DeviceState: the device arrays that outlive a step, in one place.

The plain decode step and every speculative program read and write the same KV cache, the
same per-slot last tokens and (hybrid models) the same recurrent-state pool, so they live in
one object that the engine's runners share; what only speculation keeps (a drafter's cache,
the slots' round state) is the speculative runner's own (speculative/round/program.py).
Programs take these arrays donated and return their successors, which the runner that
dispatched the program stores back here: a donated buffer is gone after the call, so nothing
else may keep a reference to one.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from sgl_jax.layers.attention import ModelCache
from sgl_jax.layers.sampler import PenaltyState


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotLengths:
    """Each request slot's lengths as the last speculative round that ran for it left them
    (its host reads them a round later): a step launched before the host has read them
    takes them from here. Plain steps neither need nor keep them (their host always knows)."""

    kv_lens: jax.Array  # i32[S]: committed tokens before the root (the last sampled token)
    num_sampled: jax.Array  # i32[S]: output tokens sampled (the next one's position)


@dataclass
class DeviceState:
    # Every attention layer's pages in one (K, V) pair in the KV dtype (--kv-cache-dtype), and
    # each linear layer's GdnState pool (hybrid models) in the model's.
    kv_cache: ModelCache
    penalties: PenaltyState  # per request slot: token counts for the penalties
    # i32[num_request_slots]: each request slot's last sampled token, so a decode step can
    # take its input from the step before without the host reading it first.
    last_tokens: jax.Array
    lengths: SlotLengths  # written by speculative rounds, read by any step launched after
