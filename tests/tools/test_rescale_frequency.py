"""tools/rescale_frequency.py's replay of the forward's rescale vote, on scores built to move
the max where the test says (the model capture needs a package with weights: not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import rescale_frequency as rf  # noqa: E402


def _counts(q, k, block_n):
    c = dict(by_block={}, slots=np.zeros(5, np.int64))
    rf.replay(q.astype(np.float32), k.astype(np.float32), block_n, c)
    return c


def _qk(n, d, rising_rows, jump_key, jump):
    """q, k with every score 0 except on rising_rows, whose scores (log2 units) jump by
    `jump` at key jump_key."""
    q = np.zeros((1, n, d))
    k = np.zeros((1, n, d))
    q[0, rising_rows, 0] = 1.0
    k[0, jump_key:, 0] = jump / (np.log2(np.e) / np.sqrt(d))
    return q, k


def test_flat_scores_never_fire_after_the_first_block():
    q, k = _qk(128, 16, [], 0, 0.0)
    c = _counts(q, k, 32)
    assert c["slots"][0] == c["slots"].sum() == 3 * 4  # blocks 1-3 x 4 warps
    assert sorted(c["by_block"]) == [1, 2, 3]


def test_a_jump_past_the_threshold_fires_in_its_block_and_slot():
    # rows 8-15 (warp 0, slot 1) jump by 9 > kLazyRescale at key 70 (block 2 of 32 keys)
    q, k = _qk(128, 16, list(range(8, 16)), 70, 9.0)
    c = _counts(q, k, 32)
    assert c["by_block"][2] == [4, 1] and c["by_block"][1] == [4, 0] and c["by_block"][3] == [4, 0]
    assert c["slots"][1] == 1 and c["slots"][2:].sum() == 0


def test_a_jump_within_the_threshold_does_not_fire():
    q, k = _qk(128, 16, list(range(0, 32)), 70, 7.5)
    assert _counts(q, k, 32)["slots"][0] == 3 * 4
