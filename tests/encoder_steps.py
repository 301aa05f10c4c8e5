"""One step of an encoder's whole sequences, random tokens of the tiny encoders' vocabulary, as
`EncoderModel.forward` takes it (`test_encoder_support.py`, `test_modernbert.py`)."""

from __future__ import annotations

import numpy as np
import torch

from turnstile.executor_svc.model.encoder import EncoderBatch


def step(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, EncoderBatch]:
    """The token ids, positions and batch of sequences of `lengths` tokens."""
    torch.manual_seed(1)
    ids = torch.randint(3, 512, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *np.cumsum(lengths)])
    return ids, positions, EncoderBatch(rows, starts, tuple(starts.tolist()), None)
