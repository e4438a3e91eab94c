"""The offline API, shaped like vLLM's:

from tokenmill import LLM, SamplingParams
llm = LLM(model="smollm2-135m", dtype="float32", max_num_seqs=64)
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchRunner
from tokenmill.engine.core import EngineCore
from tokenmill.engine.stats import EngineStats
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, truncate_embedding
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PromptType = str | list[int] | dict[str, Any]


def _is_one_prompt(prompts: PromptType | Sequence[PromptType]) -> TypeIs[PromptType]:
    """One prompt (text, token ids, a dict) rather than a sequence of them."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    )


def _is_one_conversation(
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
) -> TypeIs[list[dict[str, Any]]]:
    """One conversation (a list of messages) rather than a list of them."""
    return bool(messages) and isinstance(messages[0], dict)


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text, a list of token ids, or
        {"prompt": text} / {"prompt_token_ids": ids}, optionally with "cache_salt". Requests share
        prefix-cache blocks only when their cache_salt (per prompt, else the argument) is equal."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                text, token_ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                salt = prompt.get("cache_salt", cache_salt) if isinstance(prompt, dict) else cache_salt
                self.engine.add_request(rid, token_ids, p, prompt=text, cache_salt=salt)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling: str = "last",
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's LLM.embed): the prompt's final hidden states pooled ("last"
        token or "mean") and L2-normalised; dimensions: keep the first values, normalised again (Matryoshka).
        The prompts are batched through the scheduler like any prefill and finish without sampling."""
        if dimensions is not None and not 0 < dimensions <= self.engine.arch.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.engine.arch.hidden_size}], got {dimensions}")
        outs = self.generate(prompts, SamplingParams(max_tokens=0, pooling=pooling, output_kind="final"), use_tqdm)
        result = []
        for o in outs:
            assert o.embedding is not None, "a pooling request finishes with its embedding"
            vec = o.embedding if dimensions is None else truncate_embedding(o.embedding, dimensions)
            result.append(EmbeddingRequestOutput(o.request_id, EmbeddingOutput(vec), o.prompt_token_ids, o.finished))
        return result

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, cache_salt: str | None = None
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's LLM.beam_search shape); beams share KV blocks by
        reference with copy-on-write (engine/beam_search.py). One BeamSearchOutput per prompt."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("beam_search needs an idle engine")
        if _is_one_prompt(prompts):
            prompts = [prompts]
        ids = [self._tokenize(p)[1] for p in prompts]
        return BeamSearchRunner(self, params, cache_salt).run(ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if _is_one_conversation(messages) else messages
        prompts = [{"prompt": self.tokenizer.apply_chat_template(c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            # Chat-templated text already carries its special tokens.
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=False)
        return None, list(prompt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2, unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()
