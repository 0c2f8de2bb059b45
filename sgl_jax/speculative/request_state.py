"""Each running request's speculative state on the host, in a table the decoder owns.

The scheduler's `Req` knows nothing of speculation: what a request's rounds need (whether it
has a draft, the target features its draft still lacks, its acceptance records) lives here,
from the request's arrival to its finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.policy.acceptance_stats import AcceptanceStats
from sgl_jax.speculative.policy.shape_policy import Acceptance


@dataclass
class DraftState:
    """One request's speculative state.

    A request admitted without a draft (the policy judged at admission that speculation would
    not pay at the server's load) never runs the draft's prefill; its rows ride along in
    speculative rounds with trees the draft grew from nothing, which verification keeps
    lossless, and the policy counts them as committing one token a round."""

    stats: AcceptanceStats  # its rounds' acceptance, for meta_info
    acceptance: Acceptance  # the adaptive policy's estimates of its acceptance
    drafting: bool = True
    # Plain rounds that left the draft behind: the target's features f[F] at each position
    # the draft's cache lacks (the last len() before kv_len), oldest first.
    pending: list[np.ndarray] = field(default_factory=list)

    def draft_len(self, req: Req) -> int:
        """Leading tokens of `req` whose draft K/V are in the cache (none known without a
        draft)."""
        return req.kv_len - len(self.pending) if self.drafting else 0

    def meta_info(self) -> dict:
        """What a finished request reports of its rounds (SGLang's field names, and the
        rounds that verified each draft position: with per-request lengths, its own)."""
        return {"spec_verify_ct": self.stats.rounds,
                "spec_accept_length": self.stats.accept_length,
                "spec_accepted_per_position": list(self.stats.accepted_per_position),
                "spec_verified_per_position": list(self.stats.drafted_per_position)}


class DraftStates:
    """The table: one DraftState per request the decoder has been given and not finished."""

    def __init__(self) -> None:
        self._states: dict[Req, DraftState] = {}

    def add(self, req: Req, state: DraftState) -> None:
        self._states[req] = state

    def __getitem__(self, req: Req) -> DraftState:
        return self._states[req]

    def pop(self, req: Req) -> DraftState:
        return self._states.pop(req)

    def __len__(self) -> int:
        return len(self._states)
