"""The depth-bounded suffix trie behind NGRAM's statistics (`suffix_index`): exact counts of
every string of a token list up to the depth D, explicit only where text repeats. A node that
more than `bucket_size` suffixes pass through has a dict of children; a rarer one keeps the
start positions of its suffixes (a "bucket") and everything below it is read from the token
list itself. Counts are exact either way; buckets bound how many positions a lookup scans
(bucket_size) and cut the nodes from about D per token (a plain trie) to well under one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# Closes a text in a token list that holds several texts. Real tokens are >= 0, so no match
# and no continuation runs across it.
_END = -1

# A located string: (node id, None, depth) for a string the trie has a node for, else
# (-1, the start positions of its occurrences, depth).
Handle = tuple[int, Sequence[int] | None, int]
# One continuation of a located string: (occurrences of string + token, token, its handle).
Child = tuple[int, int, Handle]

# An explicit node with more children than this keeps a record of its frequent ones, so a
# lookup does not walk every child of a common token (thousands, in recent responses).
WIDE_NODE = 16


class SuffixTrie:
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

    @property
    def num_wide_records(self) -> int:
        """Nodes keeping a record of their frequent children (more than WIDE_NODE children)."""
        return len(self._wide)

    def root_counts(self) -> dict[int, int]:
        """Per first token, the suffixes that start with it (each kept token starts one)."""
        return {token: self._count[child] for token, child in self._children[0].items()}

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

    def locate(self, pattern: Sequence[int]) -> Handle | None:
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

    def total(self, handle: Handle) -> int:
        """How many occurrences of a located string are followed by a token."""
        starts = self._scanned_starts(handle)
        if starts is None:
            return self._total[handle[0]]
        return sum(1 for _ in self._followed(starts, handle[2]))

    def continuations(self, handle: Handle) -> tuple[int, list[Child]]:
        """(total, children) of a located string: how many of its occurrences are followed by
        a token, and (count, token, handle) for each token with count / total >= min_fraction,
        the most frequent first (equal counts in no particular order)."""
        depth = handle[2]
        starts = self._scanned_starts(handle)
        if starts is None:
            return self._explicit_continuations(handle[0], depth)
        groups: dict[int, list[int]] = {}
        for start, token in self._followed(starts, depth):
            groups.setdefault(token, []).append(start)
        total = sum(len(group) for group in groups.values())
        children = [(len(group), token, (-1, group, depth + 1))
                    for token, group in groups.items()
                    if len(group) / total >= self.min_fraction]
        children.sort(key=_by_count, reverse=True)
        return total, children

    def _scanned_starts(self, handle: Handle) -> Sequence[int] | None:
        """The start positions of a located string's occurrences, to be read from `tokens`;
        None for an explicit node, whose counts are kept."""
        node, starts, _ = handle
        if node < 0:
            return starts
        if self._children[node] is not None:
            return None
        return self._starts[node] or ()  # a count-only node is never expanded

    def _followed(self, starts: Sequence[int], depth: int) -> Iterator[tuple[int, int]]:
        """(start, next token) for each occurrence of a `depth`-token string at `starts` that
        a token follows (not the end of its text or of the list)."""
        tokens, offset = self.tokens, depth - self.base
        size = len(tokens)
        for start in starts:
            i = start + offset
            if i < size and tokens[i] >= 0:
                yield start, tokens[i]

    def _explicit_continuations(self, node: int, depth: int) -> tuple[int, list[Child]]:
        counts, total = self._count, self._total[node]
        if total == 0:
            return 0, []
        pool = self._children[node]
        if len(pool) > WIDE_NODE:
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

    def _scan(self, starts: Sequence[int], k: int, pattern: Sequence[int]) -> Handle | None:
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



def _by_count(child: Child) -> int:
    return child[0]
