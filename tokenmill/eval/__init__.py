"""Model evaluation: WikiText-2 perplexity with the GPTQ/AWQ papers' protocol."""
