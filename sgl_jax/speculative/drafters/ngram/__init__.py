"""NGRAM: model-free drafts from suffix statistics of text already seen."""
