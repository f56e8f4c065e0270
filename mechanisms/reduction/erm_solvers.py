"""Accuracy-first ERM, the data side: the ridge and logistic objectives, their certified minimiser θ* and
the models θ^t of the released noisy statistics (``mechanisms.reduction.accuracy_first_erm``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mechanisms.reduction.erm_calibration import ROW_BLOCK, Task, gradient_tolerance, radius


# ----- losses and solvers ----------------------------------------------------------------------------------
def project(thetas: np.ndarray, m: float) -> np.ndarray:
    """Rows θ with ‖θ‖₂ > M scaled onto the sphere (the corrected Alg. 5 step), a hair inside for rounding."""
    norms = np.linalg.norm(thetas, axis=-1, keepdims=True)
    target = m * (1.0 - 1e-12)
    scale = np.where(norms > target, target / np.maximum(norms, np.finfo(float).tiny), 1.0)
    result: np.ndarray = thetas * scale
    return result


@dataclass(frozen=True)
class RidgeData:
    """Sufficient statistics of ridge (secret): XᵀX, Xᵀy, yᵀy, n."""

    xtx: np.ndarray
    xty: np.ndarray
    yty: float
    n: int

    @classmethod
    def from_arrays(cls, x: np.ndarray, y: np.ndarray) -> RidgeData:
        """Blocked sums: the rounding error of XᵀX is ≤ (B + n/B)·u·Σ‖x_i‖₁² (B = ROW_BLOCK, u = 2⁻⁵³),
        i.e. ≤ 1e−6 relative to the sensitivity 4 for n ≤ 2·10⁶ even in the worst-case model."""
        n, p = x.shape
        xtx, xty = np.zeros((p, p)), np.zeros(p)
        for start in range(0, n, ROW_BLOCK):
            block, labels = x[start : start + ROW_BLOCK], y[start : start + ROW_BLOCK]
            xtx += block.T @ block
            xty += block.T @ labels
        return cls(xtx, xty, float(y @ y), int(n))

    def statistic(self) -> np.ndarray:
        """S(D) = (XᵀX row-major, Xᵀy), the vector noise reduction runs on."""
        return np.concatenate([self.xtx.ravel(), self.xty])

    def losses(self, thetas: np.ndarray, lam: float) -> np.ndarray:
        """L(θ) = (yᵀy − 2θᵀXᵀy + θᵀXᵀXθ)/(2n) + (λ/2)‖θ‖² for each row θ."""
        quad = np.einsum("ij,jk,ik->i", thetas, self.xtx, thetas)
        data_term = (self.yty - 2.0 * thetas @ self.xty + quad) / (2.0 * self.n)
        result: np.ndarray = data_term + 0.5 * lam * np.sum(thetas * thetas, axis=1)
        return result

    def minimizer(self, lam: float) -> np.ndarray:
        """θ* = (XᵀX + nλI)⁻¹Xᵀy (closed form, Cholesky), checked by the gradient certificate."""
        p = self.xty.shape[0]
        hessian = self.xtx / self.n + lam * np.eye(p)
        factor = np.linalg.cholesky(hessian)
        theta = np.linalg.solve(factor.T, np.linalg.solve(factor, self.xty / self.n))
        for _ in range(3):  # iterative refinement
            grad = hessian @ theta - self.xty / self.n
            if np.linalg.norm(grad) <= gradient_tolerance(self.n, lam):
                return np.asarray(theta)
            theta = theta - np.linalg.solve(factor.T, np.linalg.solve(factor, grad))
        raise RuntimeError("the ridge solver could not certify its minimiser")


@dataclass(frozen=True)
class LogisticData:
    """Design matrix and ±1 labels (secret)."""

    x: np.ndarray
    y: np.ndarray

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def losses(self, thetas: np.ndarray, lam: float) -> np.ndarray:
        """L(θ) = mean log(1 + e^{−y θᵀx}) + (λ/2)‖θ‖² for each row θ (logaddexp: no overflow)."""
        # (k, n): the mean runs along the contiguous axis, where numpy sums pairwise (error O(log n · u)).
        margins = (thetas @ self.x.T) * self.y[None, :]
        result: np.ndarray = np.logaddexp(0.0, -margins).mean(axis=1) + 0.5 * lam * np.sum(thetas * thetas, 1)
        return result

    def minimizer(self, lam: float) -> np.ndarray:
        """θ* by damped Newton; returns only once ‖∇L‖ ≤ g_tol (certificate,
        docs/privacy/accuracy_first_erm.md#accuracy-first-erm-exactness)."""
        n, p = self.x.shape
        theta = np.zeros(p)
        tol = gradient_tolerance(n, lam)
        for _ in range(100):
            margins = self.y * (self.x @ theta)
            sig = 0.5 * (1.0 - np.tanh(0.5 * margins))  # σ(−m), stable
            grad = -(self.x.T @ (sig * self.y)) / n + lam * theta
            if np.linalg.norm(grad) <= tol:
                return theta
            weights = sig * (1.0 - sig)
            hessian = (self.x.T * weights) @ self.x / n + lam * np.eye(p)
            step = np.linalg.solve(hessian, grad)
            current = float(self.losses(theta[None, :], lam)[0])
            # Armijo backtracking; decreases below float resolution count as sufficient (the result is
            # certified by the gradient alone, so the line search cannot affect soundness).
            size, slope = 1.0, float(grad @ step)
            resolution = 8.0 * np.finfo(float).eps * abs(current)
            while size > 1e-10:
                candidate = theta - size * step
                loss = float(self.losses(candidate[None, :], lam)[0])
                if loss <= current - 1e-4 * size * slope + resolution:
                    break
                size /= 2.0
            theta = theta - size * step
        raise RuntimeError("the logistic solver could not certify its minimiser")


ErmData = RidgeData | LogisticData


def trust_region_minimizer(a: np.ndarray, z: np.ndarray, m: float) -> np.ndarray:
    """argmin_{‖θ‖₂ ≤ M} ½θᵀAθ − zᵀθ for symmetric A (Moré & Sorensen 1983).

    With A = QΛQᵀ and z̃ = Qᵀz: the unconstrained solution if A ≻ 0 and ‖A⁻¹z‖ ≤ M; otherwise
    θ(μ) = Q(Λ + μI)⁻¹z̃ with μ > max(0, −λ_min) solving ‖θ(μ)‖ = M (bisection on a monotone function), and
    the hard case (z̃ ⊥ the bottom eigenspace) completes with a bottom eigenvector. Always returns ‖θ‖ ≤ M.
    """
    w, q = np.linalg.eigh(a)
    zt = q.T @ z
    if w[0] > 0:
        theta0 = zt / w
        if np.linalg.norm(theta0) <= m:
            return np.asarray(q @ theta0)
    low = max(0.0, -float(w[0]))
    spread = float(np.max(np.abs(w))) + 1.0
    bottom = w <= w[0] + 1e-12 * spread

    def norm(mu: float) -> float:
        with np.errstate(divide="ignore"):
            return float(np.linalg.norm(zt / (w + mu)))

    eps_mu = 1e-13 * spread
    if norm(low + eps_mu) <= m:  # hard case: the secular equation has no root right of −λ_min
        coeffs = np.where(bottom, 0.0, zt / np.where(bottom, 1.0, w + low))
        tail = math.sqrt(max(m * m - float(coeffs @ coeffs), 0.0))
        coeffs = coeffs + tail * bottom / math.sqrt(float(np.sum(bottom)))
        return np.asarray(project((q @ coeffs)[None, :], m)[0])
    lo, hi = low + eps_mu, low + float(np.linalg.norm(z)) / m + spread
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if norm(mid) > m:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return np.asarray(project((q @ (zt / (w + hi)))[None, :], m)[0])


def ridge_hypothesis(noisy: np.ndarray, p: int, n: int, lam: float) -> np.ndarray:
    """θ^t = argmin_{‖θ‖ ≤ 1/√λ} (1/2n)(θᵀZθ − 2zᵀθ) + (λ/2)‖θ‖² for the noisy (Z, z) (equation 3.1)."""
    z_mat = noisy[: p * p].reshape(p, p)
    a = 0.5 * (z_mat + z_mat.T) + n * lam * np.eye(p)
    return trust_region_minimizer(a, noisy[p * p :], radius("ridge", lam))


def hypotheses(task: Task, noisy: np.ndarray, p: int, n: int, lam: float) -> np.ndarray:
    """The models θ^t ∈ C of a batch of noisy statistics (rows): post-processing of the released levels."""
    if task == "ridge":
        return np.stack([ridge_hypothesis(row, p, n, lam) for row in noisy])
    return project(noisy, radius(task, lam))
