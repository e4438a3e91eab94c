"""Structured outputs: grammar-constrained decoding (JSON schema, JSON object, regex, choice, Lark grammar).

    request.structured_outputs --compile (add_request: errors are a 400)--> GrammarMatcher per sample
    each step, before the forward:  matcher -> allowed-token bitmask rows (1 + drafts) -> StepInput.token_masks
    runner's sampler:               logits of banned tokens = -inf, before temperature / top-k / top-p
    after the scheduler's update:   matcher consumes the tokens the request kept

The grammar engine is llguidance (see docs/structured_outputs.md for why, measured against xgrammar).
"""
