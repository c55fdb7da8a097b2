"""float32 rounding-error bounds for the numeric tests (Higham, Accuracy and Stability of
Numerical Algorithms, ch. 3), so that tolerances follow from the sizes and the data, not from
one CPU's observed error.

u = 2**-24 is float32's unit roundoff; gamma(n) = n u / (1 - n u). A dot product of length n
computed in float32 in any order, with or without FMA, satisfies
|fl(x.y) - x.y| <= gamma(n) * sum_i |x_i y_i|. References are computed in float64 (their own
error, ~1e-16 relative, is neglected), so each bound is the float32 side's alone.
"""

from __future__ import annotations

import torch

U = 2.0 ** -24  # float32 unit roundoff
# exp_nonpositive (csrc/cpu_kernels.cpp): Horner of degree 7 on |r| <= ln2/2 is within
# gamma(14) * e^{2|r|} <= 28u of the series, the truncation is < 0.2u, the range reduction
# < 0.5u; torch's own exp is within a few ulp. 32u covers both.
EXP_RELATIVE = 32 * U


def gamma(n: int | torch.Tensor) -> float | torch.Tensor:
    """gamma_n = n u / (1 - n u): the relative error bound of n float32 operations."""
    return n * U / (1 - n * U)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float,
                  what: str = "") -> None:
    """|actual - expected| <= bound element-wise (in float64); the message gives the worst
    ratio error / bound and where it is."""
    error = (actual.double() - expected.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(error)
    over = error > bound
    if bool(over.any()):
        ratio = error / bound.clamp(min=1e-300)
        worst = int(ratio.argmax())
        raise AssertionError(f"{what}: {int(over.sum())} of {error.numel()} elements exceed the "
                             f"float32 bound; worst at flat index {worst}: error "
                             f"{float(error.flatten()[worst]):.3e} > bound "
                             f"{float(bound.flatten()[worst]):.3e}")


def max_ratio(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    """max |actual - expected| / bound: > 1 means the bound rejects `actual`."""
    return float(((actual.double() - expected.double()).abs() / bound).max())
