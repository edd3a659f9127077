"""Sampling: per-request sampling state on the device, the sampler, and logprobs."""
