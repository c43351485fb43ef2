"""HOST: where a new episode's prompt can copy its leading tokens from instead of prefilling them.

    SamplingEngine.start_episode(row, prompt)
      --prefix_sources(prompt, row, the engine's host mirror)--> (src, n) a row whose cache holds
                                                                 n leading tokens of the prompt,
                                                                 (lead, m) a row whose staged
                                                                 prompt holds m of them
      --SamplingEngine.flush--> copies those slots (`decode.copy_rows`), prefills the rest

A leaf: it reads the engine's mirror of its rows (lists and NumPy arrays), nothing on device.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def prefix_sources(prompt: list[int], row: int, tokens: Sequence[list[int]], cached: np.ndarray,
                   live: np.ndarray, staged: Sequence[list[int]], share_min: int
                   ) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where `row`'s new prompt can copy its longest prefix from, as two (row, n) pairs:

    - a row whose cache holds n leading tokens of it now (any row, freed ones and `row`
      itself included: a freed row's cache stays as it was);
    - a live row other than `row` whose own prompt is staged for the next flush and holds
      n leading tokens of it (episodes of a group starting together), even one that itself
      follows another staged prompt (the next group's first row shares only the system
      prompt with this group's: its group then copies from it, not the shorter prefix;
      `SamplingEngine.flush` serves followers in rounds).

    n is at most all but the prompt's last token (prefilled for the next-token logits),
    except from a staged row whose whole prompt is this one (a GRPO group's other rows):
    then n is the whole prompt, and the flush copies that row's next-token logits with it,
    so the row prefills nothing. A pair is (-1, 0) when it offers fewer than `share_min`
    tokens (`SamplingConfig.share_prefix_min`; 0 turns sharing off).

    Args (the engine's host mirror, per row r of B): tokens[r] the ids the row holds (cached
      and staged); cached `[B]` how many of them are in the device cache; live `[B]` bool, the
      row holds an episode; staged[r] the ids waiting for the next flush.
    """
    out = [(-1, 0), (-1, 0)]
    if share_min <= 0 or len(prompt) <= share_min:
        return out[0], out[1]
    want = np.asarray(prompt)
    for r in range(len(tokens)):
        is_staged = live[r] and r != row and bool(staged[r])
        for which, m in ((0, int(cached[r])), (1, len(tokens[r]) if is_staged else 0)):
            whole = which == 1 and is_staged and tokens[r] == prompt  # its logits after the flush are this row's
            m = len(prompt) if whole else min(m, len(prompt) - 1)
            if m < share_min or m <= out[which][1]:
                continue
            diff = np.flatnonzero(np.asarray(tokens[r][:m]) != want[:m])
            n = int(diff[0]) if diff.size else m
            if n >= share_min and n > out[which][1]:
                out[which] = (r, n)
    return out[0], out[1]
