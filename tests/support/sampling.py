"""SamplingTensors for tests of the pure sampling functions: row i seeded with i, at output position 0."""

import torch

from dynaspec.engine.sampler import Penalties, SamplingTensors


def sampling_rows(
    temperatures: list[float],
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties | None = None,
    positions: list[int] | None = None,
) -> SamplingTensors:
    n = len(temperatures)
    return SamplingTensors(
        temperature=torch.tensor(temperatures, dtype=torch.float32),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p),
        seeds=torch.arange(n, dtype=torch.long),
        positions=torch.tensor(positions or [0] * n, dtype=torch.long),
        all_greedy=all(t == 0 for t in temperatures),
        penalties=penalties,
        num_logprobs=[None] * n,
    )
