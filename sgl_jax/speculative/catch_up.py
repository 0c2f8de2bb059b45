"""Drafts that plain rounds left behind (SpecRunner.defers_draft), and when each catches up.

A plain round of a deferring drafter is the target's decode step: a drafting request's draft
does not advance, and the host keeps the target features of each token it lacks
(DraftState.pending). The draft is extended over them in one catch-up program before the
request's next speculative round, or once CATCH_UP_WIDTH are pending (a catch-up is a fixed
width). In a plain streak, a draft whose request would not speculate even alone is given up
instead: its catch-ups would be pure cost.
"""

from __future__ import annotations

import numpy as np

from sgl_jax.scheduler.req import Req
from sgl_jax.speculative import spec_warmup
from sgl_jax.speculative.policy.shape_policy import PLAIN, SpeculationPolicy
from sgl_jax.speculative.request_state import DraftStates
from sgl_jax.speculative.round.program import CATCH_UP_WIDTH, CatchUpRow
from sgl_jax.speculative.spec_config import TreeShape
from sgl_jax.speculative.spec_runner import SpecRunner


class CatchUps:
    def __init__(self, spec: SpecRunner, states: DraftStates, policy: SpeculationPolicy):
        self.spec = spec
        self.states = states
        self.policy = policy

    def pending(self, req: Req) -> int:
        """Tokens the request's draft lacks."""
        return len(self.states[req].pending)

    def needs_settled(self, reqs: list[Req], shape: TreeShape, unread_reqs: list[Req]) -> bool:
        """Whether a round of `shape` for `reqs` must wait for the plain round in flight (over
        `unread_reqs`): some draft it left behind catches up first, and its inputs are the
        features that round brings back."""
        in_round = set(unread_reqs)  # some may have finished since: only `reqs` are asked
        return any(req in in_round and self.states[req].drafting
                   and (shape != PLAIN or self.pending(req) + 1 >= CATCH_UP_WIDTH)
                   for req in reqs)

    def run_due(self, reqs: list[Req], shape: TreeShape) -> None:
        """Before a round of `shape`: catch up the drafts it needs (a speculative round, every
        one behind; a plain one, those CATCH_UP_WIDTH behind that are worth keeping)."""
        due = [req for req in reqs if self.pending(req) and (
            shape != PLAIN or self.pending(req) >= CATCH_UP_WIDTH)]
        self._catch_up(due if shape != PLAIN else self._worth_keeping(due))

    def _worth_keeping(self, reqs: list[Req]) -> list[Req]:
        """Of `reqs`, those whose request would speculate at least alone (policy.pays_alone);
        the others give their draft up, and their rows ride without one from now on."""
        kept = []
        for req in reqs:
            state = self.states[req]
            if self.policy.pays_alone(state.acceptance):
                kept.append(req)
            else:
                state.drafting = False
                state.pending.clear()
        return kept

    def _catch_up(self, reqs: list[Req]) -> None:
        """Extend the drafts of `reqs` over their pending tokens."""
        if not reqs:
            return
        rows = []
        for req in reqs:
            state = self.states[req]
            draft_len = state.draft_len(req)
            rows.append(CatchUpRow(req.slot, req.page_ids, draft_len,
                                   req.token_slice(draft_len + 1, req.kv_len + 1),
                                   np.stack(state.pending)))
            state.pending.clear()
        self.spec.catch_up(rows, spec_warmup.ready_padding(self.spec, len(rows)))
