"""A mixture of experts kept in GGUF blocks (`kernels/native/quantized_experts.c`): each
expert's gate, up and down packed in quantized.c's panels (`quantized_weights.pack`), a
matrix's experts one after another, and the call: the int8 activations' products, the gated
activation and the weighted sum in one native call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from turnstile.kernels import cpu_native
from turnstile.kernels.expert_calls import EXPERT_FIELDS, GLUS, call_experts
from turnstile.kernels.quantized_weights import BLOCK, QuantizedWeight, pack

PROFILE_LABEL = "native::quantized_experts"
MATRICES = ("gate", "up", "down")
_PTR, _LONG = ctypes.c_void_p, ctypes.c_long


class QuantizedExpertsWeights(ctypes.Structure):
    """quantized_experts.c's `QExperts`."""

    _fields_ = [
        *((name, _PTR) for name in MATRICES),
        *((f"{name}_{field}", _LONG) for field in ("bytes", "bits") for name in MATRICES),
        *EXPERT_FIELDS,
    ]


def fits(hidden: int, inner: int) -> bool:
    """Whether experts of these sizes make whole blocks and panels."""
    return hidden % BLOCK == 0 and inner % BLOCK == 0


class PackedExperts:
    """Every expert's gate, up and down in panels, a matrix's experts one after another (the
    experts of one GGUF tensor share its format), their biases in float32, and the kernel's
    view of them."""

    __slots__ = ("_tensors", "native")

    def __init__(
        self, matrices: tuple[Sequence[QuantizedWeight], ...], biases: tuple[Tensor | None, ...],
        glu: str, alpha: float = 0.0, limit: float = 0.0,
    ) -> None:  # fmt: skip
        """`matrices`: gate [inner, hidden], up and down [hidden, inner] of each expert;
        `biases`: gate's and up's [experts, 2 * inner], down's [experts, hidden], or None."""
        packed = [_packed(part) for part in matrices]
        floats = [None if bias is None else bias.float().contiguous() for bias in biases]
        self._tensors = (packed, floats)  # what `native` points at
        inner, hidden = matrices[0][0].shape
        self.native = QuantizedExpertsWeights(
            *(panels.data_ptr() for panels, _ in packed),
            *(panels[0].numel() for panels, _ in packed),
            *(bits for _, bits in packed),
            *(None if bias is None else bias.data_ptr() for bias in floats),
            len(matrices[0]), hidden, inner, GLUS.index(glu), alpha, limit,
        )  # fmt: skip

    def __call__(self, x: Tensor, chosen: Tensor, routed: Tensor, isa: str | None = None) -> Tensor:
        """Each row of `x` [tokens, hidden] through its `chosen` experts [tokens, top_k],
        weighted by `routed` [tokens, top_k], summed: float32 [tokens, hidden]; on `isa`
        (default the best)."""
        lib = cpu_native.library()
        assert lib is not None
        isa_index = cpu_native.ISAS.index(isa or cpu_native.best_isa())
        return call_experts(lib.quantized_experts, self.native, x, chosen, routed, PROFILE_LABEL,
                            isa_index)  # fmt: skip


def _packed(matrices: Sequence[QuantizedWeight]) -> tuple[Tensor, int]:
    if len({matrix.bits for matrix in matrices}) != 1:
        raise ValueError("a matrix's experts must share one block format")
    return torch.stack([pack(matrix).panels for matrix in matrices]), matrices[0].bits
