"""Speculative decoding: proposers guess draft tokens, the target verifies them in one pass and the
rejection sampler keeps the output distribution exactly the target's."""
