"""NGRAM: drafts from the text itself, no weights (suffix decoding).

Two halves. On the host, `NgramProposer` keeps each request's text and recent responses in
a SuffixIndex and, as each round is launched, proposes a token trie of likely continuations
rooted at the last token the host has read (`NgramHints`). On the device, `NgramDrafter`
aligns that trie with the tokens the round in flight committed meanwhile (ngram/alignment.py), which
gives the round's tree; verification is the same as for every drafter (a deterministic draft
is a point mass: a node is accepted with the target's probability of its token).

How far behind the host is, per row (`NgramHints.behind`): 0 when nothing is in flight (the
proposal's root is the round's root), 1 when a one-token step is in flight (a prefill's first
token or a plain step: the run is the slot's last token), 2 when a round is in flight (the run
is what that round committed, kept in the slot by `advance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.drafters.ngram.alignment import align_proposals
from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig
from sgl_jax.speculative.drafters.ngram.suffix_index import SuffixIndex, load_compiled_code
from sgl_jax.speculative.round.tree import DraftTree
from sgl_jax.speculative.spec_config import TreeShape

IN_STEP, IN_ROUND = 1, 2  # NgramHints.behind: what is in flight for the row


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NgramHints:
    """The host's proposals for a round's rows (RoundRows.hints), padded to the bucket B."""

    tokens: np.ndarray  # i32[B, M]: each row's trie, node 0 = the last token the host read
    parents: np.ndarray  # i32[B, M]: -1 for the root and for unused nodes
    behind: np.ndarray  # i32[B]: 0, IN_STEP or IN_ROUND (see the module's docstring)
    scores: np.ndarray  # f32[B, M]: each node's log path probability from node 0 (the
    # text's counts: DraftTree.scores once re-rooted)


def proposal_shape(shapes: Sequence[TreeShape]) -> tuple[int, int]:
    """(M, depth) of the host's tries: deep enough for the run the host has not seen (up to
    S+1 tokens) and a full draft below it, with nodes for both."""
    steps = max(s.num_steps for s in shapes)
    nodes = max(s.num_draft_tokens for s in shapes)
    return 2 * nodes + steps + 1, 2 * steps + 1


class NgramDrafter:
    """The device half: no weights, no cache; each slot keeps the run its last round
    committed ([count, tokens...], i32[S+2])."""

    features = ""
    capture_layers = ()
    defers = False
    advances_on_plain = False  # a plain step's one token is the slot's last token
    full_depth = False  # a tree reaches as deep as the text's statistics go
    pairs_next_token = False
    slot_dtype = jnp.int32

    def __init__(self, shapes: Sequence[TreeShape]):
        self.run_width = max(s.num_steps for s in shapes) + 1
        self.slot_width = 1 + self.run_width
        self.num_proposal_nodes, _ = proposal_shape(shapes)
        self.params: dict = {}
        self.cache = None  # no cache: the slot's run is all it keeps

    def reach(self, shape: TreeShape) -> int:
        return 0  # no draft windows: only the verify window writes past kv_len

    def chains(self, shape: TreeShape) -> bool:
        return False  # the text's statistics decide the tree, whatever topk says

    def idle_hints(self, batch: int) -> NgramHints:
        m = self.num_proposal_nodes
        return NgramHints(np.zeros((batch, m), np.int32), np.full((batch, m), -1, np.int32),
                          np.zeros(batch, np.int32), np.zeros((batch, m), np.float32))

    def prefill(self, params, kv, batch, features, next_ids, run):
        return jnp.zeros((batch.logits_indices.shape[0], self.slot_width), jnp.int32), kv

    def propose(self, params, kv, inputs, page_table, state_slots, hints: NgramHints, *,
                shape: TreeShape) -> tuple[DraftTree, list]:
        roots = inputs.root_tokens
        stored_len, stored = inputs.draft[:, 0], inputs.draft[:, 1:]
        last = jnp.zeros_like(stored).at[:, 0].set(roots)
        run = jnp.where((hints.behind == IN_ROUND)[:, None], stored, last)
        run_len = jnp.select([hints.behind == IN_ROUND, hints.behind == IN_STEP],
                             [stored_len, jnp.ones_like(stored_len)], 0)
        tree = align_proposals(hints.tokens, hints.parents, run, run_len, roots,
                               num_nodes=shape.num_draft_tokens, max_depth=shape.num_steps,
                               scores=hints.scores)
        return tree, kv

    def advance(self, params, kv, tree, verified, inputs, page_table, state_slots):
        """Keep the committed run (accepted tokens, then the bonus) for the next round's
        alignment."""
        verdict = verified.verdict
        tokens = verdict.tokens  # i32[B, S+1]
        pad = self.run_width - tokens.shape[1]
        run = jnp.pad(tokens, ((0, 0), (0, pad)))
        return jnp.concatenate([(verdict.num_accepted + 1)[:, None], run], axis=1), kv

    def catch_up(self, params, kv, tokens, features, page_table, start, valid):
        raise NotImplementedError("NGRAM never defers: it keeps no draft to catch up")


class NgramProposer:
    """The host half: the suffix statistics of every request's text and of recent responses,
    fed as tokens are read, asked for a trie as each round is launched."""

    on_host = True

    def __init__(self, config: SuffixConfig, shapes: Sequence[TreeShape]):
        self.index = SuffixIndex(config)
        self.num_nodes, self.depth = proposal_shape(shapes)
        load_compiled_code()

    def add_request(self, req: Req) -> None:
        """From its first admission on (a retracted request is admitted again)."""
        if req.rid not in self.index:
            self.index.add_request(req.rid, req.prompt_ids)

    def extend(self, emitted: Sequence[tuple[Req, list[int], bool]]) -> None:
        runs = [(req.rid, tokens) for req, tokens, _ in emitted
                if tokens and req.rid in self.index]
        if runs:
            self.index.extend_many(*zip(*runs, strict=True))

    def finish(self, req: Req) -> None:
        """A finished request's output joins the recent responses; an aborted one's does
        not."""
        if req.rid in self.index:
            aborted = (req.finish_reason or {}).get("type") == "abort"
            self.index.finish(req.rid, record=not aborted)

    def flush(self) -> None:
        self.index.forget_responses()

    def hints(self, reqs: Sequence[Req], padded: int) -> NgramHints:
        """Each request's trie from the text read so far, padded to `padded` rows (one
        compiled call for the batch)."""
        m, n = self.num_nodes, len(reqs)
        tokens = np.zeros((padded, m), np.int32)
        parents = np.full((padded, m), -1, np.int32)
        probs = np.zeros((padded, m), np.float64)  # padding rows: no nodes, scores 0
        self.index.propose_into([req.rid for req in reqs], self.depth, tokens, parents, probs)
        scores = np.log(np.maximum(probs.astype(np.float32), 1e-30))
        scores[n:] = 0.0
        behind = np.zeros(padded, np.int32)
        behind[:n] = [(IN_ROUND if req.inflight_extra else IN_STEP) if req.num_inflight else 0
                      for req in reqs]
        return NgramHints(tokens, parents, behind, scores)

    def offered(self, hints: NgramHints, rows: int) -> list[bool]:
        """Whether each request's trie holds more than its root."""
        return (hints.parents[:rows, 1:] >= 0).any(axis=1).tolist()
