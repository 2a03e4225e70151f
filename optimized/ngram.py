"""The n-gram (prompt-lookup) proposer of the engine: ``reference/ngram.py``'s proposals from an incremental index.

The reference scans the whole context for every n at every step, ``O(L · max_n)`` Python operations per request; at
a few hundred requests of a thousand tokens that is tens of milliseconds of host time per step. The lookup takes the
*earliest* occurrence of the suffix, and an earliest occurrence never changes once a token is appended, so the engine
keeps, per request, a table ``first[g] = i`` from every n-gram ``g`` (``min_n ≤ n ≤ max_n``) to the start of its
first occurrence, extended with the tokens each step emits (``max_n - min_n + 1`` dictionary writes per token).

The proposal then takes one lookup per ``n``: the suffix ``g = c[L-n:]`` recurs iff ``first[g] < L - n`` (its first
occurrence is not itself), and ``first[g]`` is exactly the reference's ``i``. The proposals equal the reference's,
token for token (``tests/equivalence/test_ngram.py``). Like vLLM's ``ngram`` method, this runs on the host: the
tokens it reads are already there (the step's one token read brought them), and no device work waits for it.

Names follow ``docs/method.md`` (``γ`` block size).
"""

from __future__ import annotations

from reference.config import NgramConfig


class NgramIndex:
    """One request's tokens and the first occurrence of each of their n-grams; :meth:`propose` is the lookup."""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.tokens: list[int] = []  # the context c so far (prompt + output)
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> start of its earliest occurrence in c

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the context and index the n-grams that end at each of them."""
        lo, hi = self.config.min_n, self.config.max_n
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(lo, min(hi, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n:]), end - n)  # keeps the earliest start

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catch up with a request whose context ``prompt + output`` grew (only the tail is new; nothing is copied)."""
        seen = len(self.tokens)
        if seen < len(prompt):
            self.extend(prompt[seen:])
            seen = len(prompt)
        self.extend(output[seen - len(prompt):])

    def match(self) -> tuple[int, int] | None:
        """``reference.ngram.find_match`` of the indexed context: ``(n, i)`` of the longest recurring suffix and its
        earliest occurrence, or None."""
        cfg, c = self.config, self.tokens
        length = len(c)
        for n in range(min(cfg.max_n, length - 1), cfg.min_n - 1, -1):
            start = self.first[tuple(c[length - n:])]  # the suffix itself is indexed, so the key exists
            if start < length - n:  # an earlier occurrence: the one the reference finds first
                return n, start
        return None

    def propose(self, gamma: int | None = None) -> list[int]:
        """``reference.ngram.propose`` of the indexed context: up to γ tokens after the longest recurring suffix."""
        gamma = self.config.gamma if gamma is None else gamma
        match = self.match()
        if match is None:
            return []
        n, start = match
        return self.tokens[start + n:start + n + gamma]
