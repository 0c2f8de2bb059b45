"""From --speculative-* settings to a loaded draft and its SpecRunner."""

from __future__ import annotations

import logging

import jax.numpy as jnp

from sgl_jax.layers.attention import get_attention_backend
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.models import llama_eagle3, qwen3_next
from sgl_jax.models.dflash import DFlashConfig
from sgl_jax.models.loader import (
    LoadedDraft,
    LoadedModel,
    load_dflash_draft,
    load_eagle3_draft,
    load_eagle_draft,
    load_model,
    load_nextn_draft,
)
from sgl_jax.server_args import ServerArgs, SpeculativeConfig
from sgl_jax.speculative.dflash_drafter import DFlashDrafter
from sgl_jax.speculative.drafter import ModelDrafter, NoProposer, Proposer
from sgl_jax.speculative.drafts import (
    DraftModel,
    Eagle3Draft,
    EagleDraft,
    NextnDraft,
    StandaloneDraft,
    TreeShape,
    allocate_draft_cache,
)
from sgl_jax.speculative.ngram import NgramDrafter, NgramProposer
from sgl_jax.speculative.policy import PLAIN, candidate_shapes
from sgl_jax.speculative.spec_runner import SpecRunner
from sgl_jax.speculative.verify import AcceptThresholds

logger = logging.getLogger(__name__)


def load_draft(args: ServerArgs, target: LoadedModel) -> DraftModel | DFlashDrafter | None:
    """Load --speculative-draft-model-path in the target's dtype (None for a drafter that
    needs no model: NGRAM); a draft that does not fit the target stops start-up (there is
    no fallback to plain decoding)."""
    spec = args.speculative
    if spec.ngram is not None:
        return None
    dtype = jnp.dtype(target.dtype).name
    attention = target.tp.attention(get_attention_backend(args.attention_backend))
    formats = dict(revision=spec.draft_model_revision, tp=target.tp,
                   quantization=draft_quantization(args))
    if spec.algorithm == "EAGLE3":
        loaded = load_eagle3_draft(spec.draft_model_path, dtype=dtype, **formats)
        _check_eagle3_fits(loaded, target)
        draft = Eagle3Draft(loaded, target, attention)
    elif spec.algorithm == "EAGLE":
        loaded = load_eagle_draft(spec.draft_model_path, dtype=dtype, **formats)
        _check_eagle_fits(loaded, target)
        draft = EagleDraft(loaded, target, attention)
    elif spec.algorithm == "NEXTN":
        if target.config.architecture not in qwen3_next.ARCHITECTURES:
            raise ValueError(
                f"--speculative-algorithm NEXTN drafts with the target's own multi-token-"
                f"prediction layer, which this version runs for Qwen3-Next and "
                f"Qwen3-Coder-Next ({', '.join(qwen3_next.ARCHITECTURES)}); "
                f"{target.config.architecture} is not one: use EAGLE3, EAGLE, STANDALONE "
                "or NGRAM")
        loaded = load_nextn_draft(spec.draft_model_path, target.config, dtype=target.dtype,
                                  **formats)
        draft = NextnDraft(loaded, target, attention)
    elif spec.algorithm == "DFLASH":
        loaded = load_dflash_draft(spec.draft_model_path, dtype=dtype, **formats)
        _check_dflash_fits(loaded.config, spec, target)
        draft = DFlashDrafter(loaded, target, attention, page_size=args.page_size)
    elif spec.algorithm == "STANDALONE":
        loaded = load_model(spec.draft_model_path, dtype=dtype, **formats)
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
        draft = StandaloneDraft(loaded, attention)
    else:
        raise NotImplementedError(f"--speculative-algorithm {spec.algorithm} is not supported")
    logger.info("Draft %s loaded from %s", spec.algorithm, spec.draft_model_path)
    return draft


def draft_quantization(args: ServerArgs) -> str | None:
    """--speculative-draft-model-quantization: the target's --quantization unless it says
    otherwise; "unquant" keeps the draft in the model dtype."""
    chosen = args.speculative_draft_model_quantization or args.quantization
    return None if chosen == "unquant" else chosen


def make_spec_runner(args: ServerArgs, runner: ModelRunner,
                     draft: DraftModel | DFlashDrafter | None) -> SpecRunner:
    """The runner of the flags' drafter: `draft` (load_draft's), or NGRAM's without one."""
    spec = args.speculative
    capture = ()
    if isinstance(draft, Eagle3Draft):
        capture = llama_eagle3.target_capture_layers(runner.config.num_layers, draft.config,
                                                     target=runner.config)
    shape = TreeShape(spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
    thresholds = AcceptThresholds(spec.accept_threshold_single, spec.accept_threshold_acc)
    # The adaptive policy needs every candidate shape compiled and timed at warm-up.
    adaptive = spec.adaptive and not args.skip_server_warmup
    if spec.adaptive and args.skip_server_warmup:
        logger.warning("--speculative-adaptive needs the warm-up's timing of every round shape; "
                       "with --skip-server-warmup every round takes the flags' shape")
    logger.info("Speculative decoding: %s, steps %d, topk %d, draft tokens %d, capture %s, "
                "adaptive %s", spec.algorithm, shape.num_steps, shape.topk,
                shape.num_draft_tokens, capture, "on" if adaptive else "off")
    # Plain rounds are always on the menu: batches with a grammar-constrained request take them.
    shapes = tuple(dict.fromkeys((*(candidate_shapes(shape) if adaptive else (PLAIN,)),
                                  shape)))
    if draft is None:
        drafter, draft_kv = NgramDrafter(shapes), []
    elif isinstance(draft, DFlashDrafter):
        drafter, draft_kv, capture = draft, _draft_cache(runner, draft), draft.capture_layers
    else:
        drafter = ModelDrafter(draft, dtype=runner.model.dtype, page_size=runner.page_size)
        draft_kv = _draft_cache(runner, draft)
    return SpecRunner(runner, drafter, draft_kv, shape, thresholds=thresholds,
                      capture_layers=capture, shapes=shapes)


def make_proposer(args: ServerArgs, spec: SpecRunner) -> Proposer:
    """The host half of the flags' drafter (NGRAM's statistics; nothing for the others)."""
    if args.speculative.ngram is None:
        return NoProposer()
    return NgramProposer(args.speculative.ngram, spec.shapes)


def _draft_cache(runner: ModelRunner, draft: DraftModel) -> list:
    """The draft's paged cache, as many pages as the target's first attention layer (a
    hybrid model's layer 0 may be a state pool): one allocator serves both."""
    config = runner.config
    first_attention = next(i for i in range(config.num_layers) if not config.is_linear_layer(i))
    return allocate_draft_cache(
        draft, num_pages=runner.state.kv_cache[first_attention][0].shape[0],
        page_size=runner.page_size, dtype=runner.model.dtype, tp=runner.tp,
        num_state_slots=runner.num_state_slots, kv_dtype=runner.kv_dtype)


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


def _check_dflash_fits(config: DFlashConfig, spec: SpeculativeConfig, target: LoadedModel
                       ) -> None:
    """A head for this target (its widths, its layers) whose block holds the flags' chain.
    Any target layer may feed it, a hybrid target's linear-attention layers included: what
    is captured is the residual stream after the layer, one vector per token, which verify
    computes for every draft node from its parent's state as decoding would."""
    layer, target_config = config.layer, target.config
    if (layer.hidden_size, config.num_target_layers) != (target_config.hidden_size,
                                                         target_config.num_layers):
        raise ValueError(
            f"the DFlash head is for a target of hidden size {layer.hidden_size} with "
            f"{config.num_target_layers} layers; this target has {target_config.hidden_size} "
            f"and {target_config.num_layers}: is it the head for another model?")
    outside = [i for i in config.target_layer_ids if not 0 <= i < target_config.num_layers]
    if outside:
        raise ValueError(f"the DFlash head's target_layer_ids {list(config.target_layer_ids)} "
                         f"name layers {outside} that the target does not have (its layers "
                         f"are 0 to {target_config.num_layers - 1})")
    if not 0 <= config.mask_token_id < target_config.vocab_size:
        raise ValueError(f"the DFlash head's mask token {config.mask_token_id} is outside the "
                         f"target's vocabulary of {target_config.vocab_size}")
    if spec.num_steps > config.block_size - 1:
        raise ValueError(
            f"DFLASH drafts at most block_size - 1 = {config.block_size - 1} tokens deep (the "
            f"head's block of {config.block_size}): --speculative-num-steps must be at most "
            f"{config.block_size - 1}, got {spec.num_steps}")


def _check_eagle_fits(draft: LoadedDraft, target: LoadedModel) -> None:
    if draft.config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"the EAGLE draft's hidden size {draft.config.hidden_size} differs from the "
            f"target's {target.config.hidden_size}: is it the draft for another model?")
