"""Rényi-DP accounting: order grid, curves, exact fixed-point units, conversions, filter capacity."""

from mechanisms.accounting.conversion import (
    capacity_units,
    epsilon_at_delta,
    epsilon_at_delta_tight,
    filter_epsilon,
    union_bound_term,
)
from mechanisms.accounting.curve import JsonLoss, RdpCurve, json_loss, laplace_scale, pad_up, sum_up
from mechanisms.accounting.fixed_point import (
    UNITS_PER_EPSILON,
    UnitsVector,
    units_down,
    units_to_epsilon,
    units_up,
)
from mechanisms.accounting.orders import DEFAULT_ORDERS, validate_orders

__all__ = [
    "DEFAULT_ORDERS",
    "UNITS_PER_EPSILON",
    "JsonLoss",
    "RdpCurve",
    "UnitsVector",
    "capacity_units",
    "epsilon_at_delta",
    "epsilon_at_delta_tight",
    "filter_epsilon",
    "json_loss",
    "laplace_scale",
    "pad_up",
    "sum_up",
    "union_bound_term",
    "units_down",
    "units_to_epsilon",
    "units_up",
    "validate_orders",
]
