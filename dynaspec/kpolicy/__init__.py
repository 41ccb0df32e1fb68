"""Choosing K: the speculative config, the K policies, the step-cost model, the profile maths (no torch)."""
