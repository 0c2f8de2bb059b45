"""The runtime: what runs a model (runtime.py), its pools (budget.py), its warm-up (warmup.py)
and what it reports of its use (usage.py)."""
