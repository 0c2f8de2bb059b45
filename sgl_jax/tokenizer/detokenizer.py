"""Incremental detokenization: turn a stream of generated token ids into final text chunks.

Two things make streaming text harder than ``tokenizer.decode`` on each new token:

* A token is not a character.  Byte-level BPE splits one emoji or CJK character over
  several tokens, and sentencepiece-style decoders drop the leading space of the first token
  they see.  So new tokens are decoded together with a few previous ones (the *context
  window*) and only the text the new tokens add is emitted, once it no longer ends in half a
  character (U+FFFD).  Per-push cost depends on the window, not on the output length.
* A stop string may arrive split over several tokens or pushes.  Text that could still
  become the beginning of a stop string is held back until it either completes the stop
  string (and is cut off) or stops matching (and is released).

The window is kept by the ``tokenizers`` library's own incremental decoder
(``tokenizers.decoders.DecodeStream``, in Rust), fed with the prompt's last few ids as
prefill so the first generated token is decoded mid-text.  A request without stop strings
makes no Python-level decode call per token.

Some cases go through ``decode`` calls on the same context window instead (the *decode path*):

* Tokenizers whose ``decode`` is more than their Rust backend's: slow (Python) tokenizers,
  classes that override ``decode``, and tokenizers whose ``decode`` cleans up spaces
  (``clean_up_tokenization_spaces`` where transformers applies it).  They use the decode path
  for every push; only it passes ``spaces_between_special_tokens`` on, which transformers'
  fast ``decode`` ignores (so the stream, which matches fast ``decode``, ignores it too).
* States that DecodeStream has no bound for: more than ``MAX_INCOMPLETE_TOKENS`` ids that
  still end in half a character (invalid bytes, released here as ``decode`` renders them)
  and long runs of tokens that decode to nothing.  Also a decoder whose text for a longer
  window does not extend the text for a shorter one (DecodeStream raises).  Those pushes
  take the decode path; the stream is rebuilt once all ids are emitted and the context
  window's text is complete (a prefill ending in U+FFFD would be repeated by the stream).

One case no streaming can match: byte-fallback decoders (``<0xNN>`` tokens, as in Llama)
render a whole run of byte tokens as U+FFFD when any byte in it is invalid, so an invalid
byte can turn characters streamed earlier in its run into U+FFFD in ``decode``'s text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Decoders render an incomplete (or invalid) UTF-8 byte sequence as this character.
REPLACEMENT_CHAR = "\ufffd"

# How many prompt ids serve as the first context window: enough for the decoder to treat
# the first generated token as mid-text (keep its leading space), few enough to be cheap.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character has at most 4 bytes, so a valid character split over tokens is complete
# after at most 4 of them.  A tail that still ends in U+FFFD after more is invalid bytes,
# and waiting longer would stall the stream.  (A push of more ids than this that ends in
# half a character takes the same path: everything before that character is released.)
MAX_INCOMPLETE_TOKENS = 4

# Tokens that decode to nothing (skipped special tokens) stay in the context window so the
# next real token is still decoded mid-text; past this many the window is moved on anyway
# to keep the per-push cost bounded.
MAX_SILENT_TOKENS = 16

# transformers 5 skips its space clean-up for BPE models unless this attribute is set.
_FORCE_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def _stream_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer whose ``decode`` returns exactly what ``tokenizer.decode`` does.

    None when ``tokenizer.decode`` does more (or has no Rust backend): such tokenizers
    stream through ``tokenizer.decode`` itself.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None  # a slow (Python) tokenizer
    cls = type(tokenizer)
    if (
        cls.decode is not PreTrainedTokenizerBase.decode
        or getattr(cls, "_decode", None) is not PreTrainedTokenizerFast._decode
    ):
        return None  # a model-specific decode (Whisper, wav2vec2, ...) post-edits the text
    if _cleans_up_spaces(tokenizer, backend):
        return None
    return backend


def _cleans_up_spaces(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> bool:
    """Whether ``decode`` applies transformers' ``clean_up_tokenization`` to the text."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, _FORCE_BPE_CLEAN_UP, None)
    if forced is None:
        return True  # transformers 4 cleans up every model's output
    return bool(forced) or type(backend.model).__name__ != "BPE"


class IncrementalDetokenizer:
    """Streams the text of one request's generated ids; see the module docstring.

    When no stop string matches, the concatenation of everything ``push`` and ``flush``
    return equals ``tokenizer.decode(generated_ids, skip_special_tokens=...)``.
    With several stop strings, the first one to be completed in the text wins (ties go to
    the longer one), so the result does not depend on how ids are split into pushes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        include_stop_string: bool = False,
    ) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._skip_special_tokens = skip_special_tokens
        self._backend = _stream_backend(tokenizer)
        self._decode_ids = self._decoder(tokenizer, spaces_between_special_tokens)
        self._stop_strings = tuple(stop_strings)
        self._include_stop_string = include_stop_string

        # ids = prompt context + generated ids.  ids[prefix_offset:read_offset] were already
        # emitted and serve as context; ids[read_offset:] are not yet emitted.  The stream,
        # when there is one, holds the same window.
        context = self._prompt_context(prompt_ids)
        self._ids = context
        self._num_context_ids = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stream = self._new_stream(context) if self._backend is not None else None

        self._held_text = ""  # decoded text that may be the start of a stop string
        self._chunks: list[str] = []
        self._matched_stop: str | None = None
        self._num_tokens_at_stop: int | None = None

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def stopped(self) -> bool:
        return self._matched_stop is not None

    @property
    def num_tokens_at_stop(self) -> int | None:
        return self._num_tokens_at_stop

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text that became final."""
        if self.stopped or len(token_ids) == 0:
            return ""
        window = (self._prefix_offset, self._read_offset)
        new_ids = [int(i) for i in token_ids]
        self._ids.extend(new_ids)
        new_text = None if self._stream is None else self._stream_new_text(new_ids)
        if new_text is None:
            new_text = self._decode_new_text()
            self._resume_stream()
        return self._release(new_text, window)

    def flush(self) -> str:
        """End of generation: release everything still held back."""
        if self.stopped:
            return ""
        window = (self._prefix_offset, self._read_offset)
        out = self._release(self._decode_tail(), window)
        if not self.stopped and self._held_text:
            # A partial stop string that never completed is ordinary text.
            out += self._held_text
            self._chunks.append(self._held_text)
            self._held_text = ""
        return out

    # -- the stream ----------------------------------------------------------------------

    def _new_stream(self, context: list[int]) -> DecodeStream:
        # The prefill only sets the context; its own text is never returned.
        return DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)

    def _stream_new_text(self, new_ids: list[int]) -> str | None:
        """Text the stream emits for ``new_ids``; None hands the push to the decode path."""
        try:
            text = self._stream.step(self._backend, new_ids)
        except Exception:  # DecodeStream's InvalidPrefix error has no Python type of its own
            # This decoder's text for the longer window does not extend the shorter one.
            self._stream = None
            return None
        if text is not None:
            self._advance(len(self._ids))
            return text
        if len(self._ids) - self._read_offset <= MAX_INCOMPLETE_TOKENS:
            return ""  # half a character or silent tokens: the decode path would wait too
        # The stream would wait forever (and re-decode a growing window); apply the bounds.
        self._stream = None
        return None

    def _resume_stream(self) -> None:
        """Go back to the stream after the decode path, once the stream can take over.

        Unread ids would have to be replayed into it, and a context whose text ends in
        U+FFFD (invalid bytes) is repeated in the stream's next chunk, so wait for neither.
        """
        if self._backend is None or self._stream is not None:
            return
        if self._read_offset != len(self._ids):
            return
        context = self._ids[self._prefix_offset : self._read_offset]
        if not self._decode_ids(context).endswith(REPLACEMENT_CHAR):
            self._stream = self._new_stream(context)

    # -- the decode path -------------------------------------------------------------------

    def _decoder(
        self, tokenizer: PreTrainedTokenizerBase, spaces_between_special_tokens: bool
    ) -> Callable[[list[int]], str]:
        """The decode function of the decode path (and of stop-string bookkeeping)."""
        skip = self._skip_special_tokens
        if self._backend is not None:
            # Same text as tokenizer.decode (see _stream_backend), without its Python overhead.
            backend = self._backend
            return lambda ids: backend.decode(ids, skip_special_tokens=skip)
        kwargs = {
            "skip_special_tokens": skip,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        return lambda ids: tokenizer.decode(ids, **kwargs)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's last few ids, cut before any half character at the prompt's end.

        The context is only there to set the first token's leading space; a half character
        there would swallow the generated ids that finish it.
        """
        context = [int(i) for i in prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS) :]]
        while context and self._decode_ids(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _decode(self, start: int, stop: int) -> str:
        return self._decode_ids(self._ids[start:stop])

    def _decode_new_text(self) -> str:
        """Text added by ids[read_offset:], or "" while it is not final yet."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        new_text = full_text[len(prefix_text) :]
        num_unread = len(self._ids) - self._read_offset
        if new_text.endswith(REPLACEMENT_CHAR):
            # Usually half a character: wait for the rest, unless it is taking too long.
            if num_unread <= MAX_INCOMPLETE_TOKENS:
                return ""
            return self._emit_stable_prefix(prefix_text, full_text)
        if not new_text and num_unread <= MAX_SILENT_TOKENS:
            return ""
        self._advance(len(self._ids))
        return new_text

    def _emit_stable_prefix(self, prefix_text: str, full_text: str) -> str:
        """Emit the unread text up to the last token boundary that later ids cannot change."""
        ends = range(len(self._ids) - 1, self._read_offset, -1)
        texts = [(end, self._decode(self._prefix_offset, end)) for end in ends]
        texts = [(end, text) for end, text in texts if len(text) > len(prefix_text)]
        # Text that ends in a whole character is final.  Prefer it: byte-fallback decoders
        # (<0xNN> tokens, as in Llama) render a whole run of byte tokens as U+FFFD while its
        # last character is incomplete, so full_text may hide characters that are complete.
        for end, text in texts:
            if not text.endswith(REPLACEMENT_CHAR):
                return self._emit_up_to(end, text[len(prefix_text) :])
        # Only invalid bytes before the end: only the final U+FFFD can still turn into a
        # character (the start of one); every earlier one is final, as in ``decode``.
        for end, text in texts:
            if full_text[:-1].startswith(text):
                return self._emit_up_to(end, text[len(prefix_text) :])
        return ""

    def _emit_up_to(self, end: int, text: str) -> str:
        self._advance(end)
        return text

    def _decode_tail(self) -> str:
        """All unread text, as ``decode`` renders it, even if it ends in half a character."""
        if self._read_offset == len(self._ids):
            return ""  # the usual end: everything was emitted, no decode needed
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        self._advance(len(self._ids))
        self._stream = None  # it still holds the tail as unread; a later push rebuilds it
        return full_text[len(prefix_text) :]

    def _advance(self, read_offset: int) -> None:
        # What was just emitted becomes the context for the next ids; older ids are not
        # needed again, which keeps each decode small.  (DecodeStream moves the same way.)
        self._prefix_offset = self._read_offset
        self._read_offset = read_offset

    # -- stop strings ----------------------------------------------------------------------

    def _release(self, new_text: str, window: tuple[int, int]) -> str:
        """Return the part of held + new text that can no longer be part of a stop string.

        ``window`` is the (prefix_offset, read_offset) that ``new_text`` was decoded with.
        """
        if not self._stop_strings:
            # Nothing to hold back: no string search on the per-token path.
            if new_text:
                self._chunks.append(new_text)
            return new_text
        text = self._held_text + new_text
        match = self._first_completed_stop(text)
        if match is None:
            num_held = self._longest_stop_prefix_suffix(text)
            out, self._held_text = text[: len(text) - num_held], text[len(text) - num_held :]
        else:
            stop, start = match
            end = start + len(stop)
            # The held text has no match of its own, so the match ends inside new_text.
            self._record_stop(stop, window, new_text[: end - len(self._held_text)])
            out = text[:end] if self._include_stop_string else text[:start]
            self._held_text = ""
        if out:
            self._chunks.append(out)
        return out

    def _first_completed_stop(self, text: str) -> tuple[str, int] | None:
        """(stop string, start) of the match that ends first; the longer one on a tie.

        Ending first is what a token-by-token stream would see first, so the choice does
        not depend on how the ids were split into pushes.
        """
        best = None
        for stop in self._stop_strings:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop))
            if best is None or key < best[0]:
                best = (key, stop, start)
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text:
            return 0
        last = text[-1]
        longest = 0
        for stop in self._stop_strings:
            # Only prefixes ending in the text's last character can match, so jump between
            # its occurrences in the stop string (usually none: one search per push).
            limit = min(len(stop) - 1, len(text))
            while (position := stop.rfind(last, longest, limit)) >= 0:
                if text.endswith(stop[: position + 1]):
                    longest = position + 1
                    break
                limit = position
        return longest

    def _record_stop(self, stop: str, window: tuple[int, int], needed_text: str) -> None:
        """Remember the stop and how many generated ids it took to produce the match.

        A push may carry several ids (speculative decoding accepts a few per step), so
        find the first one whose text completes the match: the server truncates there.
        Only runs once per request, so decoding here costs nothing per token.
        """
        prefix_offset, read_offset = window
        prefix_text = self._decode(prefix_offset, read_offset)
        end = len(self._ids)
        for candidate in range(read_offset + 1, len(self._ids)):
            text = self._decode(prefix_offset, candidate)
            if text[len(prefix_text) :].startswith(needed_text):
                end = candidate
                break
        self._matched_stop = stop
        self._num_tokens_at_stop = end - self._num_context_ids
