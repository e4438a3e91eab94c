"""Benchmarks: `tokenmill bench latency|throughput|serve|roofline|ablation|suite`.

Definitions follow vLLM's benchmark scripts so figures are comparable across engines. Peers (Hugging
Face transformers, llama.cpp) run in the same process and are reported as absent when not installed.
"""
