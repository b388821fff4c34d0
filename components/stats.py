"""Statistics the components share."""
from __future__ import annotations

import math
from statistics import NormalDist


def wilson_interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when there is no episode at all.

    Wilson rather than the normal approximation: it stays inside [0, 1] and is not degenerate at 0/n or n/n,
    which is exactly where expert and random baselines sit.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # exact bounds at the edges (the formula gives them up to rounding)
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high
