"""Model-free drafting (NGRAM) by suffix decoding: the host-side statistics and the proposer.

Drafts come from text already seen, in two places: each request's own text (prompt and output
so far) and the outputs of recently finished requests (a bounded pool, oldest evicted first),
so a repeated answer or agent step drafts from the previous one (suffix decoding,
arXiv 2411.04975). The index is pure Python and runs on the host once per round per request
while the device computes the previous round.

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
tokens wins; a later candidate must beat the best so far by more than _SCORE_EPS, so float
rounding never decides and ties go to the longer match, then to the request's own text.

The data structure is a depth-bounded suffix trie (depth D = max_match + branch_length) that
is explicit only where text repeats (`suffix_trie.SuffixTrie`). Measured on one CPU core
(ShareGPT text, SmolLM2 tokenizer): a 2k-token prompt is indexed in 1.8 ms into ~1k nodes and
205 KiB, where a plain trie of depth 30 takes 63 ms, 46k nodes and 11.7 MiB; `extend` costs
1.2-2.6 us per token (up to 6 us on degenerate text such as one token repeated); `propose`
(16 nodes, depth 8) with 800k tokens of responses kept took 40-75 us on average, 0.2 ms at
the 99th percentile, before each structure's candidate matches were found by bisection
(`_MatchSearch`), which took code edits and chat (benchmark/bench_suffix_index.py, 7 nodes,
depth 6) from 87 to 52 us; kept responses cost 1.8 us per token to add and ~130 bytes per
token.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig
from sgl_jax.speculative.drafters.ngram.suffix_trie import Child, Handle, SuffixTrie

# A later candidate tree must score higher than the best by more than this to replace it:
# scores are sums of float products, and two equal trees reached by different arithmetic
# must not swap places on rounding.
_SCORE_EPS = 1e-9


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


@dataclass(frozen=True)
class _Candidate:
    score: float  # sum of path probabilities: expected accepted draft tokens
    nodes: list[tuple[int, int, float]]  # (token, parent index, path probability), in order


class SuffixIndex:
    """Suffix statistics of running requests and of recent responses; proposes draft trees.

    Keys are any hashable request ids. Per round: `extend` with the tokens a request
    committed, then `propose`.
    """

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config if config is not None else SuffixConfig()
        self.config.validate()
        self._requests: dict[Hashable, tuple[SuffixTrie, int]] = {}  # key -> (text, prompt len)
        self._responses = self._new_trie()
        self._kept: deque[tuple[int, int]] = deque()  # (start, length) per response, oldest first
        self._kept_tokens = 0
        self._caps: dict[tuple[int, int], list[int]] = {}  # (max_nodes, max_depth) -> caps

    def __contains__(self, key: Hashable) -> bool:
        return key in self._requests

    def __len__(self) -> int:
        """Requests indexed (running ones: a finished request leaves)."""
        return len(self._requests)

    @property
    def response_tokens(self) -> int:
        """Tokens of finished outputs currently kept (at most config.capacity)."""
        return self._kept_tokens

    def forget_responses(self) -> None:
        """Drop every kept output (a flushed cache); running requests keep their text."""
        self._responses = self._new_trie()
        self._kept.clear()
        self._kept_tokens = 0

    def add_request(self, key: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start a request's own structure from its prompt (i32[prompt_len], non-empty)."""
        if key in self._requests:
            raise ValueError(f"request {key!r} is already indexed")
        ids = _token_list(prompt_ids)
        if not ids:
            raise ValueError(f"request {key!r}: the prompt must have at least one token")
        text = self._new_trie()
        for token in ids:
            text.append(token)
        self._requests[key] = (text, len(ids))

    def extend(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Append committed output tokens (i32[k]: a round's accepted drafts and bonus)."""
        text = self._requests[key][0]
        for token in _token_list(token_ids):
            text.append(token)

    def finish(self, key: Hashable, *, record: bool = True) -> None:
        """The request ended: free its structure and, with `record`, keep its output (not its
        prompt) for later requests, evicting the oldest outputs beyond capacity. An output
        longer than the capacity keeps its first `capacity` tokens, the ones a repeat needs
        first. Pass record=False for an aborted request."""
        text, prompt_len = self._requests.pop(key)
        output = text.tokens[prompt_len:][: self.config.capacity]
        if record and output:
            self._remember(output)

    def propose(self, key: Hashable, max_nodes: int, max_depth: int) -> Proposal:
        """The best-scoring draft tree for the request, at most max_nodes nodes (root
        included) and max_depth tokens below the root; just the root where nothing matches."""
        return _to_proposal(*self.propose_nodes(key, max_nodes, max_depth), max_nodes)

    def propose_nodes(self, key: Hashable, max_nodes: int, max_depth: int
                      ) -> tuple[int, list[tuple[int, int, float]]]:
        """`propose`'s tree as its root token and the nodes below it, (token, parent index,
        path probability) in node order, for a caller that builds a batch's arrays at once."""
        if max_nodes < 1 or max_depth < 0:
            raise ValueError(f"max_nodes must be >= 1 and max_depth >= 0, "
                             f"got {max_nodes} and {max_depth}")
        own = self._requests[key][0]
        text = own.tokens
        caps = self._tree_caps(max_nodes, max_depth)
        tries = (own, self._responses)
        longest = min(self.config.max_match, len(text))
        searches = [_MatchSearch(trie, text, longest) for trie in tries]
        best = _Candidate(0.0, [])
        found = [search.next(self._shortest_useful(caps, best.score)) for search in searches]
        while any(found):
            m = max(hit[0] for hit in found if hit is not None)
            # A tree's score is at most its cap (path probabilities at one depth sum to at
            # most 1, and it has at most max_nodes - 1 nodes); caps shrink with m, so no
            # shorter match can win.
            if caps[m] <= best.score + _SCORE_EPS:
                break
            for slot, trie in enumerate(tries):  # at equal m, the request's own text first
                if found[slot] is None or found[slot][0] != m:
                    continue
                total, children = trie.continuations(found[slot][1])
                candidate = _grow(trie, children, total, self._draft_depth(m, max_depth),
                                  max_nodes - 1, self.config.min_token_prob)
                if candidate.score > best.score + _SCORE_EPS:
                    best = candidate
                found[slot] = searches[slot].next(self._shortest_useful(caps, best.score))
        return text[-1], best.nodes

    def _new_trie(self) -> SuffixTrie:
        return SuffixTrie(self.config.depth, self.config.bucket_size, self.config.min_token_prob)

    def _tree_caps(self, max_nodes: int, max_depth: int) -> list[int]:
        """caps[m]: the most a match of m tokens can score, min(its draft depth, nodes below
        the root); cached per shape. Non-decreasing in m."""
        key = (max_nodes, max_depth)
        caps = self._caps.get(key)
        if caps is None:
            caps = self._caps[key] = [min(self._draft_depth(m, max_depth), max_nodes - 1)
                                      for m in range(self.config.max_match + 1)]
        return caps

    def _shortest_useful(self, caps: list[int], best_score: float) -> int:
        """The shortest match whose tree could beat `best_score`."""
        for m in range(self.config.min_match, len(caps)):
            if caps[m] > best_score + _SCORE_EPS:
                return m
        return len(caps)

    def _draft_depth(self, match_len: int, max_depth: int) -> int:
        trusted = math.ceil(self.config.spec_factor * match_len + self.config.spec_offset)
        return max(0, min(max_depth, self.config.branch_length, trusted))

    @property
    def responses(self) -> SuffixTrie:
        """The trie of recent responses (read it; evict_oldest_response removes from it)."""
        return self._responses

    def evict_oldest_response(self) -> bool:
        """Drop the oldest recent response from the trie; False when none is kept."""
        if not self._kept:
            return False
        start, length = self._kept.popleft()
        self._responses.remove_text(start, length)
        self._kept_tokens -= length
        return True

    def _remember(self, output: list[int]) -> None:
        """Add one output to the recent responses, oldest evicted first to make room."""
        while self._kept and self._kept_tokens + len(output) > self.config.capacity:
            self.evict_oldest_response()
        self._kept.append((self._responses.add_text(output), len(output)))
        self._kept_tokens += len(output)


class _MatchSearch:
    """One structure's candidate matches, longest first: the lengths m whose match has more
    continuations than the match one token longer (with equal counts the occurrences are the
    same, and so is the tree, under a shallower cap). The count is non-increasing in m (each
    occurrence of the longer match is one of the shorter), so each next candidate is found
    by bisection: a few lookups instead of one per length."""

    def __init__(self, trie: SuffixTrie, text: list[int], longest: int) -> None:
        self.trie, self.text = trie, text
        self.upper = longest  # no candidate is left above this length
        self.floor = 0  # continuations of the last candidate: the next one needs more
        self._totals: dict[int, tuple[Handle | None, int]] = {}  # m -> (handle, count)

    def next(self, shortest: int) -> tuple[int, Handle] | None:
        """(m, handle) of the next candidate no shorter than `shortest`; None when none is."""
        low, high = shortest, self.upper
        if high < low or self._count(low) <= self.floor:
            self.upper = 0
            return None
        while low < high:  # invariant: count(low) > floor
            mid = (low + high + 1) // 2
            if self._count(mid) > self.floor:
                low = mid
            else:
                high = mid - 1
        handle, self.floor = self._totals[low]
        self.upper = low - 1
        return low, handle

    def _count(self, m: int) -> int:
        """Occurrences of the last m tokens that are followed by a token."""
        entry = self._totals.get(m)
        if entry is None:
            handle = self.trie.locate(self.text[len(self.text) - m:])
            entry = (handle, self.trie.total(handle) if handle is not None else 0)
            self._totals[m] = entry
        return entry[1]


def _grow(trie: SuffixTrie, root_children: list[Child], root_total: int, max_depth: int,
          budget: int, min_prob: float) -> _Candidate:
    """Best-first draft tree under a located match.

    Pops nodes in the order (-path probability, depth, parent's index, token). A child's key
    is greater than its parent's (probability no larger, depth larger), so the pops come out
    sorted: the first `budget` pops are the best `budget` nodes, closed under ancestors.
    """
    heap = []
    for count, token, handle in root_children:  # the most frequent first
        prob = count / root_total  # the root's path probability is 1
        if prob < min_prob:
            break
        heap.append((-prob, 1, 0, token, handle))
    heapq.heapify(heap)
    nodes: list[tuple[int, int, float]] = []
    score = 0.0
    while heap and len(nodes) < budget:
        neg_prob, depth, parent, token, handle = heapq.heappop(heap)
        prob = -neg_prob
        nodes.append((token, parent, prob))
        score += prob
        if depth >= max_depth:
            continue
        total, children = trie.continuations(handle)
        for count, child_token, child_handle in children:
            child_prob = prob * (count / total)
            if child_prob < min_prob:
                break
            heapq.heappush(heap, (-child_prob, depth + 1, len(nodes), child_token, child_handle))
    return _Candidate(score, nodes)


def proposal_lists(root_token: int, nodes: list[tuple[int, int, float]], max_nodes: int
                   ) -> tuple[list[int], list[int], list[float]]:
    """A Proposal's tokens, parents and probabilities as lists of max_nodes each (the root,
    `propose_nodes`' nodes, then padding)."""
    pad = max_nodes - 1 - len(nodes)
    tokens = [root_token] + [token for token, _, _ in nodes] + [0] * pad
    parents = [-1] + [parent for _, parent, _ in nodes] + [-1] * pad
    probs = [1.0] + [prob for _, _, prob in nodes] + [0.0] * pad
    return tokens, parents, probs


def _to_proposal(root_token: int, nodes: list[tuple[int, int, float]], max_nodes: int
                 ) -> Proposal:
    tokens, parents, probs = proposal_lists(root_token, nodes, max_nodes)
    return Proposal(tokens=np.array(tokens, np.int32), parents=np.array(parents, np.int32),
                    probs=np.array(probs, np.float32))


def _token_list(token_ids: Sequence[int]) -> list[int]:
    """Token ids (a sequence or an integer array) as a list of non-negative Python ints."""
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]
    if ids and min(ids) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(ids)}")
    return ids
