"""The teachers of ``pate.labels``: non-private, deterministic multi-class learners, one per part.

A teacher sees only its own rows (design-matrix rows with ‖x‖ ≤ 1 and class indices; rows whose label is
outside the label set have class −1 and are ignored) and answers the T public queries. Its privacy comes
from the aggregation (docs/privacy/pate.md): what matters here is only that a teacher's votes are a
function of its own part and of public inputs. A part with no labelled row votes class 0.

* ``centroid``: nearest class mean (classes absent from the part are never predicted);
* ``ridge``: one-vs-rest ridge regression on ±1 targets, W = (XᵀX + λI)⁻¹XᵀY, arg-max of xᵀW;
* ``logistic``: multinomial logistic regression with an L2 penalty λ/2·‖W‖², by L-BFGS (deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt
from scipy.optimize import minimize
from scipy.special import logsumexp

Learner = Literal["centroid", "ridge", "logistic"]


class TeacherSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Learner = Field(default="centroid", description="the teachers' learner")
    lam: StrictFloat = Field(
        default=1.0, gt=0, le=1e6, allow_inf_nan=False, description="λ: L2 regularisation (ridge, logistic)"
    )
    max_iterations: StrictInt = Field(default=100, ge=1, le=1000, description="L-BFGS iterations (logistic)")


Fit = Callable[[TeacherSpec, np.ndarray, np.ndarray, int, np.ndarray], np.ndarray]


def centroid_predict(
    spec: TeacherSpec, x: np.ndarray, y: np.ndarray, classes: int, q: np.ndarray
) -> np.ndarray:
    present = [c for c in range(classes) if np.any(y == c)]
    means = np.stack([x[y == c].mean(axis=0) for c in present])
    distances = ((q[:, None, :] - means[None, :, :]) ** 2).sum(axis=2)
    predicted: np.ndarray = np.asarray(present)[np.argmin(distances, axis=1)]
    return predicted


def ridge_predict(spec: TeacherSpec, x: np.ndarray, y: np.ndarray, classes: int, q: np.ndarray) -> np.ndarray:
    targets = np.where(y[:, None] == np.arange(classes)[None, :], 1.0, -1.0)
    gram = x.T @ x + spec.lam * np.eye(x.shape[1])
    weights = np.linalg.solve(gram, x.T @ targets)
    predicted: np.ndarray = np.argmax(q @ weights, axis=1)
    return predicted


def logistic_predict(
    spec: TeacherSpec, x: np.ndarray, y: np.ndarray, classes: int, q: np.ndarray
) -> np.ndarray:
    d = x.shape[1]
    onehot = (y[:, None] == np.arange(classes)[None, :]).astype(np.float64)

    def objective(flat: np.ndarray) -> tuple[float, np.ndarray]:
        w = flat.reshape(d, classes)
        scores = x @ w
        log_norm = logsumexp(scores, axis=1)
        value = float(np.sum(log_norm) - np.sum(scores * onehot) + 0.5 * spec.lam * np.sum(w * w))
        probabilities = np.exp(scores - log_norm[:, None])
        gradient = x.T @ (probabilities - onehot) + spec.lam * w
        return value, gradient.ravel()

    result = minimize(
        objective,
        np.zeros(d * classes),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": spec.max_iterations},
    )
    predicted: np.ndarray = np.argmax(q @ result.x.reshape(d, classes), axis=1)
    return predicted


LEARNERS: dict[str, Fit] = {
    "centroid": centroid_predict,
    "ridge": ridge_predict,
    "logistic": logistic_predict,
}


def teacher_votes(
    spec: TeacherSpec,
    x: np.ndarray,
    classes_of_rows: np.ndarray,
    part: np.ndarray,
    teachers: int,
    queries: np.ndarray,
    classes: int,
) -> list[np.ndarray]:
    """Each teacher's predicted class index for every query (teacher t trains on rows with part == t)."""
    fit = LEARNERS[spec.model]
    labelled = classes_of_rows >= 0
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(teachers + 1))
    predictions: list[np.ndarray] = []
    for t in range(teachers):
        rows = order[bounds[t] : bounds[t + 1]]
        rows = rows[labelled[rows]]
        if rows.size == 0:
            predictions.append(np.zeros(queries.shape[0], dtype=np.int64))
        else:
            rows = rows[canonical_order(x[rows], classes_of_rows[rows])]
            predictions.append(fit(spec, x[rows], classes_of_rows[rows], classes, queries).astype(np.int64))
    return predictions


def canonical_order(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """An order of a part's rows that depends on the multiset of rows only (lexicographic by class, then
    features), so float sums inside a fit do not depend on where the rows sat in the table."""
    order: np.ndarray = np.lexsort((*x.T[::-1], y))
    return order
