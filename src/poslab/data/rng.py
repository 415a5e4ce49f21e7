"""Counter-based randomness: every random number is a pure function of its coordinates.

A batch source must return the same batch for the same (seed, step) on any rank, after any resume, without
carrying generator state. Hashing the coordinates (seed, step, row, position) with the splitmix64
finaliser gives that directly and vectorises in numpy. The same hash drives a Feistel permutation so that
the training order over N sequences is a random permutation per epoch without materialising an N-long
array (N is tens of millions at paper scale).
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijection on uint64 with good avalanche. x: any shape, uint64."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_keys(*keys: int | np.ndarray) -> np.ndarray:
    """Hash integer coordinates (broadcast together) into uint64 words; order of keys matters."""
    h = np.zeros((), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in keys:
            k = np.asarray(k).astype(np.int64).astype(np.uint64)
            h = mix64(h * _GOLDEN + k + np.uint64(1))
    return h


def uniform(*keys: int | np.ndarray) -> np.ndarray:
    """Floats in [0, 1) with 53 random bits, one per broadcast coordinate."""
    return (hash_keys(*keys) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def permute(index: np.ndarray, n: int, *keys: int) -> np.ndarray:
    """Image of ``index`` (values in [0, n)) under a pseudo-random permutation of [0, n) chosen by ``keys``.

    A 4-round balanced Feistel network on the smallest even bit width >= log2(n), with cycle walking
    (re-apply until the value lands below n; < 4 rounds of walking on average since 2^bits < 4n).
    """
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return index.astype(np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    low_mask = np.uint64((1 << half) - 1)
    round_keys = [hash_keys(*keys, r) for r in range(4)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & low_mask
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk) & low_mask)
        return (left << np.uint64(half)) | right

    out = feistel(index)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
