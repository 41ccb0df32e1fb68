"""Chi-square goodness of fit for the sampling tests (vocabularies of six tokens)."""

import numpy as np

# chi-square critical value for 5 degrees of freedom at p = 0.001
CHI2_CRIT = 20.52


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic of token counts against the probabilities they should follow."""
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
