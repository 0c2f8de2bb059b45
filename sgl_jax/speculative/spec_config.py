"""Speculative decoding's settings, as the flags give them (server_args.py builds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_jax.speculative.drafters.ngram.suffix_config import SuffixConfig


@dataclass(frozen=True)
class TreeShape:
    num_steps: int  # S: draft depth
    topk: int  # K: branching per step
    num_draft_tokens: int  # N: nodes sent to verify, the root included
    # W > 0: a packed round (per-request lengths): a batch bucket of B rows verifies W * B
    # nodes in all, each row a prefix of its chain (a subtree of its tree) as large as its
    # expected acceptance earns (policy/request_lengths.py); 0: every row verifies all N nodes.
    verify_width: int = 0

    def __post_init__(self) -> None:
        # Shapes key the adaptive policy's tables, read a few hundred times a round.
        key = (self.num_steps, self.topk, self.num_draft_tokens, self.verify_width)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    @property
    def name(self) -> str:
        """"S/K/N", and "S/K/N:W" for a packed round."""
        base = f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"
        return f"{base}:{self.verify_width}" if self.verify_width else base

    def unpacked(self) -> TreeShape:
        """The same tree, every row verifying all of it."""
        return TreeShape(self.num_steps, self.topk, self.num_draft_tokens)

    def includes(self, other: TreeShape) -> bool:
        """Whether a round of this shape does all the work of a round of `other` in the same
        batch bucket, so it cannot cost less: an unpacked shape of no fewer steps, branches
        and nodes drafts and verifies a superset; a packed round no narrower than another of
        the same tree verifies more. Plain's step only includes itself: it is another program
        (an H100 timed it dearer than a one-step chain's round at batch 1)."""
        if self.num_steps == 0 or other.num_steps == 0:
            return self == other
        if self.verify_width or other.verify_width:
            same_tree = self.unpacked() == other.unpacked()
            return same_tree and self.verify_width >= other.verify_width > 0
        return (self.num_steps >= other.num_steps and self.topk >= other.topk
                and self.num_draft_tokens >= other.num_draft_tokens)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft-and-verify settings (see docs/speculative.md)."""

    algorithm: str
    draft_model_path: str
    draft_model_revision: str | None
    # The draft's weight format: the target's --quantization unless
    # --speculative-draft-model-quantization says otherwise (None: the model dtype).
    draft_quantization: str | None
    num_steps: int  # draft depth S
    eagle_topk: int  # branching K per step; 1 = a chain
    num_draft_tokens: int  # N tokens sent to verify, the root included
    accept_threshold_single: float
    accept_threshold_acc: float
    adaptive: bool  # each round's shape chosen by the policy, the flags' shape the widest
    ngram: SuffixConfig | None = None  # NGRAM's drafting statistics
    # Rows of a round verify prefixes (subtrees) of their own sizes (packed rounds among the
    # adaptive policy's shapes); else every row verifies its whole tree.
    per_request_lengths: bool = False

    @property
    def shape(self) -> TreeShape:
        """The flags' shape: the widest a round may take."""
        return TreeShape(self.num_steps, self.eagle_topk, self.num_draft_tokens)
