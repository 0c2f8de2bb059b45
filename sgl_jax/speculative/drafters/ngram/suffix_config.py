"""What the NGRAM drafter may use (`SuffixConfig`), apart from the index that uses it so that
the server's settings can hold one without importing the index."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    # --speculative-ngram-branch-length: the deepest draft (tokens after the root). In
    # SGLang it bounds the branch stored in its trie (match and draft together); here every
    # occurrence is kept whole, so the longest match can still draft this deep. SGLang's
    # default; with the other defaults drafts stop at 13 anyway.
    branch_length: int = 18
    # --speculative-ngram-capacity: tokens of finished requests' outputs kept for drafting;
    # the oldest outputs are evicted first. About 50 bytes of host memory per token
    # (up to twice that while evicted outputs wait to be dropped).
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

    def validate(self) -> None:
        _check_int("max_match", self.max_match, 1, 256, "--speculative-ngram-max-match-window-size")
        _check_int("min_match", self.min_match, 1, self.max_match,
                   "--speculative-ngram-min-match-window-size")
        _check_int("branch_length", self.branch_length, 1, 256, "--speculative-ngram-branch-length")
        _check_int("capacity", self.capacity, 0, 1 << 31, "--speculative-ngram-capacity")
        _check_float("min_token_prob", self.min_token_prob, 0.0, 1.0)
        _check_float("spec_factor", self.spec_factor, 0.0, 256.0)
        _check_float("spec_offset", self.spec_offset, -256.0, 256.0)


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

