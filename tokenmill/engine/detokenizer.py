"""Incremental detokenization with stop strings.

Each step decodes a small window of token ids: text(prefix_offset:) minus text(prefix_offset:
read_offset). While the window ends in an incomplete UTF-8 sequence the decoder yields U+FFFD
and nothing is emitted until the character completes. Stop strings follow OpenAI: the text ends
before the first occurrence. While running, the last (longest stop - 1) characters are held
back from `visible_text` so a stop string that spans tokens is never streamed half-way.
"""

from __future__ import annotations

from tokenmill.tokenizer import Tokenizer

_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.num_decoded = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched, if any (text is then truncated)."""
        for tok in new_token_ids:
            self.token_ids.append(tok)
            self.num_decoded += 1
            before = len(self.text)
            prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special)
            full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            if self.stop and len(self.text) > before:
                hit = self._find_stop(before)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, before: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_len(self, finished: bool) -> int:
        """Characters of `text` that may be shown: all once finished, else all but the held-back tail."""
        if finished or not self.holdback:
            return len(self.text)
        return max(0, len(self.text) - self.holdback)

    def visible_text(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)]
