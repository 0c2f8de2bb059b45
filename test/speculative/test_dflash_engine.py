"""DFLASH through the Engine with a DFlash head fitted here to the target's own greedy text,
so its drafts are accepted: in a KV pool too small for the batch (requests are retracted and
run again), beside a regex-constrained request (its chains masked on the host), greedy
output equals plain decoding's and every page comes back, aborts mid-run included (the
head's context KV lives in the target's pages, so the same count covers it); sampled tokens
at temperature > 0 follow the target's distribution (chi-square) while drafts are accepted.
Retraction and aborts run with DFLASH and with DSPARK (a DSpark head made of a backbone
fitted the same way, anchor first); sampling with DSPARK, whose sampled chains are verified
against the distribution they were drawn from.
Greedy equality over batches and page sizes: test_speculative_engine; TP 2: test_tp_native.
"""

from collections import Counter

import numpy as np
import pytest
import torch

from sgl_jax import Engine
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import fit_dflash_draft
from sgl_jax.testing.dspark import dspark_from_dflash, fit_confidence_head
from sgl_jax.testing.engines import believe_round_costs, walk_away_mid_run

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64, 256],
            precompile_bs_paddings=[1, 8], max_prefill_tokens=256, chunked_prefill_size=48,
            skip_server_warmup=True)
STEPS = 7  # the tiny head's whole block of 8
FIT_PROMPTS = np.random.default_rng(5).integers(3, 500, (4, 12)).tolist()
FIT_NEW = 32
LENGTHS = [70, 3, 40, 9]  # prompts nothing was fitted to; 70 takes two prefill chunks
MAX_NEW = [9, 24, 12, 20]
CONSTRAINED = [7, 8, 9, 10]
REGEX = "[ab]{3,12}"


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def other_prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The Llama target, a DFlash head fitted to its greedy continuations of FIT_PROMPTS
    (EOS suppressed, which these prompts' ignore_eos answers equal) and those continuations."""
    root = tmp_path_factory.mktemp("dflash-engine")
    target = write_tiny_checkpoint(root / "llama", "llama")
    continuations = fit_dflash_draft(root / "head", target, FIT_PROMPTS, new_tokens=FIT_NEW,
                                     steps=40)
    fit_dflash_draft(root / "backbone", target, FIT_PROMPTS, new_tokens=FIT_NEW, steps=40,
                     anchor_first=True)
    dspark = dspark_from_dflash(root / "dspark", root / "backbone", target, markov_scale=0.1)
    unfitted = np.random.default_rng(6).integers(3, 500, (4, 12)).tolist()
    fit_confidence_head(dspark, target, [FIT_PROMPTS, unfitted], new_tokens=FIT_NEW)
    return {"target": target, "head": root / "head", "dspark": dspark,
            "continuations": continuations}


@pytest.fixture(scope="module")
def references(fitted):
    """Plain decoding's greedy answers to other_prompts() and to CONSTRAINED under REGEX."""
    with Engine(model_path=str(fitted["target"]), page_size=16, **BASE) as engine:
        out = engine.generate(input_ids=[*other_prompts(), CONSTRAINED], sampling_params=[
            *(greedy(n) for n in MAX_NEW), greedy(20, regex=REGEX)])
    return [o["output_ids"] for o in out]


def dflash_engine(fitted, **extra):
    return Engine(**{"model_path": str(fitted["target"]), "speculative_algorithm": "DFLASH",
                     "speculative_draft_model_path": str(fitted["head"]),
                     "speculative_num_steps": STEPS, **BASE, **extra})


def dspark_flags(fitted, algorithm: str) -> dict:
    """Engine arguments that swap the DFlash head for the DSpark one (DSPARK), else none."""
    if algorithm == "DFLASH":
        return {}
    return dict(speculative_algorithm="DSPARK", speculative_draft_model_path=str(fitted["dspark"]))


def pages_all_free(engine) -> bool:
    """No request holds a page (the target's KV and the head's context alike), and with the
    prefix cache flushed every page is free."""
    return (engine.flush_cache() and engine.get_server_info()["kv_pages_in_use"] == 0
            and engine.usage().all_pages_free)


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_retraction_grammar_and_aborts(fitted, references, algorithm):
    """Page size 1 and a pool of 256 tokens for 9 requests that need about 450: requests are
    retracted and run again (prompt and head context recomputed), a regex-constrained one
    among them; outputs are plain decoding's, the fitted prompts' drafts are accepted all
    along, and retractions and aborts mid-run give every page back."""
    with dflash_engine(fitted, page_size=1, max_total_tokens=256,
                       **dspark_flags(fitted, algorithm)) as engine:
        out = engine.generate(
            input_ids=[*FIT_PROMPTS, *other_prompts(), CONSTRAINED],
            sampling_params=[*[greedy(FIT_NEW)] * 4, *(greedy(n) for n in MAX_NEW),
                             greedy(20, regex=REGEX)])
        assert [o["output_ids"] for o in out] == [*fitted["continuations"], *references]
        info = engine.get_server_info()
        assert info["num_retractions"] > 0 and info["spec_masked_rounds"] > 0
        accept = [o["meta_info"]["spec_accept_length"] for o in out[:4]]
        assert min(accept) > 2, accept
        assert pages_all_free(engine)
        walk_away_mid_run(engine, FIT_PROMPTS[:3])
        assert pages_all_free(engine)


# Round costs (ms) that make packed rounds pay: verifying every row's whole chain of 7
# costs four plain steps, a width-4 packed round two.
PACKED_COSTS_MS = {"plain": 10, "1/1/2": 11, "7/1/8": 40, "7/1/8:2": 12, "7/1/8:4": 20}


def record_shares(engine) -> list[dict[str, int]]:
    """Every packed round's draft nodes per request id, as its program chose them."""
    decoder, shares = engine.runtime.scheduler.decoding, []
    settle = decoder.settle

    def recording(launched):
        round_ = launched.output  # a decode step's LaunchedRound
        if launched.kind == "decode" and round_.shape.verify_width:
            nodes = round_.output.result().verified_nodes
            shares.append({req.rid: int(n) for req, n in zip(round_.reqs, nodes, strict=True)})
        return settle(launched)
    decoder.settle = recording
    return shares


def test_per_request_lengths_verify_what_each_request_earns(fitted, references):
    """DSPARK with per-request lengths, the fitted prompts (whose drafts are accepted, and
    whose confidence the head's fitted confidence head puts high) and the others (whose are
    not) in one batch, at costs where verifying every row's whole chain does not pay: packed
    rounds run, greedy output equals plain decoding's, and while both kinds share the
    rounds the round's program gives the fitted prompts most of the verified nodes. What each
    request verified shows in its meta_info, the confidence's calibration in server info."""
    with dflash_engine(fitted, page_size=16, skip_server_warmup=False,
                       precompile_bs_paddings=[8], speculative_per_request_lengths=True,
                       **dspark_flags(fitted, "DSPARK")) as engine:
        assert engine.runtime.builder.wait_idle(timeout=600)
        believe_round_costs(engine, PACKED_COSTS_MS)
        shares = record_shares(engine)
        out = engine.generate(input_ids=[*FIT_PROMPTS, *other_prompts()],
                              sampling_params=[*[greedy(FIT_NEW)] * 4,
                                               *(greedy(n) for n in MAX_NEW)])
        assert pages_all_free(engine)
        assert engine.get_server_info()["spec_draft_confidence"]["nodes"] > 0
    assert [o["output_ids"] for o in out] == [*fitted["continuations"], *references[:4]]
    ids = [o["meta_info"]["id"] for o in out]
    shared = [round_ for round_ in shares  # every fitted prompt and some of the others
              if set(ids[:4]) <= set(round_) and len(set(ids[4:]) & set(round_)) >= 2]
    assert len(shared) >= 3, shares
    fitted_nodes = sum(round_[rid] for round_ in shared for rid in ids[:4])
    other_nodes = sum(round_.get(rid, 0) for round_ in shared for rid in ids[4:])
    assert fitted_nodes > 3 * other_nodes, shared
    for o in out:  # every round verified a prefix of the chain
        verified = o["meta_info"]["spec_verified_per_position"]
        assert verified == sorted(verified, reverse=True) and verified[0] > 0, verified


TEMPERATURE, TOP_K = 0.5, 4
# Width-4 packed rounds cheaper than plain ones: every round speculates, whatever the
# acceptance the policy measures.
SAMPLING_COSTS_MS = {**PACKED_COSTS_MS, "7/1/8:2": 30, "7/1/8:4": 6}
SAMPLES = 1024
CHI2_LIMIT = 30.0  # 3 degrees of freedom: far beyond the 99.999th percentile (25.9)


def target_distribution(model, ids):
    """The target's next-token distribution after ids (transformers), as the sampler
    filters it: temperature, then the top TOP_K renormalised."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double().numpy() / TEMPERATURE
    probs = np.exp(logits - logits.max())
    keep = np.argsort(-probs, kind="stable")[:TOP_K]
    out = np.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def chi_square(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "a token outside the top-k was emitted"
    live = probs > 0
    expected = counts.sum() * probs[live]
    return float(((counts[live] - expected) ** 2 / expected).sum())


def test_sampling_emits_the_target_distribution(fitted):
    """SAMPLES requests of one fitted prompt at temperature 0.5, top-k 4, each with its own
    seed: the second and third tokens (speculative rounds', whose drafts are accepted often)
    follow the target's distribution given the tokens before them, for every prefix sampled
    at least 100 times. A verifier that accepts drafts 1.25 times too often
    (--speculative-accept-threshold-acc 0.8) fails it (chi-square 34 for the greedy prefix),
    one at 2 times (0.5) by far (416); the lossless one gives at most 3.1 (figures of the
    DFLASH head). Run with DSPARK (the fitted backbone with a small random Markov head), which
    draws its drafts from the filtered distribution it then verifies them against as q: the
    same engine path as DFLASH's drafts, plus that rule (DFLASH's one-hot rule is checked
    against a reference in test_tree_and_verify). With per-request lengths, at costs where
    packed rounds pay: their rows verify prefixes of their chains."""
    from transformers import AutoModelForCausalLM

    prompt = FIT_PROMPTS[0]
    with dflash_engine(fitted, page_size=16, precompile_bs_paddings=[64],
                       skip_server_warmup=False, speculative_per_request_lengths=True,
                       **dspark_flags(fitted, "DSPARK")) as engine:
        assert engine.runtime.builder.wait_idle(timeout=600)
        believe_round_costs(engine, SAMPLING_COSTS_MS)
        out = engine.generate(input_ids=[prompt] * SAMPLES, sampling_params=[
            {"temperature": TEMPERATURE, "top_k": TOP_K, "max_new_tokens": 3,
             "ignore_eos": True, "seed": i} for i in range(SAMPLES)])
        info = engine.get_server_info()
        assert pages_all_free(engine)
    ids = np.array([o["output_ids"] for o in out])
    # Drafts were accepted (a head that never drafts right would leave verification to
    # sample every token itself), past the first position too.
    accepted = info["spec_accepted_per_position"]
    assert accepted[0] > 0.2 * SAMPLES and accepted[1] > 0, accepted
    assert info["spec_rounds_by_shape"]["7/1/8:4"] > 0, info["spec_rounds_by_shape"]
    model = AutoModelForCausalLM.from_pretrained(fitted["target"], dtype=torch.float32)
    stats = {}
    for depth in (1, 2):
        for prefix, count in Counter(map(tuple, ids[:, :depth].tolist())).items():
            if count >= 100:
                rows = (ids[:, :depth] == prefix).all(axis=1)
                stats[prefix] = chi_square(ids[rows, depth],
                                           target_distribution(model, prompt + list(prefix)))
    assert len([p for p in stats if len(p) == 2]) >= 1, stats  # a third token was tested
    assert max(stats.values()) < CHI2_LIMIT, stats
