"""How a step's token budget is split between the running rows."""

from __future__ import annotations

import numpy as np


def split_budget(want: np.ndarray, budget: int, whole: bool = False) -> np.ndarray:
    """Tokens each running row computes: every decode first, then prefill chunks in row order,
    so a long prompt can never starve the decodes (drafts take what is left: `Drafts.fit`);
    with `whole` (an encoder's), a prompt that does not fit the step waits for the next."""
    scheduled = np.zeros_like(want)
    decodes = np.flatnonzero(want == 1)[:budget]
    scheduled[decodes] = 1
    room = budget - len(decodes)
    prefills = np.flatnonzero(want > 1)
    if room > 0 and len(prefills):
        wanted = want[prefills]
        chunks = np.clip(room - (np.cumsum(wanted) - wanted), 0, wanted)
        scheduled[prefills] = np.where(chunks < wanted, 0, chunks) if whole else chunks
    return scheduled
