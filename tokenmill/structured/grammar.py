"""Compiling a StructuredOutputs constraint and walking it token by token (llguidance).

A bitmask row is the allowed set of one position, 32 tokens per int32 word, token t at bit t % 32 of word
t // 32 (llguidance's layout):

    vocabulary of 40 tokens, allowed {0, 2, 33}:  words = [0b101, 0b10]  (2 words: ceil(40 / 32))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

_JSON_OBJECT_SCHEMA = {"type": "object"}


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def is_llguidance_json(grammar: str) -> bool:
    """A grammar given in llguidance's own top-level form, {"grammars": [...]}, where one grammar may reference
    another by name (`@body`): how composite constraints are written (structured/reasoning.py). Neither Lark nor
    GBNF text can start with "{"."""
    return grammar.lstrip().startswith("{")


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (a top-level JSON object, or Lark text), not yet checked against a
    tokenizer; an InvalidRequest naming structured_outputs.<kind> when it cannot be built."""
    import llguidance

    M = llguidance.LLMatcher
    kind = spec.kinds()[0]
    param = f"structured_outputs.{kind}"
    try:
        if kind == "json" or kind == "json_object":
            schema = _JSON_OBJECT_SCHEMA if kind == "json_object" else spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InvalidRequest(f"{param}: the schema is not valid JSON: {e}", param) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"{param}: a JSON schema must be an object", param)
            return M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if kind == "regex":
            assert spec.regex is not None
            return M.grammar_from_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        assert spec.grammar is not None
        if is_llguidance_json(spec.grammar):
            json.loads(spec.grammar)  # NOTE: a clear message for broken JSON; llguidance checks the rest
            return spec.grammar
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp's) or Lark, either way

        return M.grammar_from_lark(any_to_lark(spec.grammar))
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError with its message
        raise InvalidRequest(f"{param}: {e}", param) from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint ready to start matchers from: llguidance's grammar text and what it came from."""

    grammar: str
    kind: str
    """json, json_object, regex, choice or grammar."""


class GrammarMatcher:
    """One sample's position in its grammar: the allowed tokens now, and the tokens it has taken."""

    def __init__(self, matcher, num_words: int) -> None:
        self._m = matcher
        self.num_words = num_words
        self.num_consumed = 0
        """Output tokens consumed so far (the engine feeds it output_token_ids[num_consumed:])."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed set of the next token into `out` (int32 [num_words], C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, tokens: Sequence[int]) -> bool:
        """Take tokens the request kept; False if one is not allowed (the matcher is then in error)."""
        ok = self._m.consume_tokens(list(tokens))
        if ok:
            self.num_consumed += len(tokens)
        return ok

    def try_consume(self, tokens: Sequence[int]) -> int:
        """Take the longest allowed prefix of `tokens` (drafts); how many were taken (undo with rollback)."""
        return self._m.try_consume_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            assert self._m.rollback(num_tokens), "llguidance refused a rollback"

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing may follow (only EOS is allowed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def copy(self) -> GrammarMatcher:
        m = GrammarMatcher(self._m.deep_copy(), self.num_words)
        m.num_consumed = self.num_consumed
        return m


class GrammarCompiler:
    """Turns StructuredOutputs into matchers for one tokenizer and vocabulary (built once per engine)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        try:
            import llguidance
        except ImportError as e:  # NOTE: a declared dependency; a clear message if an install lost it
            raise RuntimeError("structured outputs need the llguidance package (pip install llguidance)") from e
        self._llg = llguidance
        self.vocab_size = vocab_size
        self.num_words = num_mask_words(vocab_size)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._cache: dict[str, CompiledGrammar] = {}

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The grammar of `spec`, validated; an InvalidRequest naming the problem if it is not valid."""
        kind = spec.kinds()[0]
        key = json.dumps([kind, spec.json, spec.regex, spec.choice, spec.grammar], sort_keys=True, default=str)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        M = self._llg.LLMatcher
        param = f"structured_outputs.{kind}"
        grammar = grammar_text(spec)
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequest(f"{param}: {messages[0] if messages else 'invalid grammar'}", param)
        compiled = CompiledGrammar(grammar, kind)
        if len(self._cache) < 512:
            self._cache[key] = compiled
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        m = self._llg.LLMatcher(self.tokenizer, compiled.grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(
                f"structured_outputs.{compiled.kind}: {m.get_error()}", f"structured_outputs.{compiled.kind}"
            )
        return GrammarMatcher(m, self.num_words)
