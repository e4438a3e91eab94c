"""pythonic: calls as a Python list of function calls with keyword arguments (Llama 3.2 / Llama 4, ToolACE):

    [get_weather(city="Paris"), add(a=1, b=2)]

Read with `ast` (never eval): each argument's value must be a literal (strings, numbers, True/False/None, and
lists, tuples and dicts of them); JSON's true/false/null are read too, since the forcing grammar writes values
as JSON. The reply must start with "[" to hold calls; text after the list is content. The arguments go out as
JSON text, json.dumps of the keyword arguments in order: streamed, the head at "name(", then one fragment per
argument as its "," or ")" arrives ('{"city": "Paris"', then '}').
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tokenmill.entrypoints.openai.tool_calls import CutCalls, ToolCallChunk, ToolDeltas, call_arguments, new_call_id
from tokenmill.entrypoints.openai.tool_parsers.hermes import max_calls

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class PythonicToolParser:
    name = "pythonic"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        sigs = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        return (
            "You are an expert in composing functions. If you decide to invoke any of the function(s), you MUST "
            "put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
            "func_name2(params)]\nYou SHOULD NOT include any other text in the response if you call a function.\n"
            f"Here is a list of functions in JSON format that you can invoke.\n{sigs}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        def one(c: dict[str, Any]) -> str:
            args = call_arguments(c["function"].get("arguments"))
            kw = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
            return f"{c['function']['name']}({kw})" if isinstance(args, dict) else f"{c['function']['name']}()"

        return "[" + ", ".join(one(c) for c in calls) + "]"

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        n = max_calls(functions, parallel)
        more = f' (", " call){{0,{n - 1}}}' if n > 1 else ""
        rules = [f'start: "[" call{more} "]"', "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            rules += _call_rules(f"call_{i}", f)
        return "\n".join(rules) + "\n"

    def streamer(self, tool_names: frozenset[str]) -> PythonicStreamer:
        return PythonicStreamer(tool_names)


def _call_rules(rule: str, function: dict[str, Any]) -> list[str]:
    """Lark for name(k=v, ...): the required arguments in the schema's order, then any of the optional ones in
    order; each value `%json` of its property's schema (compact)."""
    params = function.get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    required = [k for k in props if k in set(params.get("required") or [])]
    optional = [k for k in props if k not in required]
    rules = []
    for j, key in enumerate(props):
        prop = props[key] if isinstance(props[key], dict) else {}
        schema = {**prop, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"{rule}_{j}: {json.dumps(key + '=')} %json {json.dumps(schema)}")
    kw = {key: f"{rule}_{j}" for j, key in enumerate(props)}

    def tail(keys: list[str]) -> list[str]:
        return [f'(", " {kw[k]})?' for k in keys]

    if required:
        args = [' ", " '.join(kw[k] for k in required), *tail(optional)]
    elif optional:  # the first optional argument present has no comma before it
        firsts = [" ".join([kw[k], *tail(optional[i + 1 :])]) for i, k in enumerate(optional)]
        args = ["(" + " | ".join(firsts) + ")?"]
    else:
        args = []
    rules.insert(0, " ".join([f"{rule}: {json.dumps(function['name'] + '(')}", *args, '")"']))
    return rules


def _literal(node: ast.expr) -> Any:
    """The value of a literal expression (ValueError if it is anything else)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_literal(k) for k in node.keys if k is not None]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, [_literal(v) for v in node.values]))
    value = ast.literal_eval(node)  # constants, negative numbers
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise ValueError(f"not a JSON-like literal: {type(value).__name__}")


def _keyword(text: str) -> tuple[str, Any] | None:
    """One `name=value` argument, or None if it is not one."""
    try:
        tree = ast.parse(f"f({text})", mode="eval")
    except SyntaxError:
        return None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
        return None
    try:
        return call.keywords[0].arg, _literal(call.keywords[0].value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def parse_call_list(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a whole list of calls, or None if it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if node.func.id not in tool_names:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        out.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return out


class PythonicStreamer:
    """HEAD (whitespace) -> LIST (after "[": calls, each streamed) -> CONTENT (after "]", or a reply that is not
    a list of calls). The list is scanned character by character, Python strings and brackets tracked; a list
    already whole when first seen is parsed whole first (so a reply parsed in one piece is checked before
    anything goes out)."""

    _HEAD, _LIST, _CONTENT = range(3)

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.state = self._HEAD
        self.buf = ""
        self.pos = 0
        """Scanned up to here in buf (LIST)."""
        self.depth = 0
        """Brackets open inside the current call's parentheses."""
        self.quote: str | None = None
        self.is_escaped = False
        self.call_start: int | None = None
        """Where the current call's name starts; None between calls."""
        self.arg_start = 0
        self.num_args = 0
        self.num_calls = 0
        self.is_streaming = False

    def feed(self, delta: str) -> ToolDeltas:
        self.buf += delta
        out = ToolDeltas()
        if self.state == self._HEAD:
            head = self.buf.lstrip()
            if not head:
                return out
            if not head.startswith("["):
                self.state = self._CONTENT
            else:
                end = _list_end(head)
                if end is not None:  # whole already: all calls, or all content
                    calls = parse_call_list(head[:end], self.tool_names)
                    if calls is None:
                        self.state = self._CONTENT
                    else:
                        for i, (name, args) in enumerate(calls):
                            out.chunks += [
                                ToolCallChunk(i, id=new_call_id(), name=name),
                                ToolCallChunk(i, arguments=args),
                            ]
                        self.num_calls, self.buf, self.state = len(calls), head[end:], self._CONTENT
                else:
                    self.state, self.buf, self.pos = self._LIST, head, 1
        if self.state == self._LIST:
            self._scan(out)
        if self.state == self._CONTENT:
            out.prose += self.buf
            self.buf = ""
        return out

    def _scan(self, out: ToolDeltas) -> None:
        buf = self.buf
        while self.pos < len(buf) and self.state == self._LIST:
            ch = buf[self.pos]
            if self.call_start is None:  # between calls: whitespace, ",", "]" or a name then "("
                if ch in " \t\r\n" or (ch == "," and self.num_calls):
                    self.pos += 1
                elif ch == "]" and self.num_calls:
                    self.buf, self.state = buf[self.pos + 1 :], self._CONTENT
                    return
                else:
                    m = _NAME.match(buf, self.pos)
                    if m is None or (m.end() == len(buf)):
                        if m is None:
                            self._give_up()
                        return  # NOTE: the name may go on
                    after = m.end()
                    if buf[after] != "(" or m.group() not in self.tool_names:
                        self._give_up()
                        return
                    self.call_start, self.arg_start, self.num_args = self.pos, after + 1, 0
                    self.is_streaming = True
                    out.chunks.append(ToolCallChunk(self.num_calls, id=new_call_id(), name=m.group()))
                    self.pos = after + 1
                continue
            if self.quote is not None:
                if self.is_escaped:
                    self.is_escaped = False
                elif ch == "\\":
                    self.is_escaped = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth:
                self.depth -= 1
            elif ch in ",)" and not self.depth:
                self._argument(buf[self.arg_start : self.pos], ch == ")", out)
                self.arg_start = self.pos + 1
                if ch == ")":
                    self.call_start = None
                    self.num_calls += 1
            self.pos += 1

    def _argument(self, text: str, is_last: bool, out: ToolDeltas) -> None:
        """One argument of the current call is complete: its fragment (and the call's closing brace)."""
        frag = ""
        if text.strip():
            kw = _keyword(text)
            if kw is None:  # NOTE: the call is already out; this argument is dropped, the JSON still closes
                frag = ""
            else:
                frag = ("{" if self.num_args == 0 else ", ") + json.dumps(kw[0]) + ": "
                frag += json.dumps(kw[1], ensure_ascii=False)
                self.num_args += 1
        if is_last:
            frag += "}" if self.num_args else "{}"
        if frag:
            out.chunks.append(ToolCallChunk(self.num_calls, arguments=frag))

    def _give_up(self) -> None:
        """Not a list of calls: everything not yet sent as a call is content."""
        if self.num_calls == 0 and not self.is_streaming:
            self.state = self._CONTENT
            return
        self.buf, self.state = self.buf[self.pos :], self._CONTENT

    def flush(self) -> ToolDeltas:
        rest, self.buf = self.buf, ""
        if self.state == self._LIST and not self.is_streaming:
            return ToolDeltas(prose=rest)
        if self.state == self._LIST:  # the list never closed: not a list of calls, for a whole reply
            return ToolDeltas(cut=CutCalls(0, rest))
        return ToolDeltas(prose=rest)


def _list_end(text: str) -> int | None:
    """The end (exclusive) of the bracketed list text starts with, Python strings skipped; None if it is open."""
    depth, quote, is_escaped = 0, None, False
    for i, ch in enumerate(text):
        if quote is not None:
            if is_escaped:
                is_escaped = False
            elif ch == "\\":
                is_escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
