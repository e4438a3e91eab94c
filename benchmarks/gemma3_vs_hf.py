"""Gemma 3 270M logits vs Hugging Face transformers loading the same GGUF, float32: max abs difference per
prompt for the 8 prompts of tests/models/test_numerics.py, whole prompts and in 3-token paged chunks (the test
asserts <= 1e-3; this prints the figures).

    python benchmarks/gemma3_vs_hf.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from tests.models.test_numerics import PROMPTS, hf_logits, paged_logits
    from tokenmill.models.loader import load_model, resolve_model_path

    path = resolve_model_path("gemma3-270m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = load_model(str(path), dtype=torch.float32)
    ids = [ours.tokenizer.encode(p) for p in PROMPTS]
    for chunk in (1000, 3):
        diffs = [(g - hf_logits(hf, i)).abs().max().item() for g, i in zip(paged_logits(ours, ids, chunk=chunk), ids)]
        print(f"chunk {chunk}: max abs diff per prompt {', '.join(f'{d:.1e}' for d in diffs)}; max {max(diffs):.1e}")


if __name__ == "__main__":
    main()
