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
is explicit only where text repeats: a node that more than `bucket_size` suffixes pass through
has a dict of children; a rarer one keeps the start positions of its suffixes (a "bucket")
and everything below it is read from the token list itself. Counts are exact either way;
buckets bound how many positions a lookup scans (bucket_size) and cut the nodes from about
D per token (a plain trie) to well under one. See `_SuffixTrie`. Measured on one CPU core
(ShareGPT text, SmolLM2 tokenizer): a 2k-token prompt is indexed in 1.8 ms into ~1k nodes and
205 KiB, where a plain trie of depth 30 takes 63 ms, 46k nodes and 11.7 MiB; `extend` costs
1.2-2.6 us per token (up to 6 us on degenerate text such as one token repeated); `propose`
(16 nodes, depth 8) with 800k tokens of responses kept takes 40-75 us on average, 0.2 ms at
the 99th percentile; kept responses cost 1.8 us per token to add and ~130 bytes per token.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

# A later candidate tree must score higher than the best by more than this to replace it:
# scores are sums of float products, and two equal trees reached by different arithmetic
# must not swap places on rounding.
_SCORE_EPS = 1e-9

# Closes a text in a token list that holds several texts. Real tokens are >= 0, so no match
# and no continuation runs across it.
_END = -1


@dataclass(frozen=True)
class SuffixConfig:
    """What the NGRAM drafter may use; each field names the SGLang flag it is set from."""

    # --speculative-ngram-min-match-window-size: the shortest suffix of the request's text
    # that may be matched (1 lets a single token's successors draft).
    min_match: int = 1
    # --speculative-ngram-max-match-window-size: the longest suffix matched (SGLang's
    # default). A match of m tokens drafts at most ceil(spec_factor * m + spec_offset)
    # tokens, so with the defaults this also bounds the draft's depth (13).
    max_match: int = 12
    # --speculative-ngram-branch-length: the deepest draft (tokens after the root) the
    # structures can supply. In SGLang it bounds the branch stored in its trie (match and
    # draft together); here the stored depth is max_match + branch_length, so the longest
    # match can still draft this deep. SGLang's default; with the other defaults drafts stop
    # at 13 anyway, and the deeper storage costs little (nodes exist only where text repeats).
    branch_length: int = 18
    # --speculative-ngram-capacity: tokens of finished requests' outputs kept for drafting;
    # the oldest outputs are evicted first. About 130 bytes of host memory per token.
    capacity: int = 1_000_000
    # A draft node is kept only while its path probability is at least this (suffix
    # decoding's default): below it a node is more likely to waste its tree slot.
    min_token_prob: float = 0.1
    # A match of m tokens drafts at most ceil(spec_factor * m + spec_offset) tokens. A match
    # is the only evidence for its continuation, and a rare one makes its continuation look
    # certain (seen once -> every path probability 1), so the draft is kept about as long as
    # the context that found it. Suffix decoding uses (1.0, 0.0); one token more (offset 1)
    # accepted 12% more tokens per round on fresh ShareGPT chats (0.65 vs 0.58, 16 nodes,
    # depth 8, 500 earlier answers kept) and 1% more on repeated answers: a round's tree
    # costs the device the same however full it is, and min_token_prob still prunes.
    spec_factor: float = 1.0
    spec_offset: float = 1.0
    # Internal: a trie node keeps explicit children once more than this many suffixes pass
    # through it. Changes speed and memory, never a draft.
    bucket_size: int = 8

    @property
    def depth(self) -> int:
        """Longest string the structures count: a full match plus the deepest draft."""
        return self.max_match + self.branch_length

    def validate(self) -> None:
        _check_int("max_match", self.max_match, 1, 256, "--speculative-ngram-max-match-window-size")
        _check_int("min_match", self.min_match, 1, self.max_match,
                   "--speculative-ngram-min-match-window-size")
        _check_int("branch_length", self.branch_length, 1, 256, "--speculative-ngram-branch-length")
        _check_int("capacity", self.capacity, 0, 1 << 31, "--speculative-ngram-capacity")
        _check_float("min_token_prob", self.min_token_prob, 0.0, 1.0)
        _check_float("spec_factor", self.spec_factor, 0.0, 256.0)
        _check_float("spec_offset", self.spec_offset, -256.0, 256.0)
        _check_int("bucket_size", self.bucket_size, 1, 1 << 16, None)


def _check_int(name: str, value: object, low: int, high: int, flag: str | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        where = f" ({flag})" if flag else ""
        raise ValueError(f"SuffixConfig.{name}{where} must be an integer in [{low}, {high}], "
                         f"got {value!r}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"SuffixConfig.{name} must be a number in [{low}, {high}], "
                         f"got {value!r}")


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


# A located string: (node id, None, depth) for a string the trie has a node for, else
# (-1, the start positions of its occurrences, depth).
_Handle = tuple[int, Sequence[int] | None, int]
# One continuation of a located string: (occurrences of string + token, token, its handle).
_Child = tuple[int, int, _Handle]

# An explicit node with more children than this keeps a record of its frequent ones, so a
# lookup does not walk every child of a common token (thousands, in recent responses).
_WIDE = 16


class _SuffixTrie:
    """Counts of every string of length <= depth in a token list holding one or more texts.

    Every position p starts a suffix; its path from the root spells tokens[p:], cut at the
    depth limit, at the end of its text (a closed text ends with _END) or at the end of the
    token list (a growing text). Each node on the path counts it, so a node's count is the
    number of occurrences of its string. A node is one of three kinds:

    - explicit: more than bucket_size suffixes passed through it; `_children[n]` maps each
      next token to a child node, and `_total[n]` is the sum of the children's counts (the
      occurrences followed by a token);
    - bucket: `_starts[n]` holds the start positions of its suffixes (at most bucket_size),
      and everything below it is read from `tokens`;
    - count-only: a node at the depth limit, which no lookup goes below.

    A start is stored once: in the bucket its path enters or, while its path ends exactly at
    an explicit node of a growing text, in `_active`, so the next token moves it one node
    down. Nodes are integer ids into parallel lists, and children maps and buckets hold only
    ints (dicts and tuples), so a structure of a million tokens adds almost nothing for the
    cyclic garbage collector to traverse. Ids of removed nodes are reused.

    Lookups only need continuations with count / total >= min_fraction (a path probability
    is at most 1). A wide node's record [t0, threshold, {token: child}] holds every child
    whose count is at least threshold = min_fraction * t0 / 2, which covers all the needed
    ones while the node's total stays within [t0 / 2, 2 * t0]; outside, the next lookup
    rebuilds it. So a rebuild, which reads every child, follows at least t0 / 2 changes.

    Positions are absolute: the oldest texts can be dropped from the front of `tokens`
    (`base` is the position of tokens[0]) without renumbering the starts.
    """

    def __init__(self, depth: int, bucket_size: int, min_fraction: float) -> None:
        self.depth = depth
        self.bucket_size = bucket_size
        self.min_fraction = min_fraction
        self.tokens: list[int] = []
        self.base = 0
        self._count: list[int] = [0]  # node 0 is the root (the empty string), explicit
        self._total: list[int] = [0]
        self._children: list[dict[int, int] | None] = [{}]
        self._starts: list[tuple[int, ...] | None] = [None]
        self._free: list[int] = []
        self._wide: dict[int, list] = {}  # node -> [t0, threshold, {token: child}]
        self._active: list[tuple[int, int]] = []  # (start, explicit node its path ends at)

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    def append(self, token: int) -> None:
        """Extend the growing text by one token: every suffix in `_active`, and the new
        one-token suffix, moves one node down."""
        pos = self.base + len(self.tokens)
        self.tokens.append(token)
        children, starts = self._children, self._starts
        active, self._active = self._active, []
        active.append((pos, 0))
        for start, node in active:
            depth = pos - start + 1
            child = self._count_child(node, token, depth)
            if children[child] is not None:
                self._active.append((start, child))
                continue
            bucket = starts[child]
            if bucket is None:  # count-only
                continue
            bucket += (start,)
            if len(bucket) > self.bucket_size:
                starts[child] = None
                self._burst(child, depth, bucket)
            else:
                starts[child] = bucket

    def add_text(self, tokens: Sequence[int]) -> int:
        """Append a whole, finished text; returns its start position."""
        start = self.base + len(self.tokens)
        for token in tokens:
            self.append(token)
        self.tokens.append(_END)
        self._active = []  # no suffix of a finished text grows
        return start

    def remove_text(self, start: int, length: int) -> None:
        """Remove the oldest text (at `start`, `length` tokens) and every count it added."""
        for pos in range(start, start + length):
            self._forget(pos)
        dead = start + length + 1 - self.base  # its tokens and its _END
        if 2 * dead > len(self.tokens):  # drop the dead front once it is most of the list
            del self.tokens[:dead]
            self.base += dead

    def locate(self, pattern: Sequence[int]) -> _Handle | None:
        """The occurrences of `pattern` (1 <= len < depth), or None where there are none."""
        node = 0
        for k, token in enumerate(pattern):
            kids = self._children[node]
            if kids is None:
                return self._scan(self._starts[node], k, pattern)
            node = kids.get(token)
            if node is None:
                return None
        return (node, None, len(pattern))

    def continuations(self, handle: _Handle) -> tuple[int, list[_Child]]:
        """(total, children) of a located string: how many of its occurrences are followed by
        a token, and (count, token, handle) for each token with count / total >= min_fraction,
        the most frequent first (equal counts in no particular order)."""
        node, starts, depth = handle
        if node >= 0:
            if self._children[node] is not None:
                return self._explicit_continuations(node, depth)
            starts = self._starts[node] or ()  # a count-only node is never expanded
        groups: dict[int, list[int]] = {}
        tokens, offset = self.tokens, depth - self.base
        size = len(tokens)
        for start in starts:
            i = start + offset
            if i < size and tokens[i] >= 0:
                groups.setdefault(tokens[i], []).append(start)
        total = sum(len(group) for group in groups.values())
        children = [(len(group), token, (-1, group, depth + 1))
                    for token, group in groups.items()
                    if len(group) / total >= self.min_fraction]
        children.sort(key=_by_count, reverse=True)
        return total, children

    def _explicit_continuations(self, node: int, depth: int) -> tuple[int, list[_Child]]:
        counts, total = self._count, self._total[node]
        if total == 0:
            return 0, []
        pool = self._children[node]
        if len(pool) > _WIDE:
            record = self._wide.get(node)
            if record is None or not record[0] <= 2 * total <= 4 * record[0]:
                record = self._wide[node] = self._wide_record(pool, total)
            pool = record[2]
        children = [(counts[child], token, (child, None, depth + 1))
                    for token, child in pool.items() if counts[child] / total >= self.min_fraction]
        children.sort(key=_by_count, reverse=True)
        return total, children

    def _wide_record(self, kids: dict[int, int], total: int) -> list:
        # Less a margin, so that float rounding never leaves out a child at the boundary.
        threshold = self.min_fraction * total / 2 - 1e-6
        counts = self._count
        return [total, threshold, {t: c for t, c in kids.items() if counts[c] >= threshold}]

    def _count_child(self, node: int, token: int, depth: int) -> int:
        """Count one more occurrence of explicit `node`'s string followed by `token` (the
        child is at `depth`); returns the child, created if new."""
        kids = self._children[node]
        child = kids.get(token)
        if child is None:
            child = kids[token] = self._new_node(depth)
        self._count[child] += 1
        self._total[node] += 1
        record = self._wide.get(node)
        if record is not None and self._count[child] >= record[1]:
            record[2][token] = child
        return child

    def _scan(self, starts: Sequence[int], k: int, pattern: Sequence[int]) -> _Handle | None:
        """The starts in a bucket at depth k whose tokens continue with pattern[k:]."""
        tail, end, tokens, base = list(pattern[k:]), len(pattern), self.tokens, self.base
        found = [s for s in starts if tokens[s + k - base:s + end - base] == tail]
        return (-1, found, end) if found else None

    def _new_node(self, depth: int) -> int:
        bucket = () if depth < self.depth else None
        if self._free:
            node = self._free.pop()
            self._count[node], self._total[node] = 0, 0
            self._children[node], self._starts[node] = None, bucket
            return node
        self._count.append(0)
        self._total.append(0)
        self._children.append(None)
        self._starts.append(bucket)
        return len(self._count) - 1

    def _burst(self, node: int, depth: int, bucket: tuple[int, ...]) -> None:
        """Make a full bucket explicit: its starts move one node down."""
        kids: dict[int, int] = {}
        self._children[node] = kids
        starts, tokens = self._starts, self.tokens
        offset, size = depth - self.base, len(tokens)
        keep = depth + 1 < self.depth  # the children are buckets, not count-only
        for start in bucket:
            i = start + offset
            if i == size:  # its path ends here and the text is still growing
                self._active.append((start, node))
                continue
            if tokens[i] < 0:  # its text ended here
                continue
            child = self._count_child(node, tokens[i], depth + 1)
            if keep:
                starts[child] += (start,)
        for child in kids.values():
            full = starts[child]
            if full is not None and len(full) > self.bucket_size:
                starts[child] = None
                self._burst(child, depth + 1, full)

    def _forget(self, start: int) -> None:
        """Uncount one suffix of a finished text along its path; free nodes left empty."""
        counts, children, starts, tokens = self._count, self._children, self._starts, self.tokens
        node, i = 0, start - self.base
        while tokens[i] >= 0:
            token = tokens[i]
            child = children[node][token]
            counts[child] -= 1
            self._total[node] -= 1
            if counts[child] == 0:
                del children[node][token]
                record = self._wide.get(node)
                if record is not None:
                    record[2].pop(token, None)
                self._release(child)
                return
            if children[child] is None:
                bucket = starts[child]
                if bucket is not None:
                    starts[child] = tuple(s for s in bucket if s != start)
                return
            node, i = child, i + 1

    def _release(self, node: int) -> None:
        """Free a node whose count reached 0, and its subtree (counts 0 too)."""
        pending = [node]
        while pending:
            node = pending.pop()
            kids = self._children[node]
            if kids is not None:
                pending.extend(kids.values())
            self._children[node], self._starts[node] = None, None
            self._wide.pop(node, None)
            self._free.append(node)


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
        self._requests: dict[Hashable, tuple[_SuffixTrie, int]] = {}  # key -> (text, prompt len)
        self._responses = self._new_trie()
        self._kept: deque[tuple[int, int]] = deque()  # (start, length) per response, oldest first
        self._kept_tokens = 0

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
        if max_nodes < 1 or max_depth < 0:
            raise ValueError(f"max_nodes must be >= 1 and max_depth >= 0, "
                             f"got {max_nodes} and {max_depth}")
        own = self._requests[key][0]
        text = own.tokens
        best = _Candidate(0.0, [])
        last_total = [-1, -1]  # per structure: continuations of the match one token longer
        for m in range(min(self.config.max_match, len(text)), self.config.min_match - 1, -1):
            depth = self._draft_depth(m, max_depth)
            # A tree's score is at most its depth (path probabilities at one depth sum to at
            # most 1) and its size; depth only shrinks with m, so nothing shorter can win.
            if min(depth, max_nodes - 1) <= best.score + _SCORE_EPS:
                break
            pattern = text[len(text) - m:]
            for slot, trie in enumerate((own, self._responses)):
                handle = trie.locate(pattern)
                total, children = trie.continuations(handle) if handle is not None else (0, [])
                # The occurrences of the longer match are a subset of these; with equal
                # counts they are the same, and so is the tree, under a deeper cap: skip.
                same = total == last_total[slot]
                last_total[slot] = total
                if total == 0 or same:
                    continue
                candidate = _grow(trie, children, total, depth, max_nodes - 1,
                                  self.config.min_token_prob)
                if candidate.score > best.score + _SCORE_EPS:
                    best = candidate
        return _to_proposal(text[-1], best.nodes, max_nodes)

    def _new_trie(self) -> _SuffixTrie:
        return _SuffixTrie(self.config.depth, self.config.bucket_size, self.config.min_token_prob)

    def _draft_depth(self, match_len: int, max_depth: int) -> int:
        trusted = math.ceil(self.config.spec_factor * match_len + self.config.spec_offset)
        return max(0, min(max_depth, self.config.branch_length, trusted))

    def _remember(self, output: list[int]) -> None:
        """Add one output to the recent responses, oldest evicted first to make room."""
        while self._kept and self._kept_tokens + len(output) > self.config.capacity:
            start, length = self._kept.popleft()
            self._responses.remove_text(start, length)
            self._kept_tokens -= length
        self._kept.append((self._responses.add_text(output), len(output)))
        self._kept_tokens += len(output)


def _grow(trie: _SuffixTrie, root_children: list[_Child], root_total: int, max_depth: int,
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


def _to_proposal(root_token: int, nodes: list[tuple[int, int, float]], max_nodes: int
                 ) -> Proposal:
    tokens = np.zeros(max_nodes, np.int32)
    parents = np.full(max_nodes, -1, np.int32)
    probs = np.zeros(max_nodes, np.float32)
    tokens[0], probs[0] = root_token, 1.0
    for i, (token, parent, prob) in enumerate(nodes, start=1):
        tokens[i], parents[i], probs[i] = token, parent, prob
    return Proposal(tokens=tokens, parents=parents, probs=probs)


def _by_count(child: _Child) -> int:
    return child[0]


def _token_list(token_ids: Sequence[int]) -> list[int]:
    """Token ids (a sequence or an integer array) as a list of non-negative Python ints."""
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]
    if ids and min(ids) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(ids)}")
    return ids
