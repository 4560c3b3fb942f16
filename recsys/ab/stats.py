"""The statistics of an online A/B test, vectorised over any leading axes (days, simulations).

Everything starts from per-user moments of one arm (count, means, covariance matrix of the
columns a metric uses), so the analysis of one experiment and the simulation of thousands run
the same code. Notation: control c, treatment t, n users per arm.

- Mean metric Y: value = mean(Y), var of the mean = s2_Y / n (Welch, normal approximation).
- Ratio metric Y/X (e.g. ctr = clicks / impressions, users are the unit): value =
  mean(Y) / mean(X); delta method, var of the value = g' S g / n with the gradient
  g = (1/mean(X), -mean(Y)/mean(X)^2) and S the 2x2 per-user covariance (Deng et al. 2018).
- CUPED (Deng et al. 2013) with a pre-period covariate Z of the same form (Y_pre or
  Y_pre/X_pre): theta = cov(M, Z) / var(Z) on both arms pooled (M, Z the delta-method
  linearisations); value_adj = value - theta (Z_arm - Z_pooled); per-user variance
  var(M) + theta^2 var(Z) - 2 theta cov(M, Z). Same estimator as tea-tasting's RatioOfMeans.
- Difference d = value_t - value_c, V = var_t/n_t + var_c/n_c; fixed-horizon interval
  d +- z_{1-alpha/2} sqrt(V), two-sided p = 2 (1 - Phi(|d| / sqrt(V))). Relative lift
  value_t/value_c - 1 with the interval of its logarithm (delta method), as tea-tasting does.
- Always-valid test (mixture SPRT, Johari et al. 2017; normal mixture confidence sequence,
  Howard et al. 2021): with a N(0, tau^2) mixture over the effect,
  Lambda = sqrt(V / (V + tau^2)) exp(tau^2 d^2 / (2 V (V + tau^2))); reject H0 when
  Lambda >= 1/alpha; the interval
  d +- sqrt(V (V + tau^2) / tau^2 (log((V + tau^2)/V) - 2 log alpha))
  holds simultaneously over every look with probability >= 1 - alpha, so the nightly can look
  every day. tau = `tau_sd` per-user standard deviations (the standardised effect the test is
  tuned for).
- Sample-ratio mismatch: Pearson chi-square of users per variant against the split
  (scipy.stats.chisquare); p < 0.001 blocks a decision.
- Power: minimum detectable effect (z_{1-alpha/2} + z_power) sqrt(s2 (1/n_c + 1/n_t)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

SRM_ALPHA = 0.001


@dataclass(frozen=True)
class Moments:
    """Per-user moments of one arm: count (...), means (..., k), covariance (..., k, k), ddof 1."""

    n: np.ndarray
    mean: np.ndarray
    cov: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray, mask: np.ndarray | None = None) -> Moments:
        """Moments of per-user values shaped (..., users, k); `mask` (..., users) keeps users."""
        values = np.asarray(values, dtype=np.float64)
        if mask is None:
            mask = np.ones(values.shape[:-1], dtype=bool)
        w = np.asarray(mask, dtype=np.float64)[..., None]
        n = w.sum(axis=-2)[..., 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = (w * values).sum(axis=-2) / n[..., None]
            centred = (values - mean[..., None, :]) * w
            cov = np.einsum("...ui,...uj->...ij", centred, centred) / (n - 1)[..., None, None]
        return cls(n, mean, cov)

    def __add__(self, other: Moments) -> Moments:
        """Moments of the two samples concatenated (pooled arms)."""
        n = self.n + other.n
        mean = (self.n[..., None] * self.mean + other.n[..., None] * other.mean) / n[..., None]
        diff = self.mean - other.mean
        between = _scale(self.n * other.n / n, np.einsum("...i,...j->...ij", diff, diff))
        scatter = _scale(self.n - 1, self.cov) + _scale(other.n - 1, other.cov)
        return Moments(n, mean, (scatter + between) / (n - 1)[..., None, None])


def _scale(factor: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    return factor[..., None, None] * matrix


@dataclass(frozen=True)
class MetricColumns:
    """Which moment columns a metric uses: numerator, optional denominator, same for pre-period."""

    num: int
    den: int | None = None
    pre_num: int | None = None
    pre_den: int | None = None

    @property
    def has_covariate(self) -> bool:
        """Whether CUPED applies (a pre-period column is given)."""
        return self.pre_num is not None


def _ratio(m: Moments, num: int, den: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Value mean(num)/mean(den) and its delta-method gradient over the k columns."""
    k = m.mean.shape[-1]
    grad = np.zeros((*m.mean.shape[:-1], k))
    mean_num = m.mean[..., num]
    if den is None:
        grad[..., num] = 1.0
        return mean_num, grad
    mean_den = m.mean[..., den]
    grad[..., num] = 1.0 / mean_den
    grad[..., den] = -mean_num / mean_den**2
    return mean_num / mean_den, grad


def value_and_variance(m: Moments, num: int, den: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A metric's value and per-user variance (delta method for a ratio) in one sample."""
    value, grad = _ratio(m, num, den)
    return value, _quad(m, grad, grad)


def _quad(m: Moments, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("...i,...ij,...j->...", a, m.cov, b)


@dataclass(frozen=True)
class Arms:
    """Each arm's metric value (CUPED-adjusted when a covariate is given), per-user var, count."""

    control: np.ndarray
    treatment: np.ndarray
    var_c: np.ndarray
    var_t: np.ndarray
    n_c: np.ndarray
    n_t: np.ndarray

    @property
    def diff(self) -> np.ndarray:
        """Absolute effect: treatment - control."""
        return self.treatment - self.control

    @property
    def variance(self) -> np.ndarray:
        """Variance of the difference's estimate."""
        return self.var_c / self.n_c + self.var_t / self.n_t


def arms(control: Moments, treatment: Moments, cols: MetricColumns) -> Arms:
    """Both arms' values and variances for one metric (delta method, CUPED if a covariate).

    A zero denominator (no impressions in an arm) gives NaN, which the decision refuses.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        return _arms(control, treatment, cols)


def _arms(control: Moments, treatment: Moments, cols: MetricColumns) -> Arms:
    theta: np.ndarray | float = 0.0
    pooled_pre: np.ndarray | float = 0.0
    if cols.has_covariate:
        pooled = control + treatment
        _, g_y = _ratio(pooled, cols.num, cols.den)
        pooled_pre, g_z = _ratio(pooled, cols.pre_num, cols.pre_den)  # type: ignore[arg-type]
        var_z = _quad(pooled, g_z, g_z)
        theta = np.where(var_z > 0, _quad(pooled, g_y, g_z) / np.where(var_z > 0, var_z, 1), 0.0)
    out = []
    for m in (control, treatment):
        value, g_y = _ratio(m, cols.num, cols.den)
        var = _quad(m, g_y, g_y)
        if cols.has_covariate:
            pre, g_z = _ratio(m, cols.pre_num, cols.pre_den)  # type: ignore[arg-type]
            value = value - theta * (pre - pooled_pre)
            var = var + theta**2 * _quad(m, g_z, g_z) - 2 * theta * _quad(m, g_y, g_z)
        out.append((value, var))
    (vc, sc), (vt, st) = out
    return Arms(vc, vt, sc, st, control.n, treatment.n)


@dataclass(frozen=True)
class Effect:
    """Effect of treatment vs control with fixed-horizon and always-valid intervals."""

    control: np.ndarray
    treatment: np.ndarray
    diff: np.ndarray
    se: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    p_value: np.ndarray
    rel: np.ndarray
    rel_low: np.ndarray
    rel_high: np.ndarray
    seq_low: np.ndarray
    seq_high: np.ndarray
    seq_p_value: np.ndarray


def effect(a: Arms, *, alpha: float = 0.05, tau_sd: float = 0.1) -> Effect:
    """Fixed-horizon z interval and p-value, relative lift, and the mSPRT confidence sequence."""
    with np.errstate(divide="ignore", invalid="ignore"):
        se = np.sqrt(a.variance)
        z = sps.norm.ppf(1 - alpha / 2)
        p = 2 * sps.norm.sf(np.abs(a.diff) / se)
        rel_se = np.sqrt(a.var_c / a.n_c / a.control**2 + a.var_t / a.n_t / a.treatment**2)
        ratio = a.treatment / a.control
        seq_half, seq_p = sequential(a.diff, a.variance, _tau2(a, tau_sd), alpha)
    return Effect(
        a.control, a.treatment, a.diff, se, a.diff - z * se, a.diff + z * se, p,
        ratio - 1, ratio * np.exp(-z * rel_se) - 1, ratio * np.exp(z * rel_se) - 1,
        a.diff - seq_half, a.diff + seq_half, seq_p,
    )  # fmt: skip


def _tau2(a: Arms, tau_sd: float) -> np.ndarray:
    """Mixture variance: (tau_sd x the per-user standard deviation, both arms pooled)^2."""
    pooled_var = (a.var_c * a.n_c + a.var_t * a.n_t) / (a.n_c + a.n_t)
    return tau_sd**2 * pooled_var


def sequential(
    diff: np.ndarray, variance: np.ndarray, tau2: np.ndarray, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """Half-width of the normal-mixture confidence sequence and the mSPRT p-value 1/Lambda.

    Always valid: the p-value of a series of looks is the running minimum of these values
    (`always_valid_p`); the interval of a series, the running intersection.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = (variance + tau2) / variance
        half = np.sqrt(variance * (variance + tau2) / tau2 * (np.log(ratio) - 2 * np.log(alpha)))
        log_lambda = -0.5 * np.log(ratio) + tau2 * diff**2 / (2 * variance * (variance + tau2))
        p = np.minimum(1.0, np.exp(-log_lambda))
    return half, p


def always_valid_p(p_by_look: np.ndarray, axis: int = -1) -> np.ndarray:
    """Running minimum of the mSPRT p-values over looks (the always-valid p-value)."""
    return np.minimum.accumulate(p_by_look, axis=axis)


def srm_p_value(counts: np.ndarray, weights: np.ndarray) -> float:
    """Pearson chi-square p-value of users per variant against the expected split."""
    counts = np.asarray(counts, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if counts.sum() == 0 or len(counts) < 2:
        return 1.0
    expected = counts.sum() * weights / weights.sum()
    return float(sps.chisquare(counts, expected).pvalue)


def mde(
    var: float | np.ndarray, n_c: float, n_t: float, *, alpha: float = 0.05, power: float = 0.8
) -> np.ndarray:
    """Smallest absolute effect a two-sided z-test detects with `power` at these sample sizes."""
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    return z * np.sqrt(np.asarray(var) * (1 / n_c + 1 / n_t))


def users_needed(
    var: float, effect_size: float, *, share_t: float = 0.5, alpha: float = 0.05,
    power: float = 0.8,
) -> int:  # fmt: skip
    """Total users (both arms) for a two-sided z-test to detect `effect_size` with `power`."""
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    per_unit = var * (1 / (1 - share_t) + 1 / share_t)
    return int(np.ceil(z**2 * per_unit / effect_size**2))
