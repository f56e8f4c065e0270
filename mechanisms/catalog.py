"""The registry of non-interactive mechanisms, by name."""

from __future__ import annotations

from mechanisms.base import Mechanism
from mechanisms.gaussian import Gaussian
from mechanisms.laplace import Laplace

MECHANISMS: dict[str, Mechanism] = {"laplace": Laplace(), "gaussian": Gaussian()}
