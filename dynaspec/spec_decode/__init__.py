"""Speculative decoding, step by step: proposers that draft, lossless verification, acceptance statistics."""
