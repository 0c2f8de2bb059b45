"""Speculative decoding through the Engine: greedy output equals plain decoding token for
token (Llama and Qwen3; EAGLE3, EAGLE, STANDALONE, DFLASH and DSPARK drafts; chain and tree;
batch 1 and 8; page sizes 1 and 16; Qwen2's biases and single KV head under an EAGLE3 tree:
parallel/test_tp_native.py), a target used
as its own draft accepts every token, and stops inside an accepted run are honoured."""

import contextlib
import json
import threading

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.speculative import spec_warmup
from sgl_jax.testing import write_noisy_copy, write_tiny_checkpoint
from sgl_jax.testing.dflash import write_tiny_dflash_draft
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.eagle3 import (
    cached_draft_keys,
    write_tiny_eagle3_draft,
    write_tiny_eagle_draft,
)

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64, 256],
            precompile_bs_paddings=[1, 8], max_prefill_tokens=256, chunked_prefill_size=48,
            skip_server_warmup=True)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=8)
LENGTHS = [3, 70, 12, 130, 5, 40, 21, 9]  # 70 and 130 take several prefill chunks
MAX_NEW = [17, 9, 24, 6, 30, 12, 1, 20]


def greedy(n, **extra):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for preset in ("llama", "qwen3"):
        target = write_tiny_checkpoint(root / preset, preset)
        config = json.loads((target / "config.json").read_text())
        out[preset] = {
            "target": target,
            "eagle3": write_tiny_eagle3_draft(root / f"{preset}-eagle3", config),
            "eagle": write_tiny_eagle_draft(root / f"{preset}-eagle", config),
            "noisy": write_noisy_copy(target, root / f"{preset}-noisy", relative_noise=0.03),
            "dflash": write_tiny_dflash_draft(root / f"{preset}-dflash", config),
            "dspark": write_tiny_dspark_draft(root / f"{preset}-dspark", config,
                                              markov_head="rnn"),
        }
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    """Plain greedy decoding (itself checked against transformers elsewhere)."""
    out = {}
    for preset, paths in checkpoints.items():
        with Engine(model_path=str(paths["target"]), page_size=16, **BASE) as engine:
            batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                          MAX_NEW])
            out[preset] = [o["output_ids"] for o in batch]
    return out


def spec_engine(paths, algorithm, draft, shape, **extra):
    return Engine(model_path=str(paths["target"]), speculative_algorithm=algorithm,
                  speculative_draft_model_path=str(paths[draft]), **shape, **{**BASE, **extra})


def pages_all_free(engine) -> bool:
    return engine.flush_cache() and engine.usage().all_pages_free


CASES = [
    ("llama", "EAGLE3", "eagle3", CHAIN, 1),
    ("llama", "EAGLE3", "eagle3", TREE, 16),
    ("llama", "STANDALONE", "noisy", CHAIN, 16),
    ("llama", "STANDALONE", "noisy", TREE, 1),
    ("llama", "EAGLE", "eagle", TREE, 16),
    ("qwen3", "EAGLE3", "eagle3", CHAIN, 16),
    ("qwen3", "DFLASH", "dflash", TREE, 16),  # a random head: per-position top-k trees
    ("llama", "DSPARK", "dspark", CHAIN, 16),  # anchor first, each slot after its Markov term
    ("qwen3", "DSPARK", "dspark", TREE, 1),  # each node's Markov term from its parent's token
]


@pytest.mark.parametrize("preset,algorithm,draft,shape,page_size", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'tree' if c[3] is TREE else 'chain'}-page{c[4]}"
                              for c in CASES])
def test_greedy_speculation_equals_plain_decoding(checkpoints, references, preset, algorithm,
                                                  draft, shape, page_size):
    expected = references[preset]
    with spec_engine(checkpoints[preset], algorithm, draft, shape, page_size=page_size) as eng:
        alone = eng.generate(input_ids=prompts()[3], sampling_params=greedy(MAX_NEW[3]))
        assert alone["output_ids"] == expected[3]  # batch size 1
        batch = eng.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])
        assert [o["output_ids"] for o in batch] == expected  # batch size 8, mixed lengths
        rounds = sum(o["meta_info"]["spec_verify_ct"] for o in batch)
        accepted = sum(sum(o["meta_info"]["spec_accepted_per_position"]) for o in batch)
        if draft == "noisy":  # a near copy of the target: it must really be accepted
            assert accepted > rounds
        info = eng.get_server_info()
        assert info["avg_spec_accept_length"] >= 1.0
        assert len(info["spec_accept_rates"]) == shape["speculative_num_steps"]
        assert pages_all_free(eng)


@pytest.fixture(scope="module")
def self_draft(checkpoints):
    paths = {"target": checkpoints["llama"]["target"], "self": checkpoints["llama"]["target"]}
    with spec_engine(paths, "STANDALONE", "self", CHAIN, page_size=4) as engine:
        yield engine


def test_target_as_its_own_draft_accepts_every_chain_token(self_draft, references):
    outputs = self_draft.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                        MAX_NEW])
    assert [o["output_ids"] for o in outputs] == references["llama"]
    for out, n in zip(outputs, MAX_NEW, strict=True):
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] == -(-(n - 1) // 4)  # the first token comes from prefill
        assert meta["spec_accepted_per_position"] == [meta["spec_verify_ct"]] * 3
        if n > 1:
            assert meta["spec_accept_length"] == 4.0  # steps + 1, every round
    assert self_draft.get_server_info()["spec_accept_rates"] == [1.0, 1.0, 1.0]


def tree_walk_ends(tokens, parents, emitted):
    """Follow the emitted tokens down the tree; returns the node where the walk stopped."""
    node = 0
    for token in emitted[:-1]:
        node = next(c for c in range(len(parents)) if parents[c] == node and tokens[c] == token)
    return node


def test_target_as_its_own_tree_draft_accepts_a_full_path_every_round(checkpoints, references):
    paths = {"target": checkpoints["llama"]["target"], "self": checkpoints["llama"]["target"]}
    with spec_engine(paths, "STANDALONE", "self", TREE, page_size=16) as engine:
        rounds = []
        original = engine.runtime.spec_runner.round

        class RecordedRound:  # records the round's results when the host reads them
            def __init__(self, pending):
                self.pending = pending

            def result(self):
                output = self.pending.result()
                rounds.extend((output.tree_tokens[i], output.tree_parents[i],
                               output.tokens[i, : output.num_accepted[i] + 1])
                              for i in range(len(output.tokens)))
                return output

        def recording_round(*args, **kwargs):
            return RecordedRound(original(*args, **kwargs))

        engine.runtime.spec_runner.round = recording_round
        outputs = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                        MAX_NEW])
    assert [o["output_ids"] for o in outputs] == references["llama"]
    assert rounds
    for tokens, parents, emitted in rounds:
        last = tree_walk_ends(tokens, parents, emitted)
        assert last not in parents, "the walk stopped at a node that has children"
    assert np.mean([len(e) for _, _, e in rounds]) > 2


def test_stops_inside_an_accepted_run_are_honoured(self_draft, references):
    prompt = prompts()[0]
    expected = references["llama"][0]  # 17 tokens without stops
    stop_token = expected[6]
    cut = expected.index(stop_token) + 1
    out = self_draft.generate(input_ids=prompt, sampling_params=greedy(
        17, ignore_eos=False, stop_token_ids=[stop_token]))
    assert out["output_ids"] == expected[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    out = self_draft.generate(input_ids=prompt, sampling_params=greedy(6))  # 6 = 1 + 4 + 1
    assert out["output_ids"] == expected[:6]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    text = self_draft.generate(input_ids=prompt, sampling_params=greedy(17))["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = self_draft.generate(input_ids=prompt, sampling_params=greedy(17, stop=[stop]))
        assert out["text"] == text[: text.index(stop)]
    assert pages_all_free(self_draft)


def test_prefix_cache_and_logprobs_with_speculation(checkpoints):
    paths = checkpoints["llama"]
    shared = prompts(5)[3]  # 130 tokens: 8 full pages, and shared[128] follows the last
    first, second = shared + [7, 8, 9], shared + [11, 12]
    params = dict(input_ids=second, sampling_params=greedy(10), return_logprob=True)
    with Engine(model_path=str(paths["target"]), page_size=16, **BASE) as plain:
        reference = plain.generate(**params)
    with spec_engine(paths, "EAGLE3", "eagle3", TREE, page_size=16) as fresh:
        fresh.generate(**params)
        expected_keys = cached_draft_keys(fresh, second)
    with spec_engine(paths, "EAGLE3", "eagle3", TREE, page_size=16) as eng:
        eng.generate(input_ids=first, sampling_params=greedy(4))
        out = eng.generate(**params)
        # EAGLE3's draft KV at a page's last slot depends on the token after the page: every
        # shared page is reused because the two prompts go on alike past each of them
        assert out["meta_info"]["cached_tokens"] == 128
        np.testing.assert_allclose(cached_draft_keys(eng, second), expected_keys, atol=1e-5)
        # one that goes on otherwise right after a page recomputes that page
        diverging = shared[:112] + [13, 14, 15]
        again = eng.generate(input_ids=diverging, sampling_params=greedy(4))
        assert again["meta_info"]["cached_tokens"] == 96
        assert pages_all_free(eng)
    assert out["output_ids"] == reference["output_ids"]
    got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _ in reference["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_seeded_sampling_with_speculation_is_reproducible(self_draft):
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "seed": 3,
              "ignore_eos": True}
    a = self_draft.generate(input_ids=prompts()[2], sampling_params=params)
    b = self_draft.generate(input_ids=prompts()[2], sampling_params=params)
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 12


def test_unsupported_requests_and_drafts_are_refused(checkpoints, self_draft, tmp_path):
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        self_draft.generate(input_ids=[5, 6], sampling_params={"repetition_penalty": 1.2})
    paths = checkpoints["llama"]
    with pytest.raises(ValueError, match="NEXTN drafts with the target's own multi-token-"
                                         "prediction layer, which this version runs for "
                                         "Qwen3-Next"):
        spec_engine(paths, "NEXTN", "eagle3", CHAIN)  # a Llama target has none
    with pytest.raises(ValueError, match="not an EAGLE draft"):
        spec_engine(paths, "EAGLE", "eagle3", CHAIN)  # an EAGLE3 head is no EAGLE v1 head
    with pytest.raises(ValueError, match="not an EAGLE3 draft"):
        spec_engine(paths, "EAGLE3", "target", CHAIN)  # a 4-layer model is no EAGLE3 head
    other = write_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    wrong = write_tiny_eagle3_draft(tmp_path / "wrong", json.loads((other / "config.json")
                                                                   .read_text()))
    with pytest.raises(ValueError, match="target hidden states of width 96"):
        spec_engine({**paths, "wrong": wrong}, "EAGLE3", "wrong", CHAIN)
    with pytest.raises(FileNotFoundError):
        spec_engine({**paths, "gone": tmp_path / "missing"}, "EAGLE3", "gone", CHAIN)
    config = json.loads((paths["target"] / "config.json").read_text())
    vocab = config["vocab_size"]
    for name, fields, mask, message in [
            ("vocab", dict(vocab_size=vocab + 8), vocab - 1, "drafts over a vocabulary of 520"),
            ("mask", {}, vocab, f"DSpark head's mask token {vocab} is outside"),
            ("wide", dict(hidden_size=96), None, "DSpark head is for a target of hidden size 96")]:
        head = write_tiny_dspark_draft(tmp_path / name, {**config, **fields},
                                       mask_token_id=mask)
        with pytest.raises(ValueError, match=message):
            spec_engine({**paths, name: head}, "DSPARK", name, CHAIN)
    with pytest.raises(ValueError, match="DSPARK drafts at most 8 tokens deep"):
        spec_engine(paths, "DSPARK", "dspark", dict(speculative_num_steps=9,
                                                    speculative_eagle_topk=1))


@contextlib.contextmanager
def released_at_exit(event: threading.Event):
    """Sets `event` on the way out, so a failed assertion never leaves a held build job."""
    try:
        yield
    finally:
        event.set()


def test_a_batch_is_answered_while_its_bucket_builds_in_the_background(checkpoints,
                                                                       references):
    """Warm-up builds the prefills and the smallest batch bucket; a larger bucket is built
    on the background builder once a batch needs it, and until then the scheduler admits no
    more requests than built programs take. Here the builder is held: two requests are
    answered one at a time, as plain decoding answers them; released, it builds bucket 2
    (XLA:CPU: only once a batch needs it, for the memory mappings of test_process_maps),
    and the same two then run together without compiling on the serving thread. A
    grammar-constrained request likewise takes no masked round until its masked pair is
    built, and gives the same answer once it is."""
    paths = checkpoints["qwen3"]
    # The tree's shape every round (the adaptive policy may choose plain rounds, whose
    # choice follows timings, including those kept beside the executables by other tests).
    settings = {**BASE, "precompile_token_paddings": [16], "precompile_bs_paddings": [1, 2],
                "max_prefill_tokens": 16, "skip_server_warmup": False,
                "speculative_adaptive": False}
    held = threading.Event()
    with Engine(model_path=str(paths["target"]), speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(paths["eagle3"]), **TREE,
                **settings) as engine, released_at_exit(held):
        runtime = engine.runtime
        spec = runtime.spec_runner
        runtime.builder.submit("held", held.wait, priority=-1)
        batch_sizes = []
        round_of = spec.round
        spec.round = lambda rows, *args, **kw: (batch_sizes.append(len(rows.slots))
                                                or round_of(rows, *args, **kw))

        def answers() -> list[list[int]]:
            return [o["output_ids"] for o in engine.generate(
                input_ids=prompts()[:2], sampling_params=[greedy(n) for n in MAX_NEW[:2]])]

        assert answers() == references["qwen3"][:2]
        assert batch_sizes and max(batch_sizes) == 1, batch_sizes
        assert not spec_warmup.bucket_built(spec, 2)
        assert engine.get_server_info()["programs_building"] >= 2  # the held job and bucket 2
        held.set()
        assert runtime.builder.wait_idle(timeout=600) and spec_warmup.bucket_built(spec, 2)
        assert engine.get_server_info()["programs_building"] == 0
        batch_sizes.clear()
        compiled = engine.get_server_info()["num_compilations"]
        assert answers() == references["qwen3"][:2]
        assert max(batch_sizes) == 2
        assert engine.get_server_info()["num_compilations"] == compiled
        # A grammar-constrained request takes plain rounds until the masked pair is built.
        held.clear()
        runtime.builder.submit("held again", held.wait, priority=-1)
        masked = []
        masked_verify = spec.masked_verify
        spec.masked_verify = lambda *args, **kw: masked.append(1) or masked_verify(*args, **kw)
        constrained = dict(greedy(12), regex="[ab]{3,12}")
        before = engine.generate(input_ids=[7, 8, 9], sampling_params=constrained)
        assert not masked and not spec.masked_built(1)
        held.set()
        assert runtime.builder.wait_idle(timeout=600) and spec.masked_built(1)
        after = engine.generate(input_ids=[7, 8, 9], sampling_params=constrained)
        assert after["output_ids"] == before["output_ids"]
        assert set(before["text"]) <= {"a", "b"} and len(before["output_ids"]) >= 2
