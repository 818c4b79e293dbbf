"""The range an objective (TTFT, TPOT) may take, wherever one is given: a request's, or an adapter's
default kept by the registry."""

from __future__ import annotations

from services.common.errors import InvalidArgument

MIN_SLO_MS = 1  # a smaller SLO is no objective anyone can meet, and 5e-324 ms is 0 s after the division
MAX_SLO_MS = 3_600_000


def check_slo_ms(value: float, param: str) -> float:
    """`value` if it is an objective in range (ms); InvalidArgument otherwise (NaN and infinities too)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not MIN_SLO_MS <= value <= MAX_SLO_MS:
        raise InvalidArgument(f"{param} must be a number between {MIN_SLO_MS} and {MAX_SLO_MS}, got {value!r}",
                              param=param)
    return float(value)
