"""Seconds to open a GGUF file (metadata + tensor index): tokenmill's header reader (models/gguf_file.py) vs
`gguf.GGUFReader`, on both offline models, alternating, best of 3 each.

    python benchmarks/gguf_open.py
"""

from __future__ import annotations

import time


def best(fn, n: int = 3) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main() -> None:
    import gguf

    from tokenmill.models.gguf_file import GGUFFile
    from tokenmill.models.loader import resolve_model_path

    print("| file | ours s | gguf.GGUFReader s | ratio |\n|---|---|---|---|")
    for alias in ("smollm2-135m", "gemma3-270m"):
        path = resolve_model_path(alias)
        ours = best(lambda path=path: GGUFFile(path))
        theirs = best(lambda path=path: gguf.GGUFReader(str(path)))
        print(f"| {path.name} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.0f}x |")


if __name__ == "__main__":
    main()
