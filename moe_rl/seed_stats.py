"""Statistics over seeds that the library and `analysis/` share: the mean with its Student t interval.

`moe_rl.trainer.compare` (the end-of-sweep table) and `analysis` (reports, figures) both print means over
seeds with a 95% confidence interval; the one definition lives here, in the library, and `analysis.stats`
re-exports it with its further tests (nothing in `moe_rl/` imports `analysis/`).

Non-finite values are dropped first (a seed whose value is NaN does not count in n); with n < 2 a mean has
no interval (half-width nan).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
CI_NOTE = "mean ± 95% CI half-width over seeds (Student t, n - 1 dof); n = seeds with a finite value"


def finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """The finite entries of `values` as float64."""
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[np.isfinite(v)]


@dataclass(frozen=True)
class MeanCI:
    """A mean over seeds with its confidence interval: mean ± half (nan half when n < 2)."""

    mean: float
    half: float
    n: int

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def format(self, digits: int = 4) -> str:
        """The cell text: "0.5123 ± 0.0412", "0.5123 ± –" with one seed, "n/a" with none."""
        if self.n == 0:
            return "n/a"
        half = "–" if not math.isfinite(self.half) else f"{self.half:.2g}"
        return f"{self.mean:.{digits}g} ± {half}"


def mean_ci(values: Sequence[float] | np.ndarray, level: float = LEVEL) -> MeanCI:
    """Mean of the finite values with the Student t interval  mean ± t_{n-1,(1+level)/2} · s / sqrt(n)."""
    from scipy import stats as sps  # here, not above: scipy.stats takes about a second to import

    v = finite(values)
    if v.size == 0:
        return MeanCI(math.nan, math.nan, 0)
    if v.size == 1:
        return MeanCI(float(v[0]), math.nan, 1)
    sem = v.std(ddof=1) / math.sqrt(v.size)
    return MeanCI(float(v.mean()), float(sps.t.ppf((1 + level) / 2, v.size - 1) * sem), int(v.size))
