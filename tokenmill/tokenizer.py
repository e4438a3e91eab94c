"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens and chat template.

Built from tokenizer.json (+ tokenizer_config.json) for HF directories, or from GGUF metadata
(vocabulary, merges, token types, pre-tokenizer name) for GGUF files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF `tokenizer.ggml.pre` -> split regex used before byte-level mapping.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class Tokenizer:
    hf: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None = None
    add_bos_token: bool = False
    """Prepend BOS ourselves (GGUF); HF tokenizer.json files add it in their post-processor."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token / eos_token strings, for chat templates."""

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        return {t for t in (self.hf.get_added_tokens_decoder()) if self.hf.get_added_tokens_decoder()[t].special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.add_bos_token:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    @property
    def template_renders_tools(self) -> bool:
        """The chat template has a tool format of its own (it reads a `tools` variable): Qwen2.5/3, Llama 3.x."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion (prompt) instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.special_tokens
        )


_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
"""GGUF `tokenizer.ggml.token_type` values (llama.cpp's token attributes)."""


def _spm_pieces(tokens: list[str], types: list[int]) -> list[str]:
    """Vocabulary strings: user-defined pieces with plain spaces get them as "▁" (Gemma's runs of spaces),
    the form BPE meets them in after normalization."""
    return [t.replace(" ", "▁") if types[i] == _USER else t for i, t in enumerate(tokens)]


def _spm_merges(pieces: list[str], types: list[int]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary (pieces in merge order, no merge list) as BPE merges: every split of a
    normal or user-defined piece into two pieces of the vocabulary is a merge, ranked by the merged piece's
    id (SentencePiece lists BPE pieces in the order it learned them; their scores fall with the id), then
    by the two halves' ids.

        pieces  a b ab c bc abc   (ids 0..5)
        merges  (a, b) (b, c) (a, bc) (ab, c)      (abc's two splits: ids of a < ab)
    """
    kinds = (_NORMAL, _USER)
    ids = {t: i for i, t in enumerate(pieces) if types[i] in kinds}
    ranked = []
    for i, tok in enumerate(pieces):
        if types[i] not in kinds or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            ia, ib = ids.get(tok[:k]), ids.get(tok[k:])
            if ia is not None and ib is not None:
                ranked.append((i, ia, ib))
    ranked.sort()
    return [(pieces[a], pieces[b]) for _, a, b in ranked]


def _spm_tokenizer_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    """`tokenizer.ggml.model` "llama": a SentencePiece BPE vocabulary (Gemma, Llama 2) with byte fallback.
    Spaces become "▁" and are not split on; control tokens are special; user-defined pieces (Gemma's runs of
    newlines and tabs, HTML tags) are matched whole before BPE, except those holding a plain space (Gemma's
    runs of spaces): after the space -> "▁" normalization no text holds them, so they are "▁" pieces reached
    by merges. This is what Hugging Face's own conversion of the file does (tests/models/test_gemma3.py
    compares the two on ShareGPT text)."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    pieces = _spm_pieces(tokens, types)
    vocab = {}
    for i, tok in enumerate(pieces):
        vocab.setdefault(tok, i)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(pieces, types),
            byte_fallback=True,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
        )
    )
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = None
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _USER and " " not in tokens[i]
    ]
    if user:
        hf.add_tokens(user)
    return _gguf_tokenizer(hf, tokens, fields)


def _gguf_tokenizer(hf: HFTokenizer, tokens: list[str], fields: dict[str, Any]) -> Tokenizer:
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    special = {}
    if bos is not None:
        special["bos_token"] = tokens[bos]
    if eos is not None:
        special["eos_token"] = tokens[eos]
    return Tokenizer(
        hf=hf,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=fields.get("tokenizer.chat_template"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        special_tokens=special,
    )


def tokenizer_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    """fields: decoded GGUF metadata (key -> python value)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind == "llama":
        return _spm_tokenizer_from_gguf(fields)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece BPE)"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        # SmolLM's own tokenizer.json: digits one by one, then GPT-2's byte-level split.
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == 3 and set(tokens[i]) <= alphabet
    ]
    hf.add_special_tokens(control)
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER]
    if user:
        hf.add_tokens(user)
    return _gguf_tokenizer(hf, tokens, fields)


def tokenizer_from_dir(path: Path, config: dict[str, Any]) -> Tokenizer:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: missing (a Hugging Face checkpoint needs tokenizer.json)")
    try:
        hf = HFTokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"{tok_file}: not a valid tokenizer.json ({e})") from e
    tc: dict[str, Any] = {}
    tc_file = path / "tokenizer_config.json"
    if tc_file.is_file():
        tc = json.loads(tc_file.read_text())

    def token_str(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    bos_s, eos_s = token_str(tc.get("bos_token")), token_str(tc.get("eos_token"))
    bos = hf.token_to_id(bos_s) if bos_s else config.get("bos_token_id")
    eos = hf.token_to_id(eos_s) if eos_s else None
    if eos is None:
        e = config.get("eos_token_id")
        eos = e[0] if isinstance(e, list) else e
    template = tc.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    special = {k: v for k, v in (("bos_token", bos_s), ("eos_token", eos_s)) if v}
    return Tokenizer(
        hf=hf, bos_token_id=bos, eos_token_id=eos, chat_template=template, add_bos_token=False, special_tokens=special
    )
