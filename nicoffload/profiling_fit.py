"""The fits of `nicoffload profile`: a + b * work, a + b * work + c * encoded bytes (both
nonnegative least squares), and a decoder's progressive-over-baseline ratio."""

from __future__ import annotations

import numpy as np


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a + b * work with a, b >= 0."""
    w, t = np.array(points).T
    if len(points) > 1 and np.ptp(w) > 0:
        b, a = np.polyfit(w, t, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
        if b >= 0:
            return 0.0, float((w @ t) / (w @ w))
    return float(t.mean()), 0.0


def fit_encoded(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares a + b * work + c * encoded bytes with a, b, c >= 0, from (work, ms,
    encoded) points; (a, b, 0) from `fit` when the points cannot tell the two features apart."""
    from scipy.optimize import nnls

    w, t, e = np.array(points, dtype=float).T
    A = np.c_[np.ones_like(w), w, e]
    if len(points) < 3 or np.linalg.matrix_rank(A) < 3:
        return (*fit([(x, y) for x, y, _ in points]), 0.0)
    scale = np.maximum(A.max(axis=0), 1e-12)  # columns of like size: nnls is better conditioned
    coef, _ = nnls(A / scale, t)
    a, b, c = coef / scale
    return float(a), float(b), float(c)


def ratio(num: dict[str, dict], den: dict[str, dict], key: str) -> float | None:
    """The median over sizes of num's ms over den's (a decoder's progressive_x); None when
    no size has both."""
    pairs = [(num[key][w], den[key][w]) for w in num.get(key, {}) if w in den.get(key, {})]
    if not pairs:
        return None
    ratios = [n / d for n, d in pairs if d > 0]
    return float(np.median(ratios)) if ratios else None
