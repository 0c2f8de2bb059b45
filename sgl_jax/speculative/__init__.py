"""Speculative decoding: drafts propose a tree of tokens, the target verifies it in one pass."""
