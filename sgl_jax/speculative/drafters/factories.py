"""One factory per --speculative-algorithm: the loaded draft (checked against its target)
behind its `Drafter`, with the drafter's host-side `Proposer`.

A draft that does not fit the target stops start-up (there is no fallback to plain
decoding). Adding a drafter is a factory here and its name in `FACTORIES` (and in the flag
table, speculative/flags.SPECULATIVE_ALGORITHMS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

from sgl_jax.layers.attention import AttentionBackend, get_attention_backend
from sgl_jax.models import llama_eagle3, qwen3_next
from sgl_jax.models.dflash import DFlashConfig
from sgl_jax.models.loader import (
    LoadedDraft,
    LoadedModel,
    load_dflash_draft,
    load_dspark_draft,
    load_eagle3_draft,
    load_eagle_draft,
    load_model,
    load_nextn_draft,
)
from sgl_jax.speculative.drafters.dflash import DFlashDrafter
from sgl_jax.speculative.drafters.dspark import DSparkDrafter
from sgl_jax.speculative.drafters.eagle import HeadDrafter
from sgl_jax.speculative.drafters.head_networks import Eagle3Draft, EagleDraft, NextnDraft
from sgl_jax.speculative.drafters.interface import Drafter, NoProposer, Proposer
from sgl_jax.speculative.drafters.ngram.drafter import NgramDrafter, NgramProposer
from sgl_jax.speculative.drafters.standalone import StandaloneDraft, StandaloneDrafter
from sgl_jax.speculative.policy.request_lengths import packed_shapes
from sgl_jax.speculative.policy.shape_policy import PLAIN, candidate_shapes
from sgl_jax.speculative.spec_config import SpeculativeConfig, TreeShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftContext:
    """What every factory is given besides the flags and the target."""

    attention: AttentionBackend  # the target's backend, split over its mesh
    page_size: int
    shapes: tuple[TreeShape, ...]  # every shape a round may take (round_shapes)


@dataclass(frozen=True)
class DrafterSetup:
    drafter: Drafter
    proposer: Proposer  # its host half (NoProposer for a drafter on the device alone)


Factory = Callable[[SpeculativeConfig, LoadedModel, DraftContext], DrafterSetup]


def make_drafter(spec: SpeculativeConfig, target: LoadedModel, *, attention_backend: str,
                 page_size: int, shapes: tuple[TreeShape, ...]) -> DrafterSetup:
    """The flags' drafter over `target`."""
    factory = FACTORIES.get(spec.algorithm)
    if factory is None:
        raise NotImplementedError(f"--speculative-algorithm {spec.algorithm} is not supported")
    context = DraftContext(target.tp.attention(get_attention_backend(attention_backend)),
                           page_size, shapes)
    setup = factory(spec, target, context)
    logger.info("Drafter %s ready (draft from %s)", spec.algorithm, spec.draft_model_path)
    return setup


def round_shapes(spec: SpeculativeConfig, adaptive: bool) -> tuple[TreeShape, ...]:
    """Every shape a round may take: the adaptive policy's candidates up to the flags' shape
    (with per-request lengths, their packed variants), or the flags' shape alone. Plain
    rounds are always on the menu: batches with a grammar-constrained request take them."""
    shape = spec.shape
    if not adaptive:
        return tuple(dict.fromkeys((PLAIN, shape)))
    shapes = tuple(dict.fromkeys((*candidate_shapes(shape), shape)))
    if spec.per_request_lengths:
        shapes += packed_shapes(shapes)
    return shapes


def _formats(spec: SpeculativeConfig, target: LoadedModel) -> dict:
    """Load settings of a draft checkpoint: the target's dtype and mesh, the draft's format."""
    return dict(dtype=jnp.dtype(target.dtype).name, revision=spec.draft_model_revision,
                tp=target.tp, quantization=spec.draft_quantization)


# ---------------------------------------------------------------------- the factories


def eagle3(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext
           ) -> DrafterSetup:
    loaded = load_eagle3_draft(spec.draft_model_path, **_formats(spec, target))
    _check_eagle3_fits(loaded, target)
    capture = llama_eagle3.target_capture_layers(target.config.num_layers, loaded.config,
                                                 target=target.config)
    draft = Eagle3Draft(loaded, target, context.attention)
    return DrafterSetup(HeadDrafter(draft, dtype=target.dtype, page_size=context.page_size,
                                    capture_layers=capture), NoProposer())


def eagle(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext) -> DrafterSetup:
    loaded = load_eagle_draft(spec.draft_model_path, **_formats(spec, target))
    if loaded.config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"the EAGLE draft's hidden size {loaded.config.hidden_size} differs from the "
            f"target's {target.config.hidden_size}: is it the draft for another model?")
    draft = EagleDraft(loaded, target, context.attention)
    return DrafterSetup(HeadDrafter(draft, dtype=target.dtype, page_size=context.page_size),
                        NoProposer())


def nextn(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext) -> DrafterSetup:
    if target.config.architecture not in qwen3_next.ARCHITECTURES:
        raise ValueError(
            f"--speculative-algorithm NEXTN drafts with the target's own multi-token-"
            f"prediction layer, which this version runs for Qwen3-Next and "
            f"Qwen3-Coder-Next ({', '.join(qwen3_next.ARCHITECTURES)}); "
            f"{target.config.architecture} is not one: use EAGLE3, EAGLE, DFLASH, DSPARK, "
            "STANDALONE or NGRAM")
    formats = {**_formats(spec, target), "dtype": target.dtype}
    loaded = load_nextn_draft(spec.draft_model_path, target.config, **formats)
    draft = NextnDraft(loaded, target, context.attention)
    return DrafterSetup(HeadDrafter(draft, dtype=target.dtype, page_size=context.page_size),
                        NoProposer())


def dflash(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext
           ) -> DrafterSetup:
    loaded = load_dflash_draft(spec.draft_model_path, **_formats(spec, target))
    _check_dflash_fits(loaded.config, spec, target)
    return DrafterSetup(DFlashDrafter(loaded, target, context.attention,
                                      page_size=context.page_size), NoProposer())


def dspark(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext
           ) -> DrafterSetup:
    loaded = load_dspark_draft(spec.draft_model_path, **_formats(spec, target))
    config = loaded.config
    _check_dflash_fits(config.backbone, spec, target, kind="DSpark",
                       deepest=config.backbone.block_size)
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the DSpark head drafts over a vocabulary of {config.vocab_size} "
                         f"tokens, the target has {target.config.vocab_size}: is it the head "
                         "for another model?")
    return DrafterSetup(DSparkDrafter(loaded, target, context.attention,
                                      page_size=context.page_size), NoProposer())


def standalone(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext
               ) -> DrafterSetup:
    loaded = load_model(spec.draft_model_path, **_formats(spec, target))
    if loaded.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"the STANDALONE draft's vocabulary ({loaded.config.vocab_size}) is larger than "
            f"the target's ({target.config.vocab_size}); a draft must share the target's "
            "tokenizer")
    if loaded.config.is_hybrid and not target.config.is_hybrid:
        raise NotImplementedError(
            f"a STANDALONE draft with recurrent state ({loaded.config.architecture}) needs "
            "a hybrid target: the draft keeps its states in the target's request state "
            f"slots, and {target.config.architecture} has none")
    draft = StandaloneDraft(loaded, context.attention)
    return DrafterSetup(StandaloneDrafter(draft, dtype=target.dtype,
                                          page_size=context.page_size), NoProposer())


def ngram(spec: SpeculativeConfig, target: LoadedModel, context: DraftContext) -> DrafterSetup:
    """No model: drafts from the text itself."""
    return DrafterSetup(NgramDrafter(context.shapes),
                        NgramProposer(spec.ngram, context.shapes))


FACTORIES: dict[str, Factory] = {"EAGLE3": eagle3, "EAGLE": eagle, "NEXTN": nextn,
                                 "DFLASH": dflash, "DSPARK": dspark, "STANDALONE": standalone,
                                 "NGRAM": ngram}


# ---------------------------------------------------------------------- fit checks


def _check_eagle3_fits(draft: LoadedDraft, target: LoadedModel) -> None:
    config = draft.config
    if config.target_hidden_size != target.config.hidden_size:
        raise ValueError(
            f"the EAGLE3 draft expects target hidden states of width "
            f"{config.target_hidden_size}, but the target's hidden size is "
            f"{target.config.hidden_size}: is it the draft for another model?")
    if config.layer.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the EAGLE3 draft maps into a vocabulary of {config.layer.vocab_size} tokens, the "
            f"target has {target.config.vocab_size}: is it the draft for another model?")
    shared = [name for name in ("embed", "lm_head") if name not in draft.params]
    if shared and config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"the EAGLE3 draft has no own {' or '.join(shared)} and would share the target's, "
            f"but its hidden size {config.hidden_size} differs from the target's "
            f"{target.config.hidden_size}")


def _check_dflash_fits(config: DFlashConfig, spec: SpeculativeConfig, target: LoadedModel,
                       *, kind: str = "DFlash", deepest: int | None = None) -> None:
    """A head for this target (its widths, its layers) whose block holds the flags' chain.
    Any target layer may feed it, a hybrid target's linear-attention layers included: what
    is captured is the residual stream after the layer, one vector per token, which verify
    computes for every draft node from its parent's state as decoding would."""
    layer, target_config = config.layer, target.config
    if (layer.hidden_size, config.num_target_layers) != (target_config.hidden_size,
                                                         target_config.num_layers):
        raise ValueError(
            f"the {kind} head is for a target of hidden size {layer.hidden_size} with "
            f"{config.num_target_layers} layers; this target has {target_config.hidden_size} "
            f"and {target_config.num_layers}: is it the head for another model?")
    outside = [i for i in config.target_layer_ids if not 0 <= i < target_config.num_layers]
    if outside:
        raise ValueError(f"the {kind} head's target_layer_ids {list(config.target_layer_ids)} "
                         f"name layers {outside} that the target does not have (its layers "
                         f"are 0 to {target_config.num_layers - 1})")
    if not 0 <= config.mask_token_id < target_config.vocab_size:
        raise ValueError(f"the {kind} head's mask token {config.mask_token_id} is outside the "
                         f"target's vocabulary of {target_config.vocab_size}")
    deepest = config.block_size - 1 if deepest is None else deepest  # DSpark: anchor first
    if spec.num_steps > deepest:
        raise ValueError(
            f"{kind.upper()} drafts at most {deepest} tokens deep (the head's block of "
            f"{config.block_size}): --speculative-num-steps must be at most {deepest}, got "
            f"{spec.num_steps}")
