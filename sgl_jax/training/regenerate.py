"""Regenerated training data: every assistant turn rewritten by the target itself, through the
project's own Engine, so the draft learns the distribution it will be asked to predict."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from sgl_jax.training.data import Message


def regenerate(engine, tokenizer, conversations: Sequence[list[Message]], *,
               temperature: float, max_new_tokens: int, context_length: int,
               progress: bool = True) -> list[list[Message]]:
    """The conversations with each assistant turn replaced by the target's answer to the
    (already regenerated) history before it. Turn i of every conversation is generated in
    one batch. A conversation whose next prompt leaves no room for max_new_tokens within the
    context length ends before that turn."""
    out: list[list[Message]] = [[] for _ in conversations]
    open_rows = set(range(len(conversations)))
    longest = max((len(c) for c in conversations), default=0)
    bar = tqdm(total=sum(m["role"] == "assistant" for c in conversations for m in c),
               desc="Regenerating", unit="turn", disable=not progress)
    for turn in range(longest):
        rows, prompts = [], []
        for row in sorted(open_rows):
            if turn >= len(conversations[row]):
                open_rows.discard(row)
                continue
            message = conversations[row][turn]
            if message["role"] != "assistant":
                out[row].append(message)
                continue
            ids = tokenizer.apply_chat_template(out[row], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if len(ids) + max_new_tokens > context_length:
                open_rows.discard(row)
                continue
            rows.append(row)
            prompts.append(list(ids))
        if prompts:
            params = {"temperature": temperature, "max_new_tokens": max_new_tokens}
            for row, result in zip(rows, engine.generate(input_ids=prompts,
                                                         sampling_params=params), strict=True):
                out[row].append({"role": "assistant", "content": result["text"]})
            bar.update(len(prompts))
    bar.close()
    return [c for c in out if any(m["role"] == "assistant" for m in c)]
