"""MLM masking as a pure function of (seed, step, row, position): resuming or changing the number of
ranks never changes which tokens a given global batch row masks.

Each maskable token is chosen independently with probability ``rate`` (as Hugging Face's
DataCollatorForLanguageModeling does); a chosen token becomes [MASK] with probability ``mask_prob``, a
random non-special token with ``random_prob``, and stays itself otherwise. Special tokens and padding
are never chosen. Labels hold the original id at chosen positions and -100 elsewhere.
"""
from __future__ import annotations

import numpy as np

from poslab.data.config import MaskingStyle
from poslab.data.rng import hash_keys, uniform


def mask_tokens(input_ids: np.ndarray, maskable: np.ndarray, style: MaskingStyle, mask_id: int,
                random_ids: np.ndarray, keys: tuple[int | np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """input_ids, maskable (b, n); ``keys`` broadcast to (b, 1) (e.g. (seed, step, rows[:, None])).

    Returns (masked input_ids (b, n), labels (b, n)); the inputs are not modified.
    """
    position = np.arange(input_ids.shape[1])[None, :]
    chosen = maskable & (uniform(*keys, position, 0) < style.rate)
    action = uniform(*keys, position, 1)
    to_mask = chosen & (action < style.mask_prob)
    to_random = chosen & ~to_mask & (action < style.mask_prob + style.random_prob)
    masked = input_ids.copy()
    masked[to_mask] = mask_id
    if to_random.any():
        pick = hash_keys(*keys, position, 2) % np.uint64(len(random_ids))
        masked[to_random] = random_ids[pick.astype(np.int64)][to_random]
    labels = np.where(chosen, input_ids, -100)
    return masked, labels
