"""A tiny byte-level BPE tokenizer, trained locally, saved in Hugging Face layout.

Byte-level BPE covers every byte, so any UTF-8 text (emoji, CJK, ...) round-trips even
though the merges are learned from a small built-in corpus.  Training is deterministic:
the trainer breaks frequency ties by token id, and ids only depend on the corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Vocabulary size of the tiny checkpoints; the tokenizer never exceeds it.
TINY_VOCAB_SIZE = 512

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"

# The trainer puts special tokens first, in this order, so their ids are fixed (0, 1, 2).
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ENDOFTEXT_ID = SPECIAL_TOKENS.index(ENDOFTEXT)
# Plain added tokens: matched as single tokens but kept in decoded text (like Qwen3).
THINK_TOKENS = (THINK_START, THINK_END)

# ChatML, as used by Qwen.  With enable_thinking=False the generation prompt carries an
# empty reasoning block so the model answers directly (Qwen3 convention).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}"
    "{%- set content = '' %}"
    "{%- else %}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token given all of the previous tokens.",
    "Hello! How are you doing today? I am doing well, thank you for asking.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Once upon a time, there was a little robot who wanted to learn how to paint.",
    "Please write a short poem about the ocean, the moon and the stars.",
    "What is the sum of 12 and 30? The answer is 42.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "The server receives a request, schedules it, and streams the generated text back.",
    "Water boils at 100 degrees Celsius at sea level.",
    "She opened the window and the cold morning air filled the room.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Machine learning models are trained on large amounts of data.",
    "Can you explain the difference between a list and a tuple?",
    "The attention layer mixes information across every position in the sequence.",
    "My favourite colours are blue, green, and a warm shade of orange.",
    "It was raining, so we stayed inside and played chess all afternoon.",
    "Thank you very much for your help; I really appreciate it.",
    "The cache stores keys and values so that each new token is cheap to compute.",
    "Mathematics is the language in which the universe is written.",
    "They walked along the river until the sun went down behind the hills.",
    "Reasoning step by step often leads to a better final answer.",
    "The system prompt tells the assistant how it should behave.",
    "user assistant system: You are a helpful assistant. Answer briefly.",
    "Let me think about this carefully before I answer the question.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Dear team, the meeting has been moved to Thursday at 10:30 AM.",
    "Is it true that cats sleep for more than twelve hours a day?",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    'for i in range(10):\n    print(f"value = {i}")\n',
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n",
    'if __name__ == "__main__":\n    main()\n',
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
    "SELECT name, age FROM users WHERE age > 21 ORDER BY name;",
    '{"role": "user", "content": "Hello, world!"}',
    "const items = [1, 2, 3].map((x) => x * 2);",
    "Bonjour, comment allez-vous ? Je vais très bien, merci.",
    "Hola, ¿cómo estás? Estoy aprendiendo a programar.",
    "Guten Morgen! Das Wetter ist heute schön.",
    "你好，世界。今天天气很好。",
    "こんにちは、元気ですか？",
    "Привет, как дела?",
    "Emoji are fun 😀 🚀 ✨ and so is café au lait.",
)


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        # Leave room for the plain added tokens so the total stays within TINY_VOCAB_SIZE.
        vocab_size=TINY_VOCAB_SIZE - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet is what makes unseen characters encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def write_tiny_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer and save it (tokenizer.json + configs) into ``path``."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train(),
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        # Exact round-trips: no space clean-up on decode.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(path))
    _use_portable_class_name(Path(path) / "tokenizer_config.json")
    return tokenizer


def _use_portable_class_name(config_file: Path) -> None:
    # transformers 5 records its internal "TokenizersBackend", which 4.x cannot resolve;
    # "PreTrainedTokenizerFast" names the same tokenizer in both major versions.
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
