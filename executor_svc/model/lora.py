"""LoRA adapters' weights, laid out for the model's fused projections, and a step's share of
them (`LoraBatch`): each adapter's tokens get `x @ A.T @ B.T` added to a projection's output,
one pair of small matmuls an adapter a projection.

PEFT keeps one A [rank, in] and one B [out, rank] a module. The model fuses q, k and v (and gate
and up) into one projection, so their As are stacked and their Bs set block-diagonal: one pair
gives the fused output's rows, q's and k's in the model's rotary order
(`interleave_rotary_halves`). The scaling is folded into B.

Under tensor parallelism a rank keeps its share as it keeps the base weights'
(`tensor_parallel.py`): B's rows of its heads (qkv) or intermediate dims (gate-up), A's columns
of its input (o, down), whose partial products the layer's all-reduce sums with the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load

from turnstile.executor_svc.model.rope import interleave_rotary_halves
from turnstile.executor_svc.tensor_parallel import SINGLE, TensorParallel
from turnstile.shared.lora import Adapter, module_shapes
from turnstile.shared.model_info import ModelInfo

# The model's projections, and the PEFT modules each fuses, in its rows' order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}  # fmt: skip

Pair = tuple[torch.Tensor, torch.Tensor]  # A [rank, in], B [out, rank]


class LoraWeights:
    """The loaded adapters' pairs, by layer, then projection, then the executor's own slot."""

    def __init__(
        self, info: ModelInfo, dtype: torch.dtype, device: torch.device,
        tp: TensorParallel = SINGLE,
    ) -> None:  # fmt: skip
        self.info, self.dtype, self.device, self.tp = info, dtype, device, tp
        self.version = 0  # a new one each time an adapter is added or dropped
        self.layers: list[dict[str, dict[int, Pair]]] = [
            {name: {} for name in FUSED} for _ in range(info.num_layers)
        ]

    def add(self, slot: int, adapter: Adapter, weights: bytes) -> None:
        """`adapter`'s pairs under `slot`, from its safetensors file's bytes."""
        tensors = load(weights)
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, (layer, module, side) in adapter.tensors.items():
            parts.setdefault((layer, module), {})[side] = tensors[key].float()
        for layer, projections in enumerate(self.layers):
            for name, modules in FUSED.items():
                pair = _fused(self.info, modules, [parts.get((layer, m)) for m in modules],
                              adapter.scaling)  # fmt: skip
                if pair is not None:
                    pair = self._share(name, *pair)
                    a, b = (t.to(device=self.device, dtype=self.dtype).contiguous() for t in pair)
                    projections[name][slot] = (a, b)
        self.version += 1

    def _share(self, name: str, a: torch.Tensor, b: torch.Tensor) -> Pair:
        """This rank's part of a fused projection's pair."""
        if self.tp.size == 1:
            return a, b
        info, dim = self.info, self.info.head_dim
        queries, kv = self.tp.heads(info)
        inner = self.tp.intermediate(info.intermediate_size)
        if name == "qkv":  # B's rows [q | k | v], each rank's heads of each
            q, k = info.num_heads * dim, info.num_kv_heads * dim
            rows = [torch.arange(s.start * dim, s.stop * dim) + at
                    for s, at in ((queries, 0), (kv, q), (kv, q + k))]  # fmt: skip
            return a, b[torch.cat(rows)]
        if name == "gate_up":  # B's rows [gate | up], each rank's intermediate dims of each
            size = info.intermediate_size
            return a, b[torch.cat([torch.arange(inner.start, inner.stop) + at for at in (0, size)])]
        columns = slice(queries.start * dim, queries.stop * dim) if name == "o_proj" else inner
        return a[:, columns], b

    def drop(self, slot: int) -> None:
        for projections in self.layers:
            for pairs in projections.values():
                pairs.pop(slot, None)
        self.version += 1


def _fused(
    info: ModelInfo, modules: tuple[str, ...], found: list[dict[str, torch.Tensor] | None],
    scaling: float,
) -> Pair | None:  # fmt: skip
    """One (A, B) for a fused projection's parts; None if the adapter adapts none of them."""
    if all(part is None for part in found):
        return None
    shapes = module_shapes(info)
    heads = {"q_proj": info.num_heads, "k_proj": info.num_kv_heads}
    a_rows, b_blocks = [], []
    for module, part in zip(modules, found, strict=True):
        if part is None or "A" not in part or "B" not in part:
            b_blocks.append(torch.zeros(shapes[module][1], 0))
            continue
        b = part["B"] * scaling
        if module in heads:
            b = interleave_rotary_halves(b, heads[module], info.head_dim, info.rotary_dim)  # type: ignore[assignment]
        a_rows.append(part["A"])
        b_blocks.append(b)
    return torch.cat(a_rows), torch.block_diag(*b_blocks)


@dataclass(slots=True, frozen=True)
class LoraBatch:
    """A step's tokens that run an adapter, grouped by adapter: `tokens[start:end]` run slot's
    (`executor_svc/adapters.py` gives each loaded adapter its slot)."""

    weights: LoraWeights
    tokens: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """`out` (the projection of `x`) with each adapter's share added to its tokens' rows."""
        pairs = self.weights.layers[layer][name]
        for slot, start, end in self.segments:
            pair = pairs.get(slot)
            if pair is not None:
                a, b = pair
                rows = self.tokens[start:end]
                delta = (x[rows].to(a.dtype) @ a.T) @ b.T
                out = out.index_add(0, rows, delta.to(out.dtype))
        return out
