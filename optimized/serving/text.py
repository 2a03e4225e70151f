"""One request's output text as it streams: incremental detokenisation, with stop strings cut off.

Decoding the whole output again at every step costs O(n) per step (0.5 ms for 512 SmolLM2 tokens on the project's
2-core CPU, 16 µs for 8), so the text grows by decoding a short window instead (the method of Hugging Face's
text-generation-inference): ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``, where ``ids[prefix:read]``
are the tokens decoded last time. A window whose text ends in U+FFFD (a character split across tokens) waits for
the next token. The window's start stays put for up to ``_WINDOW`` tokens, so that ``decode(ids[prefix:read])`` is
the previous call's text, kept: one decode per streamed chunk instead of two; when the window has grown past that,
it starts again at the last read position (one decode more, as every call made before). The concatenated pieces
equal ``tokenizer.decode(all ids)`` for byte-level BPE tokenizers (tested against ``python -m optimized.generate`` in
tests/serving).

The engine stops a request at the token that completes a stop string; the text must not show it. While a request
runs, the last ``len(longest stop) - 1`` characters are held back (they could be the start of a stop string), so a
streamed text never shows what the final text cuts. Streaming and non-streaming responses both come from this
class, so they are equal by construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_SPLIT_CHAR = "\ufffd"  # what decode() shows for an incomplete UTF-8 sequence
# Tokens a decode window may span before it starts again. Decoding a window costs about the same for 2 or 8 short
# tokens (the call dominates: ~1.6 µs on the project's CPU); longer windows would grow that for nothing.
_WINDOW = 8


def plain_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, taken straight from the Rust tokenizer where that is
    the same text: 1.6 against 4.7 µs for a few SmolLM2 tokens on the project's CPU, and a stream decodes twice per
    chunk. The same text means a ``tokenizers``-backed transformers tokenizer whose ``decode`` and ``_decode`` are
    transformers' own (no subclass changes them) and which cleans nothing up afterwards
    (``clean_up_tokenization_spaces`` off, or a BPE model, for which transformers skips the clean-up). Any other
    tokenizer keeps its own ``decode``."""
    slow = functools.partial(tokenizer.decode, skip_special_tokens=True)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: nothing is known about its decode
        return slow
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None or cls._decode is not TokenizersBackend._decode
            or cls.decode is not PreTrainedTokenizerBase.decode):
        return slow
    bpe_skips = type(backend.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if tokenizer.clean_up_tokenization_spaces and not bpe_skips:
        return slow
    return functools.partial(backend.decode, skip_special_tokens=True)


class TextStream:
    """Feed it each step's new token ids; it returns the text that may be sent now."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._decode = plain_decoder(tokenizer)
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1  # characters that could start a stop string
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop string once one appears)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False  # a stop string appeared: the text is final
        self._prefix = self._read = 0
        self._prefix_text = ""  # decode(ids[_prefix:_read]), kept from the call that read up to _read

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Append tokens; returns the new text to send (everything left when ``finished``)."""
        self.ids.extend(token_ids)
        if not self.stopped:
            self.text += self._decode_window(flush=finished)
            self._cut_at_stop()
        end = len(self.text) if (finished or self.stopped) else max(self.sent, len(self.text) - self._hold)
        new, self.sent = self.text[self.sent:end], end
        return new

    def _decode_window(self, flush: bool) -> str:
        prefix = self._prefix_text
        full = self._decode(self.ids[self._prefix:])
        if len(full) <= len(prefix) or (full.endswith(_SPLIT_CHAR) and not flush):
            return ""  # nothing new, or a character still incomplete: wait for the next token
        if len(self.ids) - self._prefix > _WINDOW:  # start again at the last read (left context for the next token)
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        else:
            self._read, self._prefix_text = len(self.ids), full
        return full[len(prefix):]

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self.sent - self._hold)  # a stop string may begin in the held-back tail
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token for log-probability reports (special tokens shown, as OpenAI and vLLM do)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
