"""`turnstile bench projections`: the embedded model's 120 layer matrices (30 layers of qkv, o,
gate-up, down) multiplied by `rows` rows of activations on each native path this CPU has: dense
bfloat16 panels (float32 arithmetic; and on AMX-BF16 tiles, the rows rounded to bf16), the GGUF
file's own Q4_1 blocks on every ISA's tiles, and (where the CPU has AMX-INT8) their values
requantized for the int8 tiles. Weights as the model holds them (random values; the time does
not depend on them)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from turnstile.bench.timing import median_ms
from turnstile.kernels import cpu_native
from turnstile.kernels.int8_tiles import Int8Tiles
from turnstile.kernels.quantized_weights import QuantizedWeight, pack
from turnstile.shared.model_info import embedded_model_path, read_model_info


def _shapes() -> list[tuple[int, int]]:
    info = read_model_info(embedded_model_path())
    qkv = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    hidden, inner = info.hidden_size, info.intermediate_size
    layer = [(qkv, hidden), (hidden, info.num_heads * info.head_dim), (2 * inner, hidden),
             (hidden, inner)]  # fmt: skip
    return layer * info.num_layers


def measure(rows: list[int], repeats: int = 7) -> dict[int, dict[str, float]]:
    """Per row count, per path: ms for all 120 products (median of `repeats`)."""
    generator, amx = torch.Generator().manual_seed(0), cpu_native.amx_int8()
    shapes = _shapes()
    dense = [cpu_native.pack_weight(torch.randn(o, i, generator=generator).bfloat16())
             for o, i in shapes]  # fmt: skip
    quantized = [
        pack(QuantizedWeight(torch.randint(0, 16, (o, i), dtype=torch.uint8, generator=generator),
                             torch.full((o, i // 32), 0.01).half(),
                             torch.full((o, i // 32), -0.08).half(), 4))
        for o, i in shapes
    ]  # fmt: skip

    tiled = [Int8Tiles.from_values(w.dequantize()) if amx else None for w in quantized]
    tiles = [t.native_weight() if t else None for t in tiled]

    def products(xs: dict[int, torch.Tensor], isa: str | None) -> Callable[[], None]:
        """All 120 products on `isa`'s quantized tiles, the int8 tiles ("tiles"), or the bf16
        panels (None, or "bf16 tiles" on AMX-BF16)."""

        def run() -> None:
            for dense_panels, weight, tile, (o, i) in zip(
                dense, quantized, tiles, shapes, strict=True
            ):
                if isa is None or isa == "bf16 tiles":
                    cpu_native.linear(xs[i], dense_panels, o, tiles=isa is not None)
                elif isa == "tiles":
                    cpu_native.linear_weight(xs[i], tile, o)
                else:
                    cpu_native.linear_quantized(xs[i], weight.panels, o, 4, isa=isa)

        return run

    report: dict[int, dict[str, float]] = {}
    for count in rows:
        xs = {i: torch.randn(count, i, generator=generator) for _, i in shapes}
        report[count] = {"bf16": median_ms(products(xs, None), repeats)}
        if cpu_native.amx_tiles():
            report[count]["bf16 tiles"] = median_ms(products(xs, "bf16 tiles"), repeats)
        for isa in cpu_native.usable_isas():
            report[count][f"q4_1 {isa}"] = median_ms(products(xs, isa), repeats)
        if amx:
            report[count]["q4_1 as int8 tiles"] = median_ms(products(xs, "tiles"), repeats)
    return report
