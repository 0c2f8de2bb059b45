"""The compiled half of NGRAM's index (suffix_index.py): token lists that find every earlier
occurrence of their own last tokens, and the best-first draft tree under those occurrences.

A text set is a token list (texts separated by END) with, per position e, a link to the
previous position holding the same token (`LAST1`) and to the previous one ending in the same
two tokens (`LAST2`); a hash table maps a token, or a pair of tokens, to its latest position.
So the occurrences of a context are found by walking one chain, newest first, and counts are
exact: no occurrence is summarised or dropped. Positions below `dead` belong to evicted texts;
walks stop there, since every chain runs from newer to older positions.

Everything here is numba-compiled (cached on disk next to this file) and releases the GIL: a
batch's proposals cost one call, not a Python pass per node.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

END = -1  # closes a text in a token list holding several; real tokens are >= 0
EMPTY = -1  # a free hash-table key
TOKENS, LAST1, LAST2 = 0, 1, 2  # rows of a chains array, i32[3, capacity]
# A later candidate tree must score higher than the best by more than this to replace it:
# scores are sums of float products, and two equal trees reached by different arithmetic
# must not swap places on rounding.
SCORE_EPS = 1e-9

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _hash(key: int) -> int:
    mixed = (key ^ (key >> 29)) * 0x9E3779B97F4A7C15
    return mixed ^ (mixed >> 32)


@_jit
def _find(table: np.ndarray, key: int) -> int:
    """The entry of `key` in table i64[2, C] (keys, values; C a power of two), or the free
    entry where it goes."""
    mask = table.shape[1] - 1
    i = _hash(key) & mask
    while table[0, i] != EMPTY and table[0, i] != key:
        i = (i + 1) & mask
    return i


@_jit
def _pair_key(first: int, second: int) -> int:
    return ((first + 1) << 32) | second  # never a single token's key (those are < 2**31)


@_jit
def _latest(table: np.ndarray, key: int) -> int:
    i = _find(table, key)
    return table[1, i] if table[0, i] == key else -1


@_jit
def _link(table: np.ndarray, key: int, position: int) -> tuple[int, int]:
    """Make `position` the latest of `key`; returns (the previous latest or -1, keys added)."""
    i = _find(table, key)
    if table[0, i] == key:
        previous = table[1, i]
        table[1, i] = position
        return previous, 0
    table[0, i] = key
    table[1, i] = position
    return -1, 1


def new_table(capacity: int) -> np.ndarray:
    """An empty hash table, i64[2, capacity] (capacity a power of two)."""
    return np.full((2, capacity), EMPTY, np.int64)


@_jit
def append_tokens(chains: np.ndarray, size: int, table: np.ndarray, keys: int,
                  tokens: np.ndarray) -> tuple[int, int]:
    """Append `tokens` (i64[k]; END closes a text) at chains[:, size:size + k], linking each
    to the previous occurrence of its token and of its pair. The caller makes room (chains'
    capacity, and a table at most half full afterwards: 2 keys a token). Returns the new
    (size, keys)."""
    for token in tokens:
        e = size
        chains[TOKENS, e] = token
        chains[LAST1, e] = -1
        chains[LAST2, e] = -1
        if token >= 0:
            chains[LAST1, e], added = _link(table, token, e)
            keys += added
            if e > 0 and chains[TOKENS, e - 1] >= 0:
                chains[LAST2, e], added = _link(table, _pair_key(chains[TOKENS, e - 1], token), e)
                keys += added
        size += 1
    return size, keys


@_jit
def relink(chains: np.ndarray, size: int, table: np.ndarray) -> int:
    """Rebuild `table` (empty, larger) and every link from chains[TOKENS, :size]; returns
    the keys it holds."""
    tokens = chains[TOKENS, :size].astype(np.int64)
    return append_tokens(chains, 0, table, 0, tokens)[1]


@_jit
def appended(chains: np.ndarray, table: np.ndarray, size: int, keys: int,
             tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """append_tokens with room made first: (chains, table, size, keys) after appending
    `tokens` (i64[k]), the arrays replaced by larger ones where they were too small (the
    table kept at most half full, so probes stay short)."""
    needed = size + tokens.shape[0]
    if needed > chains.shape[1]:
        grown = np.zeros((3, _power_of_two(needed)), np.int32)
        grown[:, :size] = chains[:, :size]
        chains = grown
    if 4 * (keys + tokens.shape[0]) > table.shape[1]:  # 2 keys a token at most
        table = np.full((2, _power_of_two(8 * (keys + tokens.shape[0]))), EMPTY, np.int64)
        keys = relink(chains, size, table)
    size, keys = append_tokens(chains, size, table, keys, tokens)
    return chains, table, size, keys


@_jit
def extend_texts(texts, tables, sizes: np.ndarray, keys: np.ndarray, slots: np.ndarray,
                 tokens: np.ndarray, offsets: np.ndarray) -> None:
    """`appended` for each text slots[r] (texts, tables: typed lists by slot; sizes, keys
    i64[slots]) with tokens[offsets[r]:offsets[r + 1]] (i64, each >= 0), in place."""
    for token in tokens:
        if token < 0:
            raise ValueError("token ids must be >= 0")
    for row in range(slots.shape[0]):
        slot, run = slots[row], tokens[offsets[row]:offsets[row + 1]]
        chains, table = texts[slot], tables[slot]
        size, count = sizes[slot], keys[slot]
        if size + run.shape[0] <= chains.shape[1] and 4 * (count + run.shape[0]) <= \
                table.shape[1]:  # room for it: the common case, no list written
            sizes[slot], keys[slot] = append_tokens(chains, size, table, count, run)
        else:
            texts[slot], tables[slot], sizes[slot], keys[slot] = appended(
                chains, table, size, count, run)


@_jit
def _power_of_two(at_least: int) -> int:
    power = 2
    while power < at_least:
        power *= 2
    return power


@_jit
def _match_length(chains: np.ndarray, e: int, low: int, own: np.ndarray, n: int,
                  longest: int) -> int:
    """How many tokens ending at e equal the last tokens of own[:n] (at most `longest`,
    never below position `low` or across an END)."""
    k = 0
    while k < longest and e - k >= low and k < n:
        token = chains[TOKENS, e - k]
        if token < 0 or token != own[n - 1 - k]:
            break
        k += 1
    return k


@_jit
def _push_children(chains: np.ndarray, size: int, work: np.ndarray, start: int, stop: int,
                   depth: int, prob: float, parent: int, heap: list, min_prob: float) -> None:
    """Group a node's occurrences work[start:stop] (end positions) by the token that follows
    each; push each child whose path probability reaches min_prob, its occurrences advanced
    to end at that token and kept contiguous in `work`."""
    count = stop - start
    following = np.empty(count, np.int64)
    for j in range(count):
        at = work[start + j] + 1
        following[j] = chains[TOKENS, at] if at < size else END
    order = np.argsort(following, kind="mergesort")
    segment = work[start:stop].copy()
    total = 0
    for j in range(count):
        work[start + j] = segment[order[j]] + 1
        total += following[j] >= 0
    if total == 0:
        return
    j = 0
    while j < count:
        token = following[order[j]]
        run = j
        while j < count and following[order[j]] == token:
            j += 1
        if token < 0:
            continue
        child_prob = prob * ((j - run) / total)
        if child_prob >= min_prob:
            heapq.heappush(heap, (-child_prob, depth + 1, parent, token, start + run, start + j))


@_jit
def _grow(chains: np.ndarray, size: int, work: np.ndarray, count: int, max_depth: int,
          budget: int, min_prob: float, tokens: np.ndarray, parents: np.ndarray,
          probs: np.ndarray) -> tuple[int, float]:
    """Best-first draft tree under a match whose `count` occurrences end at work[:count]:
    nodes pop in the order (-path probability, depth, parent's index, token), so the first
    `budget` pops are the best nodes, closed under ancestors. Writes node i's token, parent
    (0: the root) and path probability at index i; returns (nodes, their summed probability:
    the tokens verification is expected to accept)."""
    heap = [(0.0, 0, 0, 0, 0, 0)]
    heap.pop()
    _push_children(chains, size, work, 0, count, 0, 1.0, 0, heap, min_prob)
    nodes, score = 0, 0.0
    while heap and nodes < budget:
        neg_prob, depth, parent, token, start, stop = heapq.heappop(heap)
        tokens[nodes], parents[nodes], probs[nodes] = token, parent, -neg_prob
        nodes += 1
        score += -neg_prob
        if depth < max_depth:
            _push_children(chains, size, work, start, stop, depth, -neg_prob, nodes, heap,
                           min_prob)
    return nodes, score


@_jit
def _matches(chains: np.ndarray, size: int, table: np.ndarray, low: int, own: np.ndarray,
             n: int, longest: int, pair: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each earlier occurrence of own[:n]'s last token (or, with `pair`, last two tokens)
    that a token follows, newest first: (end positions, how many of the last tokens each
    matches, at most `longest`), i64[count] each."""
    last = own[n - 1]
    e = _latest(table, _pair_key(own[n - 2], last) if pair else last)
    link = LAST2 if pair else LAST1
    ends, lengths = np.empty(64, np.int64), np.empty(64, np.int64)
    count = 0
    while e >= low:
        if e + 1 < size and chains[TOKENS, e + 1] >= 0:
            if count == ends.shape[0]:
                ends, lengths = _doubled(ends), _doubled(lengths)
            ends[count] = e
            lengths[count] = _match_length(chains, e, low, own, n, longest)
            count += 1
        e = chains[link, e]
    return ends[:count], lengths[:count]


@_jit
def _doubled(array: np.ndarray) -> np.ndarray:
    grown = np.empty(2 * array.shape[0], array.dtype)
    grown[:array.shape[0]] = array
    return grown


@_jit
def best_tree(own_chains: np.ndarray, n: int, own_table: np.ndarray, pool_chains: np.ndarray,
              pool_size: int, pool_table: np.ndarray, pool_dead: int, caps: np.ndarray,
              depths: np.ndarray, min_match: int, min_prob: float, tokens: np.ndarray,
              parents: np.ndarray, probs: np.ndarray) -> int:
    """The best-scoring draft tree for a text own_chains[TOKENS, :n] (n >= 1) over every
    match length m (longest first) and both text sets (its own text, then the pool of
    recent responses, whose positions below pool_dead are evicted): written after the root
    into tokens/parents/probs[1:] (length M = the most nodes, root included); returns its
    nodes below the root. caps[m] (i64[max_match + 1]) bounds what a match of m tokens can
    score, non-decreasing in m, so no shorter match can win once the best reaches it;
    depths[m] is its draft depth."""
    own = own_chains[TOKENS]
    budget = tokens.shape[0] - 1
    longest = min(caps.shape[0] - 1, n)
    sets = ((own_chains, n, own_table, 0), (pool_chains, pool_size, pool_table, pool_dead))
    # Per text set: occurrences of the last two tokens (every match of m >= 2), and of the
    # last token alone once m = 1 is reached.
    found = [_matches(chains, size, table, low, own, n, longest, True) if longest >= 2
             else (np.empty(0, np.int64), np.empty(0, np.int64))
             for chains, size, table, low in sets]
    previous = [-1, -1]  # occurrences of the match one token longer, per text set
    scratch = (np.empty(budget, np.int64), np.empty(budget, np.int64),
               np.empty(budget, np.float64))
    best, kept = 0.0, 0
    for m in range(longest, min_match - 1, -1):
        if caps[m] <= best + SCORE_EPS:
            break
        for which in range(2):
            chains, size, table, low = sets[which]
            if m == 1:
                found[which] = _matches(chains, size, table, low, own, n, 1, False)
            ends, lengths = found[which]
            work = ends[lengths >= m]
            count = work.shape[0]
            # The same occurrences as the match one longer: the same tree, no deeper.
            if count == 0 or count == previous[which]:
                previous[which] = count
                continue
            previous[which] = count
            nodes, score = _grow(chains, size, work, count, depths[m], budget, min_prob,
                                 *scratch)
            if score > best + SCORE_EPS:
                best, kept = score, nodes
                tokens[1:nodes + 1] = scratch[0][:nodes]
                parents[1:nodes + 1] = scratch[1][:nodes]
                probs[1:nodes + 1] = scratch[2][:nodes]
    return kept


@_jit
def propose_rows(texts, tables, sizes: np.ndarray, slots: np.ndarray, pool_chains: np.ndarray,
                 pool_size: int, pool_table: np.ndarray, pool_dead: int, caps: np.ndarray,
                 depths: np.ndarray, min_match: int, min_prob: float, tokens: np.ndarray,
                 parents: np.ndarray, probs: np.ndarray) -> None:
    """best_tree for each text slots[r] (texts, tables: typed lists by slot, sizes i64[slots])
    into row r of tokens, parents (i32[B, M]) and probs (f64[B, M]): the root (the text's
    last token, parent -1, probability 1) at column 0, the nodes, then padding (0, -1, 0).
    Rows from len(slots) on are left as they are."""
    for row in range(slots.shape[0]):
        slot = slots[row]
        chains, n = texts[slot], sizes[slot]
        tokens[row, 0], parents[row, 0], probs[row, 0] = chains[TOKENS, n - 1], -1, 1.0
        kept = best_tree(chains, n, tables[slot], pool_chains, pool_size, pool_table,
                         pool_dead, caps, depths, min_match, min_prob, tokens[row],
                         parents[row], probs[row])
        tokens[row, kept + 1:] = 0
        parents[row, kept + 1:] = -1
        probs[row, kept + 1:] = 0.0
