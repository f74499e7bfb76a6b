"""Criteo-shaped synthetic click data drawn from a hidden model with real signal.

Per sparse feature f with ``n_f`` rows:

* **Popularity** follows a truncated Zipf law with exponent ``alpha``: the
  popularity rank is drawn by inverting the continuous power-law CDF, then mapped
  to an id by an affine bijection ``id = (rank * a_f + c_f) mod n_f`` so the hot ids
  are scattered over the table as in real logs (matters for caches and sharding).
* **Hidden effect** of an id: a scalar weight ``w_f(id)`` and a k-dim factor
  ``v_f(id)``, both derived from a hash of (seed, f, id), so tables of any size
  (Terabyte: 40M rows) cost no memory.

The click logit of a sample is::

    bias + sum_f s_f * mean_{id in bag f} w_f(id)            (first order)
         + 1/2 (|sum_f v_f|^2 - sum_f |v_f|^2) / sqrt(F)       (pairwise, FM-style)
         + dense_std @ u                                        (dense features)

with the signal scaled by ``signal_scale`` and ``bias`` chosen (by bisection on a
calibration sample) so the click rate is ``target_ctr`` (Criteo: ~0.25); labels
are Bernoulli(sigmoid(logit)). Dense features
are log(1 + lognormal) like preprocessed Criteo counts.

Batch ``i`` of a split is a pure function of (seed, split, i): any batch can be
regenerated, which makes runs reproducible and resumable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from recscale.data.batch import Batch
from recscale.kernels import numba as nb
from recscale.torch_threads import on_torch_threads

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_FACTOR_DIM = 4
_CACHE_MAX_ROWS = 1 << 21
_EFFECT_PIECE = 1 << 18  # ids a piece of the effects cache is hashed in
_SPLIT_KEYS = {"train": 0, "eval": 1, "calibration": 2}


def click_probability(logit: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-logit))``: a logit past -709 (a large ``data.signal_scale``)
    overflows exp to inf, which gives the probability's exact limit 0 - no warning."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-logit))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _uniform(keys: np.ndarray) -> np.ndarray:
    """Hash -> float64 uniform in (0, 1)."""
    return ((_splitmix(keys) >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 2**53)


def _normal(keys: np.ndarray) -> np.ndarray:
    """Hash -> standard normal (Box-Muller on two independent hashes)."""
    u1 = _uniform(keys)
    u2 = _uniform(keys ^ np.uint64(0x5851F42D4C957F2D))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def zipf_ranks(u: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """Map uniforms to popularity ranks in [0, n) with P(rank r) ~ (r+1)^-alpha."""
    return _zipf_ranks_by_feature(u, [n], np.array([len(u)]), alpha)


def _zipf_ranks_by_feature(
    u: np.ndarray, sizes: list[int], counts: np.ndarray, alpha: float
) -> np.ndarray:
    """:func:`zipf_ranks` for several features in one numpy pass: ``u``'s first
    ``counts[0]`` values are feature 0's (table of ``sizes[0]`` rows), then feature 1's,
    ... Each feature's constants are Python floats repeated over its values, so a rank
    does not depend on which features were drawn with it."""
    n = np.repeat(np.asarray(sizes, dtype=np.int64), counts)
    if alpha == 0.0:
        r = np.floor(u * n)
    elif abs(alpha - 1.0) < 1e-9:
        log_n1 = [math.log(size + 1) for size in sizes]
        r = np.floor(np.exp(u * np.repeat(log_n1, counts))) - 1
    else:
        e = 1.0 - alpha
        span = [((size + 1) ** e) - 1.0 for size in sizes]
        r = np.floor((np.repeat(span, counts) * u + 1.0) ** (1.0 / e)) - 1
    return np.clip(r, 0, n - 1).astype(np.int64)  # (a 1-row table: 0 by any formula)


def _coprime_multiplier(n: int, rng: np.random.Generator) -> int:
    if n <= 2:
        return 1
    while True:
        a = int(rng.integers(n // 3 + 1, n))
        if math.gcd(a, n) == 1:
            return a


@nb.njit(cache=True, nogil=True)
def _accumulate_features(
    ids,
    feat_start,
    lengths,
    scales,
    cache_start,
    cache_w,
    cache_fac,
    given_w,
    given_fac,
    multi,
    logit,
    factor_sum,
    factor_sq,
):
    """The per-feature terms of the logit, feature by feature, in the order and with the
    arithmetic of the numpy formulation it replaced (bincount, ``add.at`` / scatter,
    sums), so batches are bit for bit what they were - only ~10 numpy calls per feature
    fewer.

    ``ids`` are every feature's ids, feature f's at ``feat_start[f]:feat_start[f+1]``
    (bag-major); a feature's effects come from the cache (``cache_start[f] >= 0``: rows
    ``cache_start[f] + id`` of ``cache_w`` / ``cache_fac``, fp32) or, hashed beforehand,
    from ``given_w`` / ``given_fac`` at the ids' own positions (fp64)."""
    num_f, b = lengths.shape
    k = factor_sum.shape[1]
    w = np.zeros(b)
    v = np.zeros((b, k))
    for f in range(num_f):
        s0 = feat_start[f]
        if feat_start[f + 1] == s0:
            continue
        w[:] = 0.0
        v[:] = 0.0
        n, c = s0, cache_start[f]
        for row in range(b):
            for _ in range(lengths[f, row]):
                if c >= 0:
                    r = c + ids[n]
                    w[row] += np.float64(cache_w[r])
                    for j in range(k):
                        if multi:
                            v[row, j] += np.float64(cache_fac[r, j])
                        else:
                            v[row, j] = np.float64(cache_fac[r, j])
                else:
                    w[row] += given_w[n]
                    for j in range(k):
                        if multi:
                            v[row, j] += given_fac[n, j]
                        else:
                            v[row, j] = given_fac[n, j]
                n += 1
        for row in range(b):
            denom = max(lengths[f, row], 1)
            logit[row] += scales[f] * (w[row] / denom)
            sq = 0.0
            for j in range(k):
                if multi:
                    v[row, j] /= denom
                factor_sum[row, j] += v[row, j]
                sq += v[row, j] * v[row, j]
            factor_sq[row] += sq


# Samples drawn at once to calibrate the click rate (the generator's construction), and
# the bytes a dense value takes at a batch's drawing peak (two float64 copies: _sample)
CALIBRATION_ROWS = 16384
DENSE_DRAW_BYTES = 16


class SyntheticCriteo:
    """Deterministic, infinite Criteo-shaped batches. See the module docstring."""

    def __init__(
        self,
        table_sizes: list[int],
        num_dense: int = 13,
        seed: int = 1234,
        zipf_alpha: float = 1.1,
        min_ids: int = 1,
        max_ids: int = 1,
        signal_scale: float = 1.0,
        target_ctr: float = 0.25,
        bag_sizes: list[int] | None = None,
    ) -> None:
        self.table_sizes = list(table_sizes)
        # fixed ids per bag, one per table (MLPerf multi-hot), instead of [min, max]
        self.bag_sizes = np.array(bag_sizes, np.int64) if bag_sizes else None
        self.num_dense = num_dense
        self.seed = seed
        self.alpha = zipf_alpha
        self.min_ids, self.max_ids = min_ids, max_ids
        if self.bag_sizes is not None:
            self.max_ids = int(self.bag_sizes.max(initial=0))
        self.signal_scale = signal_scale
        rng = np.random.default_rng(seed)
        self._mult = np.array(
            [_coprime_multiplier(n, rng) for n in self.table_sizes], dtype=np.int64
        )
        self._shift = np.array([int(rng.integers(0, n)) for n in self.table_sizes], dtype=np.int64)
        self._sizes = np.array(self.table_sizes, dtype=np.int64)
        num_sparse = len(self.table_sizes)
        # Feature importances vary, as in real data (some fields barely matter).
        self._feature_scale = 0.25 + 0.5 * rng.random(num_sparse)
        self._dense_w = rng.normal(0.0, 0.35, size=num_dense)
        self._dense_mu = rng.normal(1.0, 0.5, size=num_dense)
        self._bias = 0.0
        # Hidden effects of every id of tables up to this size are materialised once
        # (a gather is ~10x cheaper than hashing); larger tables hash on the fly.
        # All cached tables share two arrays (the sampling kernel gathers from them):
        # table f's rows at _cache_start[f] (-1: not cached), _cached[f] views of them.
        self._cache_start = np.full(num_sparse, -1, dtype=np.int64)
        cached_rows = 0
        for f, n in enumerate(self.table_sizes):
            if n <= _CACHE_MAX_ROWS:
                self._cache_start[f] = cached_rows
                cached_rows += n
        self._cache_w = np.empty(cached_rows, dtype=np.float32)
        self._cache_fac = np.empty((cached_rows, _FACTOR_DIM), dtype=np.float32)
        self._cached: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        pieces = []
        for f, n in enumerate(self.table_sizes):
            if self._cache_start[f] >= 0:
                rows = slice(self._cache_start[f], self._cache_start[f] + n)
                self._cached[f] = (self._cache_w[rows], self._cache_fac[rows])
                pieces += [(f, lo, min(n, lo + _EFFECT_PIECE)) for lo in range(0, n, _EFFECT_PIECE)]
        # pieces of a table hashed on torch's threads at once, as the tables' initial rows
        # are (numpy lets go of the GIL in its loops; each piece writes its own rows):
        # config B's 26M ids took 5.4 s on one
        on_torch_threads(self._cache_piece, pieces, "recscale-synth")

        self._bias = self._calibrated_bias(target_ctr)

    def _cache_piece(self, piece: tuple[int, int, int]) -> None:
        f, lo, hi = piece
        ids = np.arange(lo, hi, dtype=np.int64)
        self._cached[f][0][lo:hi] = self.id_weight(f, ids)
        self._cached[f][1][lo:hi] = self.id_factors(f, ids)

    def _calibrated_bias(self, target_ctr: float) -> float:
        """The intercept that gives ``target_ctr`` on a calibration sample (bisection)."""
        _, raw = self._sample(0, CALIBRATION_ROWS, "calibration")
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if click_probability(mid + raw).mean() < target_ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # -- hidden model -----------------------------------------------------------
    def _keys(self, f: int, ids: np.ndarray) -> np.ndarray:
        base = np.uint64((self.seed * 1_000_003 + f * 7919) & 0xFFFFFFFFFFFF) << np.uint64(16)
        with np.errstate(over="ignore"):
            return (ids.astype(np.uint64) * np.uint64(0x100000001B3)) ^ base

    def _effects(self, f: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cached = self._cached.get(f)
        if cached is not None:
            return cached[0][ids], cached[1][ids]
        return self.id_weight(f, ids), self.id_factors(f, ids)

    def id_weight(self, f: int, ids: np.ndarray) -> np.ndarray:
        return _normal(self._keys(f, ids))

    def id_factors(self, f: int, ids: np.ndarray) -> np.ndarray:
        keys = self._keys(f, ids)
        return np.stack(
            [_normal(keys ^ np.uint64(0xA5A5A5A5 * (j + 1))) for j in range(_FACTOR_DIM)], axis=-1
        ) * (0.5 / math.sqrt(_FACTOR_DIM))

    # -- sampling ---------------------------------------------------------------
    def rank_of_id(self, feature: int) -> np.ndarray:
        """Each id's popularity rank in table ``feature`` (0 = drawn most often): the
        inverse of the bijection that scatters ranks over the table - the source's id
        profile, as a dataset's preprocessing would count it."""
        n = self.table_sizes[feature]
        if n >= 3_000_000_000:  # (id * inverse) must stay inside int64
            raise ValueError(f"table {feature} has {n:,} rows: too many to rank in int64")
        inv = pow(int(self._mult[feature]), -1, n) if n > 1 else 0
        ids = np.arange(n, dtype=np.int64)
        return ((ids - self._shift[feature]) % n) * inv % n

    def batch(self, index: int, batch_size: int, split: str = "train") -> Batch:
        """Batch ``index`` of ``split`` (a pure function of seed, split and index)."""
        (rng, dense, lengths, ids), raw = self._sample(index, batch_size, split)
        logit = self._bias + raw
        b = batch_size
        num_sparse = len(self.table_sizes)
        labels = (rng.random(b) < click_probability(logit)).astype(np.float32)
        offsets = np.zeros(num_sparse * b + 1, dtype=np.int64)
        np.cumsum(lengths.reshape(-1), out=offsets[1:])
        return Batch(
            dense=torch.from_numpy(dense.astype(np.float32)),
            values=torch.from_numpy(ids),
            offsets=torch.from_numpy(offsets),
            labels=torch.from_numpy(labels),
        )

    def _sample(self, index: int, batch_size: int, split: str):
        """Features of a batch (``ids``: every feature's, feature-major) and the signal
        part of its logits (``signal_scale`` applied)."""
        rng = np.random.default_rng([self.seed, _SPLIT_KEYS[split], index])
        b = batch_size
        num_sparse = len(self.table_sizes)
        # in place where it can be (the same values): a batch's dense block at its peak is
        # two float64 copies, not four (8,192 x 10^5 features asked for ~30 GB)
        dense = rng.lognormal(mean=self._dense_mu, sigma=1.0, size=(b, self.num_dense))
        np.log1p(dense, out=dense)
        logit = np.zeros(b)
        if self.num_dense and b > 1:
            sd = dense.std(axis=0)  # first: its own temporary copy is gone before z's
            z = dense - dense.mean(axis=0)
            z /= sd + 1e-6
            logit += z @ self._dense_w
            del z

        if self.bag_sizes is not None:
            lengths = np.repeat(self.bag_sizes[:, None], b, axis=1)
        else:
            lengths = rng.integers(self.min_ids, self.max_ids + 1, size=(num_sparse, b))
        # every feature's ids in one pass: the uniforms of feature after feature are one
        # draw, the ranks one call (each feature's as zipf_ranks gives them alone)
        counts = lengths.sum(axis=1)
        feat_start = np.zeros(num_sparse + 1, dtype=np.int64)
        np.cumsum(counts, out=feat_start[1:])
        u = rng.random(int(feat_start[-1]))
        ranks = _zipf_ranks_by_feature(u, self.table_sizes, counts, self.alpha)
        n = np.repeat(self._sizes, counts)
        ids = (ranks * np.repeat(self._mult, counts) + np.repeat(self._shift, counts)) % n
        # effects of the tables too large to cache, hashed here at their ids' positions
        given_w, given_fac = np.zeros(0), np.zeros((0, _FACTOR_DIM))
        if (self._cache_start < 0).any():
            given_w, given_fac = np.zeros(len(ids)), np.zeros((len(ids), _FACTOR_DIM))
            for f in np.flatnonzero(self._cache_start < 0):
                at = slice(feat_start[f], feat_start[f + 1])
                given_w[at], given_fac[at] = self._effects(f, ids[at])
        factor_sum = np.zeros((b, _FACTOR_DIM))
        factor_sq = np.zeros(b)
        _accumulate_features(
            ids,
            feat_start,
            np.ascontiguousarray(lengths, dtype=np.int64),
            self._feature_scale,
            self._cache_start,
            self._cache_w,
            self._cache_fac,
            given_w,
            given_fac,
            self.max_ids > 1,
            logit,
            factor_sum,
            factor_sq,
        )
        logit += 0.5 * ((factor_sum * factor_sum).sum(axis=1) - factor_sq) / math.sqrt(num_sparse)
        return (rng, dense, lengths, ids), self.signal_scale * logit

    def batches(
        self, batch_size: int, split: str = "train", start: int = 0, count: int | None = None
    ) -> Iterator[Batch]:
        i = start
        while count is None or i < start + count:
            yield self.batch(i, batch_size, split)
            i += 1
