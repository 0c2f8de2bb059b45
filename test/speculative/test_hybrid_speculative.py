"""Speculative decoding on a hybrid target (the tiny Qwen3-Next: Gated DeltaNet layers with a
recurrent state per request, gated attention at layers 3 and 7): greedy output with an EAGLE3
head, with a random DSpark head, with the target's own multi-token-prediction
module (NEXTN, fitted here to the target's text), with a DFlash head (fitted here, chains of
15) and with the target as its own
STANDALONE draft equals plain greedy (chain and topk > 1 tree, page sizes 1 and 16, batch
sizes 1 and 8) and every state slot comes back; the NEXTN, DFlash and self drafts are
accepted (a partly accepted chain rolls each state back to a node inside it); a verify
round whose trees hold the target's own greedy tokens (a tree, and a chain of 15 cut by a
wrong token) accepts them and commits, into each request's slot, the state that decoding
the accepted path one token at a time leaves; EAGLE3 captures attention layers' outputs
only, DFlash any layer's."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.layers import gated_delta_net
from sgl_jax.layers.sampler import NO_LOGPROBS, SamplingBatch
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import greedy_sampling_batch
from sgl_jax.models import llama_eagle3
from sgl_jax.models.loader import load_eagle3_draft
from sgl_jax.speculative.round.program import RoundInputs, packed_nodes, verify_trees
from sgl_jax.speculative.round.tree import DraftTree
from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.dflash import fit_dflash_draft, write_tiny_dflash_draft
from sgl_jax.testing.dspark import write_tiny_dspark_draft
from sgl_jax.testing.eagle3 import write_tiny_eagle3_draft
from sgl_jax.testing.engines import walk_away_mid_run
from sgl_jax.testing.mtp import fit_mtp_tensors
from sgl_jax.testing.parallel import run_subprocess

BASE = dict(dtype="float32", precompile_token_paddings=[16, 64], precompile_bs_paddings=[1, 8],
            max_prefill_tokens=64, chunked_prefill_size=32, skip_server_warmup=True)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)
LONG_CHAIN = dict(speculative_num_steps=15, speculative_eagle_topk=1)  # DFLASH's default
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=8)
LENGTHS = [3, 45, 12, 70, 5, 20, 9, 33]  # 45 and 70 take several prefill chunks
FIT_PROMPTS = np.random.default_rng(7).integers(3, 500, (16, 12)).tolist()
FIT_NEW_TOKENS = 32
MAX_NEW = [9, 5, 12, 4, 10, 6, 1, 8]


def greedy(n):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-spec")
    target = write_tiny_checkpoint(root / "qwen3_next", "qwen3_next")
    config = json.loads((target / "config.json").read_text())
    return {"target": target, "self": target,
            "eagle3": write_tiny_eagle3_draft(root / "eagle3", config),
            "dspark": write_tiny_dspark_draft(root / "dspark", config, markov_head="rnn",
                                              target_layer_ids=(1, 3, 6))}


@pytest.fixture(scope="module")
def references(paths):
    with Engine(model_path=str(paths["target"]), page_size=16, **BASE) as engine:
        batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in MAX_NEW])
        return [o["output_ids"] for o in batch]


@pytest.fixture(scope="module")
def fitted(paths):
    """The target's own MTP module, fitted to its greedy continuations of FIT_PROMPTS and
    written beside its weights (NEXTN loads it from there); returns those continuations."""
    return fit_mtp_tensors(paths["target"], FIT_PROMPTS, new_tokens=FIT_NEW_TOKENS, steps=200)


def spec_engine(paths, shape, page_size, draft="eagle3"):
    algorithm = {"eagle3": "EAGLE3", "nextn": "NEXTN", "dspark": "DSPARK"}.get(draft,
                                                                             "STANDALONE")
    path = {} if draft == "nextn" else {"speculative_draft_model_path": str(paths[draft])}
    return Engine(model_path=str(paths["target"]), speculative_algorithm=algorithm,
                  page_size=page_size, **path, **shape, **BASE)


def states_all_free(engine) -> bool:
    info = engine.get_server_info()
    return (info["state_slots_in_use"] == 0
            and engine.usage().all_pages_free)


@pytest.mark.parametrize("draft", ["eagle3", "dspark"])
def test_greedy_speculation_equals_plain_decoding(paths, references, draft):
    """A random EAGLE3 head (it reads the captured attention layers' outputs) and a random
    DSpark head (reading linear-attention layers too) as chains, page size 1; trees on this
    target are NEXTN's and the STANDALONE draft's cases."""
    with spec_engine(paths, CHAIN, 1, draft) as engine:
        alone = engine.generate(input_ids=prompts()[3], sampling_params=greedy(MAX_NEW[3]))
        assert alone["output_ids"] == references[3]  # batch size 1
        assert states_all_free(engine)
        batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                      MAX_NEW])
        assert [o["output_ids"] for o in batch] == references  # batch size 8
        assert states_all_free(engine)


def test_target_as_its_own_draft_accepts_a_full_path_every_round(paths, references):
    """A hybrid STANDALONE draft (the target itself) keeps its own states per request. A
    chain is its greedy path, accepted whole every round: every round commits the deepest
    node in the target's and the draft's state pools. (Trees of the target as its own draft
    commit deep nodes' states in test_qwen3_next's TP test; NEXTN's trees run at page 1.)"""
    with spec_engine(paths, CHAIN, 16, draft="self") as engine:
        outputs = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                        MAX_NEW])
        assert [o["output_ids"] for o in outputs] == references
        for out, n in zip(outputs, MAX_NEW, strict=True):
            meta = out["meta_info"]
            assert meta["spec_verify_ct"] == -(-(n - 1) // 4)  # the first is prefill's
            if n > 1:
                assert meta["spec_accept_length"] == 4.0
        assert states_all_free(engine)


@pytest.mark.parametrize("shape,page_size", [(CHAIN, 16), (TREE, 1)],
                         ids=["chain-page16", "tree-page1"])
def test_nextn_is_lossless_and_its_fitted_module_is_accepted(paths, fitted, references, shape,
                                                             page_size):
    """NEXTN with the module fitted to the target's own text (the seed's 3/1/4 chain, and a
    tree): the test batch equals plain greedy; the target's continuations of the prompts the
    module was fitted on come out as transformers decodes them, with drafts accepted (accept
    length above 1.5); aborts mid-run give every page and state slot back."""
    with spec_engine(paths, shape, page_size, draft="nextn") as engine:
        batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                      MAX_NEW])
        assert [o["output_ids"] for o in batch] == references
        before = engine.get_server_info()
        # As transformers decoded them: EOS suppressed to the end.
        own = engine.generate(input_ids=FIT_PROMPTS[:8], sampling_params=[{
            "temperature": 0, "max_new_tokens": FIT_NEW_TOKENS,
            "min_new_tokens": FIT_NEW_TOKENS}] * 8)
        assert [o["output_ids"] for o in own] == fitted[:8]
        info = engine.get_server_info()
        rounds = info["spec_verify_rounds"] - before["spec_verify_rounds"]
        accepted = info["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert 1 + accepted / rounds > 1.5, accepted / rounds
        walk_away_mid_run(engine, prompts()[:3])
        assert states_all_free(engine)


def test_nextn_over_tp_2(paths, fitted):
    """The MTP layer split over 2 devices as the target's layers are (its KV heads, experts'
    features, shared expert), on the text it was fitted to: greedy output as plain decoding
    gives it at TP 2, drafts accepted."""
    target = str(paths["target"])
    results = run_subprocess(["--model-path", target, "--draft-model-path", target,
                              "--draft-algorithm", "NEXTN", "--tp-sizes", "2",
                              "--prompts", json.dumps(FIT_PROMPTS[:4])], devices=2)
    assert results["speculative"][2]["output_ids"] == results["plain"][2]["output_ids"]
    assert results["speculative"][2]["accept_length"] > 1.3


def test_dflash_rolls_the_state_back_over_a_chain_of_15(paths, references, tmp_path):
    """A DFlash head with a block of 16 (chains of 15 drafts) reading linear-attention layers
    1 and 6 and attention layer 3, briefly fitted to the target's text: most rounds accept a
    part of the chain, so verify rolls each state back to a node inside it; the output is
    transformers' greedy text on the fitted prompts and plain greedy on the test batch, and
    every page and state slot comes back, after an abort too."""
    head = tmp_path / "dflash"
    continuations = fit_dflash_draft(head, paths["target"], FIT_PROMPTS[:4],
                                     new_tokens=FIT_NEW_TOKENS, block_size=16,
                                     target_layer_ids=(1, 3, 6), steps=20)
    # One bucket of each kind: two programs to compile (prefill and the 16-node round).
    one_bucket = {**BASE, "precompile_token_paddings": [64], "precompile_bs_paddings": [8]}
    with Engine(model_path=str(paths["target"]), speculative_algorithm="DFLASH",
                speculative_draft_model_path=str(head), page_size=16, **one_bucket) as engine:
        spec = engine.runtime.spec_runner
        assert spec.shape.num_steps == 15 and spec.capture_layers == (2, 4, 7)
        own = engine.generate(input_ids=FIT_PROMPTS[:4], sampling_params=[{
            "temperature": 0, "max_new_tokens": FIT_NEW_TOKENS,
            "min_new_tokens": FIT_NEW_TOKENS}] * 4)
        assert [o["output_ids"] for o in own] == continuations
        rounds = sum(o["meta_info"]["spec_verify_ct"] for o in own)
        per_depth = np.sum([o["meta_info"]["spec_accepted_per_position"] for o in own], axis=0)
        assert per_depth.sum() > rounds  # accept length above 2
        # Most rounds accept a part of the chain: 1 to 14 of its 15 drafts.
        assert per_depth[0] - per_depth[-1] > rounds // 2
        assert states_all_free(engine)
        batch = engine.generate(input_ids=prompts(), sampling_params=[greedy(n) for n in
                                                                      MAX_NEW])
        assert [o["output_ids"] for o in batch] == references
        walk_away_mid_run(engine, prompts()[:3])
        assert states_all_free(engine)


def test_capture_layers(paths, tmp_path):
    """EAGLE3 reads attention layers' outputs (its published hybrid head's convention);
    DFlash reads any layer's (the test above fits one to linear layers 1 and 6), and a layer
    the target lacks stops start-up."""
    from sgl_jax.models.loader import load_model
    target = load_model(str(paths["target"]), dtype="float32", progress=False).config
    draft = load_eagle3_draft(str(paths["eagle3"]), dtype="float32").config
    # Attention at 3 and 7: the default outputs 1, 3, 4 move to 3, 3, 7 (inputs of 4, 4, 8).
    assert llama_eagle3.target_capture_layers(8, draft, target=target) == (4, 4, 8)
    explicit = dataclasses.replace(draft, aux_layer_ids=(3, 7, 7))
    assert llama_eagle3.target_capture_layers(8, explicit, target=target) == (4, 8, 8)
    wrong = dataclasses.replace(draft, aux_layer_ids=(1, 3, 7))
    with pytest.raises(ValueError, match="linear-attention layers"):
        llama_eagle3.target_capture_layers(8, wrong, target=target)
    config = json.loads((paths["target"] / "config.json").read_text())
    head = write_tiny_dflash_draft(tmp_path / "dflash", config, target_layer_ids=(1, 8))
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 8\] name layers \[8\] that "
                                         r"the target does not have \(its layers are 0 to 7\)"):
        Engine(model_path=str(paths["target"]), speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(head), speculative_num_steps=7, **BASE)


def _pools(runner, slot):
    config = runner.config
    return [jax.tree.map(lambda a: np.asarray(a[slot]), runner.state.kv_cache.layer(i))
            for i in range(config.num_layers) if config.is_linear_layer(i)]


@pytest.mark.parametrize("shape,accepted,counts", [(LONG_CHAIN, (9, 5), None),
                                                   (TREE, (3, 3), None), (TREE, (2, 3), (3, 5))],
                         ids=["chain15", "tree", "tree-packed"])
def test_verify_commits_the_state_of_the_last_accepted_node(paths, references, shape,
                                                            accepted, counts):
    """Trees holding the target's own greedy continuation g1, g2, ...: a chain of 15 (DFLASH's
    length) whose token after g9 (g5 in the other row) is wrong, and a tree with decoys around
    its greedy path g1, g2, g3. Each row accepts its greedy tokens and commits the state that
    decoding the root, g1 ... ga one token at a time leaves: the chain's state is rolled back
    to a node inside it. Packed (per-request lengths), the tree is in best-first order and a
    row verifies its first `counts` nodes alone: the first row's share, root, g1, g2, stops
    its path at g2 (the bonus g3 read from g2's logits), the second's runs to g3."""
    with spec_engine(paths, shape, 16) as engine:
        runner, spec = engine.runtime.runner, engine.runtime.spec_runner
        ids = [prompts()[i] for i in (2, 5)]
        follow = [references[i] for i in (2, 5)]  # 12 and 6 greedy tokens
        n = spec.shape.num_draft_tokens
        slots = [engine.runtime.state_slots.allocate() for _ in range(4)]
        pages = [engine.runtime.allocator.allocate(8) for _ in range(4)]
        # Slots 0, 1: the requests before verify; 2, 3: the same prompts decoded plainly.
        runner.forward([SeqChunk(p[:-1], 0, pages[j], state_slot=slots[j])
                        for j, p in enumerate(ids)])
        runner.forward([SeqChunk(p[:-1], 0, pages[j + 2], state_slot=slots[j + 2])
                        for j, p in enumerate(ids)])
        decoded = [None, None]  # each row's states after its root and accepted tokens
        for depth in range(max(accepted) + 1):  # a row past its accepted depth goes on
            runner.forward([SeqChunk([([p[-1]] + f)[min(depth, len(f))]], len(p) - 1 + depth,
                                     pages[j + 2], state_slot=slots[j + 2])
                            for j, (p, f) in enumerate(zip(ids, follow, strict=True))])
            for j in range(2):
                if depth == accepted[j]:
                    decoded[j] = _pools(runner, slots[j + 2])
        trees, paths_taken = [], []
        for p, f, a in zip(ids, follow, accepted, strict=True):
            if shape is LONG_CHAIN:  # root, g1 ... ga, a wrong token, more wrong ones
                wrong = [(f[a] + 1 + i) % 500 for i in range(n - 1 - a)]
                tokens, parents = [p[-1], *f[:a], *wrong], list(range(-1, n - 1))
                path = list(range(a + 1))
            elif counts:  # best first: the greedy path, then the decoys
                decoy = [(t + 1) % 500 for t in f[:3]]
                tokens = [p[-1], *f[:3], decoy[0], decoy[1], decoy[2], decoy[2]]
                parents, path = [-1, 0, 1, 2, 0, 1, 2, 4], list(range(a + 1))
            else:  # decoys beside and below the greedy path, which lies at nodes 0, 2, 4, 7
                decoy = [(t + 1) % 500 for t in f[:3]]
                tokens = [p[-1], decoy[0], f[0], decoy[1], f[1], decoy[2], decoy[2], f[2]]
                parents, path = [-1, 0, 0, 2, 2, 4, 3, 4], [0, 2, 4, 7]
            trees.append((tokens, parents))
            paths_taken.append(path)
        # verify_trees' arrays, padded to the batch bucket: padding rows read the null page.
        padded = spec.target.buckets.batch_padding(len(ids))
        page_table = np.zeros((padded, spec.target.buckets.pages_per_seq), np.int32)
        kv_lens = np.zeros(padded, np.int32)
        state_slots = np.zeros(padded, np.int32)
        for j, p in enumerate(ids):
            page_table[j, :len(pages[j])] = pages[j]
            kv_lens[j] = len(p) - 1
            state_slots[j] = slots[j]
        active = np.arange(padded) < len(ids)
        sampling = greedy_sampling_batch(padded, spec.vocab_size)
        suppress = np.zeros(padded, np.int32)
        assert isinstance(sampling, SamplingBatch)
        padding = [(trees[0][0], list(range(-1, n - 1)))] * (len(kv_lens) - len(trees))
        tree = DraftTree(*(np.array(part, np.int32) for part in zip(*trees, *padding,
                                                                      strict=True)))
        # a packed round of 2 nodes a row: each row's first counts[r] nodes, then padding
        packed = None if counts is None else packed_nodes(
            [*counts, *[0] * (padded - len(counts))], n, 2 * padded)

        def verify(params, kv, page_table, kv_lens, active, tree, sampling, suppress,
                   state_slots, packed):
            inputs = RoundInputs(active, kv_lens, tree.tokens[:, 0], None, sampling, suppress)
            return verify_trees(spec.forward, params, kv, page_table, inputs, tree,
                                np.int32(NO_LOGPROBS), state_slots,
                                num_steps=spec.shape.num_steps,
                                chain=spec.shape.topk == 1, page_size=spec.page_size,
                                thresholds=spec.thresholds, features="", packed=packed)

        kv, verified = jax.jit(verify)(runner.model.params, runner.state.kv_cache, page_table,
                                       kv_lens, active, tree, sampling, suppress, state_slots,
                                       packed)
        runner.state.kv_cache = kv
        verdict = jax.device_get(verified.verdict)
        for j, (f, a) in enumerate(zip(follow, accepted, strict=True)):
            assert verdict.num_accepted[j] == a
            assert verdict.path[j, : a + 1].tolist() == paths_taken[j]
            assert verdict.tokens[j, : a + 1].tolist() == f[: a + 1]  # the bonus: g(a+1)
            for committed, plain in zip(_pools(runner, slots[j]), decoded[j], strict=True):
                np.testing.assert_allclose(committed.conv, plain.conv, rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(committed.ssm, plain.ssm, rtol=1e-4, atol=1e-4)
        for slot in slots:
            engine.runtime.state_slots.free(slot)
        for page_ids in pages:
            engine.runtime.allocator.free(page_ids)
        assert isinstance(runner.state.kv_cache.layer(0), gated_delta_net.GdnState)
