"""The tool-call formats, one module each (registry and protocol: entrypoints/openai/tool_calls.py)."""
