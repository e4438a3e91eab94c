"""Per-request sampling parameters. Temperature 0 means greedy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequest

_GREEDY_EPS = 1e-5

OUTPUT_KINDS = ("cumulative", "delta", "final")

POOLING_TYPES = ("last", "mean")
"""How an embedding pools a prompt's final hidden states: the last token's, or the mean over every token."""


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's `structured_outputs` fields): exactly one of them is set."""

    json: dict | str | None = None
    """A JSON schema (an object or its text): the output is one JSON value that validates against it."""
    json_object: bool = False
    """The output is one JSON object (any keys)."""
    regex: str | None = None
    """The output matches this regular expression (whole output)."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect) or GBNF (llama.cpp's)."""

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequest(
                "structured_outputs: set exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(kinds)})" if kinds else ""),
                param="structured_outputs",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest(
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                param="structured_outputs.choice",
            )

    def kinds(self) -> list[str]:
        return [
            k
            for k, v in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if v
        ]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction; errors name the field."""

    n: int = 1
    """Number of samples to return for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 selects greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI semantics)."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in the prompt or output (CTRL)."""
    seed: int | None = None
    """Seed for this request's own random stream; reproducible whatever else is batched."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the output ends before the first occurrence (OpenAI semantics)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the token is kept in token_ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the max model length. 0: compute the prompt only
    and finish without sampling (for prompt_logprobs, or an embedding's pooling)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Return the log-probability of the sampled token plus the top-N alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-probability of every prompt token given the tokens before it, plus the top-N alternatives
    at each position (vLLM's RequestOutput.prompt_logprobs: None for the first token). Such a prompt skips the
    prefix cache: every position's logits are computed (docs/apis.md)."""
    pooling: str | None = None
    """Embedding instead of text: pool the prompt's final hidden states ("last" token or "mean"), L2-normalised,
    into RequestOutput.embedding. Needs max_tokens 0."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (tokenmill.structured)."""
    output_kind: str = "cumulative"
    """What each RequestOutput holds: "cumulative" (everything so far), "delta" (only what is new since the
    last output: streaming readers; see RequestOutput.merge), or "final" (one output, when finished)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", "must be an integer >= 0")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise bad("pooling", f"must be one of {', '.join(POOLING_TYPES)}")
            if self.max_tokens != 0:
                raise bad("pooling", "needs max_tokens 0 (an embedding generates nothing)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")

    @property
    def is_prompt_only(self) -> bool:
        """The request computes its prompt and finishes without sampling (max_tokens 0)."""
        return self.max_tokens == 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
