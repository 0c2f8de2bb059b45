"""What a round drafts: the shape policy, acceptance records, refills, per-request lengths,
the policy's report."""
