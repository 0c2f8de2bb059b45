"""One speculative round: the draft tree and its growth, verification, the round program
and its results."""
