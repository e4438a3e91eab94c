"""Engine flags shared by every CLI command, in vLLM's spelling, with help text taken from the
config dataclasses' field docstrings."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
from dataclasses import MISSING, fields

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields ("field: T = v" followed by a string literal)."""
    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(getattr(nxt, "value", None), ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def _type_names(f) -> set[str]:
    """The field's annotation without None ("float | None" -> {"float"})."""
    return {n.strip() for n in str(f.type).split("|")} - {"None"}


def _flag_type(f) -> type:
    """int, float or str, from the field's annotation ("float | None" -> float)."""
    names = _type_names(f)
    return {"int": int, "float": float}.get(names.pop(), str) if len(names) == 1 else str


def add_engine_args(
    parser: argparse.ArgumentParser, model_positional: bool = False, defaults: dict[str, object] | None = None
) -> None:
    """The config fields as flags. `defaults` overrides a field's default for this command (`tokenmill serve`
    turns the relative step-time target on; the library default stays off, so offline runs are unchanged)."""
    defaults = defaults or {}
    g = parser.add_argument_group("engine")
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        docs = _field_docs(cls)
        for f in fields(cls):
            if f.name == "model" and model_positional:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            default = defaults.get(f.name, default)
            help_ = docs.get(f.name, "")
            if isinstance(default, bool) or _type_names(f) == {"bool"}:
                g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
                continue
            g.add_argument(flag, dest=f.name, type=_flag_type(f), default=default, help=f"{help_} (default: {default})")
    g.add_argument(
        "--speculative-config",
        dest="speculative_config",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    kv_docs = _field_docs(KVTransferConfig)
    g.add_argument(
        "--kv-role",
        dest="kv_role",
        choices=["prefill", "decode", "both"],
        default=None,
        help=f"disaggregation: {kv_docs['kv_role']} (default: off, a colocated engine)",
    )
    g.add_argument(
        "--kv-transfer-config",
        dest="kv_transfer_config",
        type=json.loads,
        default=None,
        help="JSON with " + "; ".join(f"{k}: {v}" for k, v in kv_docs.items() if k != "kv_role"),
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if hasattr(args, f.name):
                kwargs[f.name] = getattr(args, f.name)
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        kwargs["speculative_config"] = SpeculativeConfig.from_dict(spec)
    kvt = getattr(args, "kv_transfer_config", None)
    role = getattr(args, "kv_role", None)
    if kvt is not None or role is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig.from_dict(
            {**(kvt or {}), **({"kv_role": role} if role else {})}
        )
    return EngineConfig.from_kwargs(**kwargs)
