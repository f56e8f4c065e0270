"""Generalized propose-test-release (Redberg, Zhu & Wang 2023) through the approximate-DP path.

* ``generalized``: the Gen-PTR core (Alg 4 / Thm 3.5.3 and its released-bound form Thm 3.5.7, B.2.4),
  one-sided discrete-Laplace margins, the Liu–Talwar budget of Alg 5, and the Hölder-corrected RDP bound
  (kept as a checked helper: the filter does not admit Gen-PTR through it).
* ``classic``: Dwork & Lei's PTR (Alg 3) as a Gen-PTR special case, on a public grid; ``ptr.classic``
  releases a column's median when its distance to instability passes the test.
* ``select``: ``ptr.select``, Liu & Talwar's random-stopping selection (Alg 5) of the proposal β for it.
* ``ops_linear``: One-Posterior-Sample linear regression with Gen-PTR (Alg 14), exact noise, rows clipped.
* ``pate`` (with ``pate_analysis`` and ``pate_teachers``): ``pate.labels``, PATE's noisy arg-max labels behind
  a Gen-PTR test of the top-two-gap data-dependent loss (docs/privacy/pate.md#theorem-pate-ptr).
* ``protocol``: the ``ApproximateMechanism`` seam (an (ε, δ) charge from public parameters).

Privacy: docs/privacy/approximate.md#approximate-dp (approximate DP through the filter) and
docs/mechanisms/ptr.md.
"""
