"""Small pieces the streaming reply parsers share: holding back what might be the start of a tag, and streaming a
text as its .strip() would read."""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (what to hold back: it may become tag).

    partial_suffix("abc</thi", "</think>") == 5;  partial_suffix("abc", "</think>") == 0
    """
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StrippedStream:
    """A text fed in pieces, passed on as the whole text .strip()ped would read: leading whitespace dropped,
    whitespace held back until more text follows it (dropped if none does)."""

    def __init__(self) -> None:
        self.held = ""
        self.is_started = False

    def feed(self, delta: str) -> str:
        text = self.held + delta
        if not self.is_started:
            text = text.lstrip()
            self.is_started = bool(text)
        body = text.rstrip()
        self.held = text[len(body) :]
        return body
