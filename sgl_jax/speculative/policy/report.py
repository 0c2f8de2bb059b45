"""What the adaptive policy reports (/get_server_info, /metrics): the shapes it chose and
the figures it chose them by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_jax.speculative.spec_config import TreeShape


def shape_name(shape: TreeShape) -> str:
    return "plain" if shape.num_steps == 0 else shape.name


@dataclass(frozen=True)
class Choice:
    """One round's decision and what it was based on. The figures by shape name are built
    when read: a choice is made every step and read rarely."""

    shape: TreeShape
    batch_bucket: int
    probe: bool  # chosen to measure the other side (acceptance or cost), not on its rate
    judged: Any  # policy._Judged: the candidate shapes' expected tokens, costs and rates
    rows: int  # requests in the round (at least 1)

    @property
    def accept_lengths(self) -> dict[str, float]:
        """Mean expected tokens per request and round, by shape."""
        return {shape_name(s): tokens / self.rows for s, tokens in self.judged.lengths.items()}

    @property
    def round_ms(self) -> dict[str, float]:
        """The believed cost of a round, by shape."""
        return {shape_name(s): 1000 * seconds for s, seconds in self.judged.seconds.items()}

    @property
    def tokens_per_s(self) -> dict[str, float]:
        """Expected tokens a second over the batch, by shape."""
        lengths = self.judged.lengths
        return {shape_name(s): lengths[s] / seconds for s, seconds in self.judged.seconds.items()}

    @property
    def judged_by(self) -> str:
        """"tokens": tokens_per_s; "batch end": refills.progress a second."""
        return "batch end" if self.judged.by_end else "tokens"


def policy_info(policy: Any) -> dict:
    """For a policy.SpeculationPolicy (not imported: it imports this module)."""
    last = policy.last
    return {
        "spec_adaptive": policy.adaptive,
        "spec_shapes": [shape_name(s) for s in policy.shapes],
        "spec_rounds_by_shape": dict(policy.rounds_by_shape),
        "spec_masked_rounds": policy.masked_rounds,
        "spec_finished_requests": dict(policy.finished_requests),
        "spec_believed_accept_rates": {
            kind: [round(float(x), 4) for x in policy.server.rates(kind, None)]
            for kind in ("chain", "tree")},
        "spec_last_choice": None if last is None else {
            "shape": shape_name(last.shape), "batch_bucket": last.batch_bucket,
            "probe": last.probe, "judged_by": last.judged_by,
            "accept_length": last.accept_lengths,
            "round_ms": last.round_ms, "tokens_per_s": last.tokens_per_s},
        "spec_probe_interval": policy.probe_interval,
        "spec_freed_slots": dict(policy.refills.counts),
        "spec_draft_confidence": policy.calibration.error(),
        "spec_round_ms": round_ms_table(policy),
        "spec_believed_round_ms": round_ms_table(policy, believed=True),
    }


def round_ms_table(policy: Any, believed: bool = False
                   ) -> dict[str, dict[str, float]]:
    """The warm-up timing of each shape's round by batch bucket, {"8": {"3/4/8": 7.1}};
    `believed`: as the choice and the admission rule price it now (times the bucket's load
    and the shape's correction, learnt from the rounds served)."""
    table: dict[str, dict[str, float]] = {}
    for (shape, bucket), seconds in sorted(policy.round_seconds.items(),
                                            key=lambda item: item[0][1]):
        if believed:
            seconds = policy.seconds(shape, bucket)
        table.setdefault(str(bucket), {})[shape_name(shape)] = round(1000 * seconds, 3)
    return table
