"""One call written as a JSON object, {"name": "f", "arguments": {...}} (hermes) or {"name": "f", "parameters":
{...}} (llama3_json), streamed as the model writes it.

    text so far                                  chunks out
    {"name": "get_weather", "argu                -                       (name known, arguments not started)
    {"name": "get_weather", "arguments": {"ci    head(id, name), '{"ci'
    ... {"city": "Paris"}                        'ty": "Paris"}'         (the arguments object is complete)
    ... {"city": "Paris"}}                       -                       (the call is done)

The arguments go out as the model's own text. An object whose keys come in another order, whose arguments are
a JSON string, or that is already complete when first seen is parsed whole first, and goes out as one head
and one fragment only if it is a call: so a reply parsed in one piece is checked before anything goes out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.entrypoints.openai.tool_calls import ToolCallChunk, ToolDeltas, new_call_id

_PLAIN = re.compile(r'[^"\\{}\[\]]+')
_IN_STRING = re.compile(r'[^"\\]+')
_CLOSE = {"}": "{", "]": "["}


class JsonScanner:
    """Where one JSON object, array or string ends, found incrementally: scan(text) is called with the value's
    text as it grows (always from the value's first character) and returns the end (exclusive) once it closes.
    Tracks brackets and strings only; is_bad once a bracket does not match or the value is not one of those."""

    def __init__(self) -> None:
        self.pos = 0
        self.stack: list[str] = []
        self.in_string = False
        self.is_escaped = False
        self.end: int | None = None
        self.is_bad = False

    def scan(self, text: str) -> int | None:
        i, n = self.pos, len(text)
        if i == 0 and n and text[0] not in '{["':
            self.is_bad = True
        while i < n and self.end is None and not self.is_bad:
            if self.in_string:
                if self.is_escaped:
                    self.is_escaped = False
                    i += 1
                    continue
                m = _IN_STRING.match(text, i)
                if m:
                    i = m.end()
                    continue
                ch = text[i]
                if ch == "\\":
                    self.is_escaped = True
                else:  # the closing quote
                    self.in_string = False
                    if not self.stack:
                        self.end = i + 1
                i += 1
                continue
            m = _PLAIN.match(text, i)
            if m:
                i = m.end()
                continue
            ch = text[i]
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.stack.append(ch)
            elif ch in "}]":
                if not self.stack or self.stack[-1] != _CLOSE[ch]:
                    self.is_bad = True
                    break
                self.stack.pop()
                if not self.stack:
                    self.end = i + 1
            else:  # a backslash outside a string
                self.is_bad = True
                break
            i += 1
        self.pos = i
        return self.end


class _Wait:
    pass


class _Mismatch:
    pass


WAIT, MISMATCH = _Wait(), _Mismatch()


def _ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _literal(text: str, pos: int, options: tuple[str, ...]) -> tuple[int, str] | _Wait | _Mismatch:
    """pos after whichever option text has at pos; WAIT if text ends inside one."""
    rest = text[pos:]
    for lit in options:
        if rest.startswith(lit):
            return pos + len(lit), lit
    if any(lit.startswith(rest) for lit in options):
        return WAIT
    return MISMATCH


@dataclass(frozen=True)
class _Head:
    name: str
    args_start: int
    """Index of the arguments value's first character ("{")."""


def parse_head(text: str, args_keys: tuple[str, ...]) -> _Head | _Wait | _Mismatch:
    """The name and where the arguments start, for an object written in the expected order:
    {"name": "<name>", "<args key>": {...  (any whitespace between)."""
    pos = _ws(text, 1)
    keys = tuple(f'"{k}"' for k in args_keys)
    steps: list[tuple[str, ...] | str] = [('"name"',), (":",), "name", (",",), keys, (":",)]
    name = ""
    for step in steps:
        if pos >= len(text):
            return WAIT
        if isinstance(step, str):  # the name's string
            if text[pos] != '"':
                return MISMATCH
            s = JsonScanner()
            end = s.scan(text[pos:])
            if end is None:
                return MISMATCH if s.is_bad else WAIT
            name = json.loads(text[pos : pos + end])
            pos += end
        else:
            got = _literal(text, pos, step)
            if not isinstance(got, tuple):
                return got
            pos = got[0]
        pos = _ws(text, pos)
    if pos >= len(text):
        return WAIT
    return _Head(name, pos) if text[pos] == "{" else MISMATCH


def parse_call_object(
    obj: object, args_keys: tuple[str, ...], tool_names: frozenset[str] | None
) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object, or None if it is not a call. Arguments given as a JSON
    string are decoded; tool_names (when given) must include the name."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):  # some models send the arguments already as text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class JsonCallStream:
    """One call object streamed (see the module docstring). feed(text) takes the object's text so far, from its
    "{"; after it, `end` is where the object ended (is_done), or is_bad: it is not a call and nothing went out."""

    def __init__(self, index: int, args_keys: tuple[str, ...], tool_names: frozenset[str] | None) -> None:
        self.index = index
        self.args_keys = args_keys
        self.tool_names = tool_names
        self.outer = JsonScanner()
        self.args = JsonScanner()
        self.head: _Head | None = None
        self.num_sent = 0
        """Characters of the arguments sent."""
        self.is_streaming = False
        self.is_bad = False
        self.end: int | None = None

    @property
    def is_done(self) -> bool:
        return self.end is not None

    def feed(self, text: str) -> ToolDeltas:
        out = ToolDeltas()
        if self.end is not None or self.is_bad:
            return out
        end = self.outer.scan(text)
        if not self.is_streaming:
            if self.outer.is_bad:
                self.is_bad = True
                return out
            if end is not None:  # whole: parse it first, then send it in one piece
                self._whole(text[:end], out)
                return out
            head = parse_head(text, self.args_keys)
            if isinstance(head, _Mismatch) or isinstance(head, _Wait):
                return out  # NOTE: another key order or not a call: decided once the object is whole
            if self.tool_names is not None and head.name not in self.tool_names:
                return out
            self.head, self.is_streaming = head, True
            out.chunks.append(ToolCallChunk(self.index, id=new_call_id(), name=head.name))
        assert self.head is not None
        start = self.head.args_start
        if self.args.end is None and not self.args.is_bad:
            self.args.scan(text[start:])
        upto = start + (self.args.end if self.args.end is not None else self.args.pos)
        if upto > start + self.num_sent:
            out.chunks.append(ToolCallChunk(self.index, arguments=text[start + self.num_sent : upto]))
            self.num_sent = upto - start
        if end is not None or self.outer.is_bad:
            self.end = end if end is not None else len(text)
        return out

    def _whole(self, obj_text: str, out: ToolDeltas) -> None:
        try:
            obj = json.loads(obj_text)
        except json.JSONDecodeError:
            self.is_bad = True
            return
        call = parse_call_object(obj, self.args_keys, self.tool_names)
        if call is None:
            self.is_bad = True
            return
        name, arguments = call
        head = parse_head(obj_text, self.args_keys)
        if isinstance(head, _Head):  # keys in the expected order: the model's own text, as a stream sends it
            raw = JsonScanner()
            n = raw.scan(obj_text[head.args_start :])
            if n is not None:
                arguments = obj_text[head.args_start : head.args_start + n]
        out.chunks += [
            ToolCallChunk(self.index, id=new_call_id(), name=name),
            ToolCallChunk(self.index, arguments=arguments),
        ]
        self.end = len(obj_text)
