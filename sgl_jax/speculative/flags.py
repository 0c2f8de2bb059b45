"""The speculative-decoding flags of `python -m sgl_jax.launch_server` (SGLang's names);
server_args.py builds the parser and turns them into a SpeculativeConfig."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

SPECULATIVE_ALGORITHMS = ("DFLASH", "DSPARK", "EAGLE", "EAGLE3", "NEXTN", "NGRAM", "STANDALONE")
NGRAM_MATCH_TYPES = ("BFS", "PROB")


def add_speculative_flags(group: argparse._ArgumentGroup, draft_quantizations: Sequence[str]
                          ) -> None:
    group.add_argument("--speculative-algorithm", default=None,
                       type=lambda s: s.upper(), choices=SPECULATIVE_ALGORITHMS,
                       help="draft-and-verify decoding; EAGLE3 for the seed draft heads")
    group.add_argument("--speculative-draft-model-path", default=None,
                       help="local directory or hub id of the draft weights")
    group.add_argument("--speculative-draft-model-revision", default=None,
                       help="hub branch, tag or commit of the draft weights")
    group.add_argument("--speculative-draft-model-quantization", default=None,
                       choices=draft_quantizations,
                       help="the draft's weight format; default: as --quantization; unquant "
                            "keeps the draft in the model dtype")
    group.add_argument("--speculative-num-steps", type=int, default=None,
                       help="draft depth per round (default 3; NGRAM and DSPARK 7, DFLASH "
                            "15; for a DFLASH, DSPARK or NEXTN chain given only "
                            "--speculative-num-draft-tokens W, W - 1)")
    group.add_argument("--speculative-eagle-topk", type=int, default=None,
                       help="branching per draft step; 1 = a chain (default 1)")
    group.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                       help="tokens verified per round, the root included; default: "
                            "num_steps + 1 for a chain, 2 * (num_steps + 1) for a tree")
    group.add_argument("--speculative-accept-threshold-single", type=float, default=1.0,
                       help="relaxes the acceptance of one draft token; 1.0 = lossless")
    group.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0,
                       help="relaxes acceptance by accumulated probability; 1.0 = lossless")
    group.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="choose each round's draft shape (plain decoding, a shorter "
                            "chain, or the flags' shape, which is the widest) for the most "
                            "tokens per second from measured acceptance and round costs; "
                            "--no-speculative-adaptive takes the flags' shape every round")
    group.add_argument("--speculative-per-request-lengths",
                       action=argparse.BooleanOptionalAction, default=False,
                       help="each request verifies the prefix (subtree) of its draft that "
                            "its confidence earns, the round's token count chosen by the "
                            "adaptive policy from measured costs (packed rounds); off: every "
                            "request verifies its whole draft")


def add_ngram_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1,
                       help="NGRAM: the shortest suffix of the text matched (default 1)")
    group.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12,
                       help="NGRAM: the longest suffix of the text matched; a match of m "
                            "tokens drafts at most m + 1 (default 12)")
    group.add_argument("--speculative-ngram-branch-length", type=int, default=18,
                       help="NGRAM: the deepest continuation kept after a match (default 18)")
    group.add_argument("--speculative-ngram-capacity", type=int, default=1_000_000,
                       help="NGRAM: tokens of finished responses kept to draft repeats "
                            "from, oldest evicted first (default 1,000,000; about 50 bytes "
                            "of host memory each)")
    group.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=1,
                       help="NGRAM: accepted for SGLang commands; trees here follow the "
                            "text's statistics, so breadth is not set by hand")
    group.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=10,
                       help="NGRAM: accepted for SGLang commands (see min-bfs-breadth)")
    group.add_argument("--speculative-ngram-match-type", default="BFS",
                       type=lambda s: s.upper(), choices=NGRAM_MATCH_TYPES,
                       help="NGRAM: accepted for SGLang commands; trees are always built by "
                            "probability (SGLang's PROB)")
