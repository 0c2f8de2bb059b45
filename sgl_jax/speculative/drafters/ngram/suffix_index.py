"""Model-free drafting (NGRAM) by suffix decoding: the host-side statistics and the proposer.

Drafts come from text already seen, in two places: each request's own text (prompt and output
so far) and the outputs of recently finished requests (a bounded pool, oldest evicted first),
so a repeated answer or agent step drafts from the previous one (suffix decoding,
arXiv 2411.04975). The index runs on the host, once per round for the batch, while the device
computes the previous round.

The statistic. For a text set and a string Q, let N(Q, c) be the number of places where Q
occurs immediately followed by token c (inside one text; no match or continuation crosses
from one text into another). A node of a draft is a string Q = P + path, where P is a suffix
of the request's text (the matched context); its children are the tokens c with N(Q, c) > 0,
with conditional probabilities

    p(c | Q) = N(Q, c) / sum_c' N(Q, c')

The denominator counts only the occurrences of Q that have a continuation. So the request's
own pending occurrence of P (the end of its text, which has no continuation yet) and the ends
of finished texts are not read as "observed, and nothing followed": a phrase seen once before
drafts its continuation with probability 1, not 1/2, and deeper nodes near the end of the text
are not diluted either. A path's probability is the product of the conditional probabilities
along it, and the sum of path probabilities over a tree's non-root nodes is the number of draft
tokens verification is expected to accept if the text keeps behaving like its statistics.

The draft. For every match length m in [min_match, max_match] (longest first) and for each of
the two structures (the request's own first), the candidate tree for P = the last m tokens is
grown best-first by path probability: a node is kept while its path probability is at least
min_token_prob and its depth at most min(max_depth, branch_length, ceil(spec_factor * m +
spec_offset)), at most max_nodes - 1 nodes. The candidate with the largest expected number of
tokens wins; a later candidate must beat the best so far by more than SCORE_EPS, so float
rounding never decides and ties go to the longer match, then to the request's own text.

The data structure (text_chains.py, compiled): each text set is a token list in which every
position links to the previous occurrence of its token and of its last two tokens, so the
occurrences of a context are one chain walk away and counts are exact; the draft trees are
grown there too, one call for a whole batch (benchmark/bench_suffix_index.py measures it;
figures in docs/benchmarks/cpu.md).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from sgl_jax.speculative.drafters.ngram import text_chains
from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig

_CHAINS = numba.types.Array(numba.int32, 2, "C")  # a text set's i32[3, capacity]
_TABLE = numba.types.Array(numba.int64, 2, "C")  # its hash table, i64[2, capacity]


@dataclass(frozen=True)
class Proposal:
    """A token trie rooted at the request's last known token.

    A parent's index is smaller than its children's; siblings have distinct tokens; nodes
    after the root are ordered by descending path probability (ties: shallower first, then
    the parent's index, then the token id), so the first n nodes are closed under ancestors.
    """

    tokens: np.ndarray  # i32[max_nodes]: node 0 = the root; padding nodes hold 0
    parents: np.ndarray  # i32[max_nodes]: -1 for the root and for padding nodes
    probs: np.ndarray  # f32[max_nodes]: path probability root -> node; 1 at the root, 0 padding

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root included."""
        return 1 + int(np.count_nonzero(self.parents >= 0))

    @property
    def expected_tokens(self) -> float:
        """Expected accepted draft tokens: the sum of the non-root path probabilities."""
        return float(self.probs[1:].sum(dtype=np.float64))


class TextSet:
    """A growable token list with its occurrence chains (text_chains.py)."""

    def __init__(self, tokens: np.ndarray | None = None) -> None:
        self.chains = np.zeros((3, 64), np.int32)  # i32[3, capacity]
        self.table = text_chains.new_table(256)  # i64[2, capacity]
        self.size = 0  # positions used
        self.keys = 0  # hash-table entries used
        if tokens is not None:
            self.append(tokens)

    def append(self, tokens: np.ndarray) -> None:
        """Append i64[k] tokens (END closes a text)."""
        self.chains, self.table, self.size, self.keys = text_chains.appended(
            self.chains, self.table, self.size, self.keys, tokens)


class SuffixIndex:
    """Suffix statistics of running requests and of recent responses; proposes draft trees.

    Keys are any hashable request ids. Per round: `extend` with the tokens a request
    committed, then `propose` (one request) or `propose_into` (a batch, one compiled call).
    """

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config if config is not None else SuffixConfig()
        self.config.validate()
        # Running requests' texts, by slot: the compiled code reads them from typed lists.
        self._slots: dict[Hashable, int] = {}
        self._prompt_lens: dict[Hashable, int] = {}
        self._chains = numba.typed.List.empty_list(_CHAINS)
        self._tables = numba.typed.List.empty_list(_TABLE)
        self._sizes = np.zeros(0, np.int64)  # i64[slots]: each text's length
        self._keys = np.zeros(0, np.int64)  # i64[slots]: its hash-table entries
        self._free: list[int] = []
        self._new_pool()
        self._shapes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        """Requests indexed (running ones: a finished request leaves)."""
        return len(self._slots)

    @property
    def response_tokens(self) -> int:
        """Tokens of finished outputs currently kept (at most config.capacity)."""
        return self._kept_tokens

    @property
    def responses_held(self) -> int:
        """Positions the pool of recent responses holds: kept outputs, their ends, and
        evicted ones not dropped yet (at most about twice the kept ones)."""
        return self._pool.size

    def forget_responses(self) -> None:
        """Drop every kept output (a flushed cache); running requests keep their text."""
        self._new_pool()

    def add_request(self, key: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start a request's own text from its prompt (i32[prompt_len], non-empty)."""
        if key in self._slots:
            raise ValueError(f"request {key!r} is already indexed")
        ids = _token_array(prompt_ids)
        if not len(ids):
            raise ValueError(f"request {key!r}: the prompt must have at least one token")
        slot = self._free.pop() if self._free else self._new_slot()
        self._slots[key], self._prompt_lens[key] = slot, len(ids)
        text = TextSet(ids)
        self._chains[slot], self._tables[slot] = text.chains, text.table
        self._sizes[slot], self._keys[slot] = text.size, text.keys

    def extend(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Append committed output tokens (i32[k]: a round's accepted drafts and bonus)."""
        tokens = np.asarray(token_ids, np.int64).reshape(-1)
        text_chains.extend_texts(self._chains, self._tables, self._sizes, self._keys,
                                 np.array([self._slots[key]]), tokens,
                                 np.array([0, len(tokens)]))

    def extend_many(self, keys: Sequence[Hashable], runs: Sequence[Sequence[int]]) -> None:
        """`extend` for each request keys[r] with runs[r], in one compiled call."""
        slots = np.fromiter((self._slots[key] for key in keys), np.int64, len(keys))
        offsets = np.zeros(len(runs) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, runs), np.int64, len(runs)), out=offsets[1:])
        tokens = np.fromiter(itertools.chain.from_iterable(runs), np.int64, offsets[-1])
        text_chains.extend_texts(self._chains, self._tables, self._sizes, self._keys, slots,
                                 tokens, offsets)

    def finish(self, key: Hashable, *, record: bool = True) -> None:
        """The request ended: free its text and, with `record`, keep its output (not its
        prompt) for later requests, evicting the oldest outputs beyond capacity. An output
        longer than the capacity keeps its first `capacity` tokens, the ones a repeat needs
        first. Pass record=False for an aborted request."""
        slot = self._slots.pop(key)
        prompt_len = self._prompt_lens.pop(key)
        tokens = self._chains[slot][text_chains.TOKENS]
        output = tokens[prompt_len:self._sizes[slot]][: self.config.capacity]
        if record and len(output):
            self._remember(output.astype(np.int64))
        self._chains[slot], self._tables[slot] = _EMPTY_CHAINS, _EMPTY_TABLE
        self._free.append(slot)

    def propose(self, key: Hashable, max_nodes: int, max_depth: int) -> Proposal:
        """The best-scoring draft tree for the request, at most max_nodes nodes (root
        included) and max_depth tokens below the root; just the root where nothing matches."""
        tokens, parents = np.empty((2, 1, max_nodes), np.int32)
        probs = np.empty((1, max_nodes), np.float64)
        self.propose_into([key], max_depth, tokens, parents, probs)
        return Proposal(tokens[0], parents[0], probs[0].astype(np.float32))

    def propose_into(self, keys: Sequence[Hashable], max_depth: int, tokens: np.ndarray,
                     parents: np.ndarray, probs: np.ndarray) -> None:
        """`propose` for each request keys[r] into row r of tokens, parents (i32[B, M]) and
        probs (f64[B, M]), M = max_nodes, B >= len(keys): rows past the keys are left as
        they are."""
        max_nodes = tokens.shape[1]
        if max_nodes < 1 or max_depth < 0:
            raise ValueError(f"max_nodes must be >= 1 and max_depth >= 0, "
                             f"got {max_nodes} and {max_depth}")
        slots = np.fromiter((self._slots[key] for key in keys), np.int64, len(keys))
        caps, depths = self._tree_limits(max_nodes, max_depth)
        pool = self._pool
        text_chains.propose_rows(
            self._chains, self._tables, self._sizes, slots, pool.chains, pool.size, pool.table,
            self._dead, caps, depths, self.config.min_match, self.config.min_token_prob,
            tokens, parents, probs)

    def evict_oldest_response(self) -> bool:
        """Drop the oldest recent response; False when none is kept."""
        if not self._kept:
            return False
        start, length = self._kept.popleft()
        self._dead = start + length + 1  # its tokens and its END
        self._kept_tokens -= length
        if 2 * self._dead > self._pool.size:  # drop the dead front once it is most of the list
            self._compact_pool()
        return True

    def _tree_limits(self, max_nodes: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(caps, depths), i64[max_match + 1] each, cached per shape: the draft depth of a
        match of m tokens, and the most its tree can score, min(its depth, nodes below the
        root). Non-decreasing in m."""
        key = (max_nodes, max_depth)
        if key not in self._shapes:
            depths = np.array([self._draft_depth(m, max_depth)
                               for m in range(self.config.max_match + 1)], np.int64)
            self._shapes[key] = (np.minimum(depths, max_nodes - 1), depths)
        return self._shapes[key]

    def _draft_depth(self, match_len: int, max_depth: int) -> int:
        trusted = math.ceil(self.config.spec_factor * match_len + self.config.spec_offset)
        return max(0, min(max_depth, self.config.branch_length, trusted))

    def _new_slot(self) -> int:
        slot = len(self._chains)
        self._chains.append(_EMPTY_CHAINS)
        self._tables.append(_EMPTY_TABLE)
        if slot >= len(self._sizes):
            more = np.zeros(max(slot, 8), np.int64)
            self._sizes, self._keys = (np.concatenate([self._sizes, more]),
                                       np.concatenate([self._keys, more]))
        return slot

    def _new_pool(self) -> None:
        self._pool = TextSet()
        self._dead = 0  # pool positions below this belong to evicted responses
        self._kept: deque[tuple[int, int]] = deque()  # (start, length) per response, oldest first
        self._kept_tokens = 0

    def _remember(self, output: np.ndarray) -> None:
        """Add one output (i64[k]) to the recent responses, oldest evicted first to make
        room."""
        while self._kept and self._kept_tokens + len(output) > self.config.capacity:
            self.evict_oldest_response()
        start = self._pool.size
        self._pool.append(np.append(output, text_chains.END))
        self._kept.append((start, len(output)))
        self._kept_tokens += len(output)

    def _compact_pool(self) -> None:
        """Rebuild the pool from its live positions (the kept responses)."""
        dead, pool = self._dead, self._pool
        self._pool = TextSet(pool.chains[text_chains.TOKENS, dead:pool.size].astype(np.int64))
        self._kept = deque((start - dead, length) for start, length in self._kept)
        self._dead = 0


def load_compiled_code() -> None:
    """Compile (or load from numba's cache) the compiled half by using it once, so the first
    round does not wait for it (about 10 s uncached, under a second cached)."""
    index = SuffixIndex(SuffixConfig(capacity=4))
    index.add_request("first", [1, 2, 1, 2])
    index.extend("first", list(range(100)))  # outgrows the first hash table: relinks
    index.finish("first")
    index.add_request("second", [1, 2])
    index.propose("second", 2, 1)


_EMPTY_CHAINS = np.zeros((3, 1), np.int32)
_EMPTY_TABLE = text_chains.new_table(1)


def _token_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids (a sequence or an integer array) as i64[k], each checked >= 0."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    if len(ids) and ids.min() < 0:
        raise ValueError(f"token ids must be >= 0, got {int(ids.min())}")
    return ids
