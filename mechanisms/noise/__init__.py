"""The one home of randomness for releases (docs/privacy/finite_precision.md#finite-precision, finite
precision).

Every random bit a mechanism uses comes from a ``Noise`` object built here: production draws from the OS
CSPRNG (``Noise.system()``); tests may build a deterministic SHAKE-256 stream from a seed
(``Noise.seeded(seed)``), which the service never does. The samplers are exact: integer arithmetic only,
rejection sampling over uniform integers (Canonne, Kamath, Steinke 2020, "The discrete Gaussian for
differential privacy", Algorithms 1–3), so their output distribution is the stated pmf with no floating-point
error. Real-valued answers are released on a public grid (``Grid``): the answer is rounded to a multiple of
γ = 2^k and integer noise (in units of γ) is added, so the release is an exact multiple of γ.
"""

from mechanisms.noise.exact import Noise
from mechanisms.noise.grid import (
    Grid,
    dyadic_scale_up,
    float_up,
    gaussian_grid,
    gaussian_on_grid,
    grid_l1_sensitivity,
    grid_l2_sensitivity,
    laplace_grid,
    laplace_on_grid,
)

__all__ = [
    "Grid",
    "Noise",
    "dyadic_scale_up",
    "float_up",
    "gaussian_grid",
    "gaussian_on_grid",
    "grid_l1_sensitivity",
    "grid_l2_sensitivity",
    "laplace_grid",
    "laplace_on_grid",
]
