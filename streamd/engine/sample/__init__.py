"""Choosing tokens from logits: the batched sampler, beam search's candidate selection and search state, and
grammar matchers for structured outputs."""
