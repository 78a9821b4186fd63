"""A number measured over several seeds: mean, sample std, min, max and every value; a rate's interval."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """A cell over seeds: the mean, the sample std (0 for one seed), min, max, and every value."""

    mean: float
    std: float
    lo: float
    hi: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values) -> "Spread":
        v = tuple(float(x) for x in values)
        if not v:
            raise ValueError("a Spread needs at least one value")
        m = sum(v) / len(v)
        sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
        return cls(m, sd, min(v), max(v), v)

    def __float__(self) -> float:
        return self.mean

    def format(self, fmt: str = "{:.3f}") -> str:
        """'0.750 ± 0.250' over several seeds, '0.750' for one."""
        return fmt.format(self.mean) + (" ± " + fmt.format(self.std) if len(self.values) > 1 else "")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95 %) of a rate of k in n: the solve rate's interval over seeds."""
    p = k / n
    centre, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return max(0.0, centre - half), min(1.0, centre + half)
