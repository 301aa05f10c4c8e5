"""A GGUF file's weights under the names the model reads (gguf's own table of what each
architecture's tensors were converted from), each read from the mapped file when the model
takes it and not kept here: a load holds one tensor's transients at a time beside what the
model keeps (read whole first, a 1B Q4_K file's load peaked at 3.5x the file: docs/
benchmarks.md, session 52). With `quantized`, the block types of
`quantized_weights.BITS` stay in their blocks (`kernels/gguf_blocks.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from turnstile.executor_svc.model.checkpoint_names import split_fused
from turnstile.executor_svc.model.gguf_tensors import Tensor, gguf_tensors
from turnstile.executor_svc.model.load_progress import LoadProgress
from turnstile.kernels.gguf_blocks import EXACT, Unkept, dequantized, from_gguf
from turnstile.kernels.quantized_weights import BITS, QuantizedWeight
from turnstile.shared.model_info import ModelInfo
from turnstile.shared.model_support import PERMUTED_ARCHITECTURES

log = logging.getLogger(__name__)

# The names the model reads, in the order a GGUF name is claimed: Llama's `ffn_norm` is its
# post-attention norm, Gemma's (whose post-attention norm has a name of its own) the MLP's input.
_LAYER_NAMES = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
    *(f"self_attn.{p}_proj" for p in "qkvo"), "self_attn.qkv_proj", "self_attn.sinks",
    *(f"mlp.{p}_proj" for p in ("gate", "up", "down")), "mlp.gate",
    *(f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")),
)  # fmt: skip
_GLOBAL_NAMES = ("model.embed_tokens", "model.norm", "lm_head")
_STACKED_EXPERTS = ".mlp.experts."  # GGUF stacks every expert's matrix in one tensor
# RoPE factors, read with the model's shape (`gguf_info.py`), not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
Loader = Callable[[], "torch.Tensor | QuantizedWeight"]


class GGUFWeights(Mapping[str, Any]):
    """Names to weights, each read from the file whenever it is looked up."""

    def __init__(self, loaders: dict[str, Loader]) -> None:
        self._loaders = loaders

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedWeight:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


class _Reads:
    """Progress lines by the file's tensors, as the model first takes each."""

    def __init__(self, what: str, total: int) -> None:
        self.progress, self.total, self.done = LoadProgress(what, total, "tensors"), total, set()

    def __call__(self, index: int) -> None:
        if index not in self.done:
            self.progress.advance(len(self.done))
            self.done.add(index)
            if len(self.done) == self.total:
                self.progress.advance(self.total)


def read_gguf(path: Path, info: ModelInfo, quantized: bool = False) -> GGUFWeights:
    arch, tensors = gguf_tensors(path)
    names = _hf_names(arch, info.num_layers)
    weights = [(index, t) for index, t in enumerate(tensors) if t.name not in _ROPE_TENSORS]
    reads = _Reads(path.name, len(weights))
    loaders: dict[str, Any] = {}
    for index, tensor in weights:
        if tensor.name not in names:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        name = names[tensor.name]
        if _STACKED_EXPERTS in name:  # each expert's matrix apart
            for expert in range(tensor.data.shape[0]):
                each = name.replace(_STACKED_EXPERTS, f"{_STACKED_EXPERTS}{expert}.")
                loaders[each] = partial(_read, tensor, quantized, reads, index, expert)
            continue
        loaders[name] = partial(_read, tensor, quantized, reads, index, None)
        heads = {"q_proj": info.num_heads, "k_proj": info.num_kv_heads}.get(name.split(".")[-2])
        if arch in PERMUTED_ARCHITECTURES and heads:
            loaders[name] = partial(_rows_in_rope_order, loaders[name], heads)
    return GGUFWeights(split_fused(loaders, info, _lazy_rows))


def _read(
    tensor: Tensor, quantized: bool, reads: _Reads, index: int, expert: int | None
) -> torch.Tensor | QuantizedWeight:
    """A tensor's value (a stacked one's expert's): its blocks where they are kept, else
    float32."""
    reads(index)
    data = tensor.data if expert is None else tensor.data[expert]
    if quantized and tensor.tensor_type in BITS:
        try:
            return from_gguf(data, tensor.tensor_type)
        except Unkept as why:
            log.warning("%s dequantized: %s", tensor.name, why)
    if tensor.tensor_type in EXACT:
        return dequantized(data, tensor.tensor_type)
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values.astype(np.float32)))


def _lazy_rows(loader: Loader, start: int, stop: int) -> Loader:
    return lambda: loader()[start:stop]


def _rows_in_rope_order(loader: Loader, heads: int) -> torch.Tensor | QuantizedWeight:
    """The rows in Hugging Face's order: llama.cpp interleaves each head's rotary halves."""
    value = loader()
    rows = value.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return value[order]


def _hf_names(arch: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> the name the model reads."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(model_arch, layers)
    names: dict[str, str] = {}
    # llama.cpp keeps Phi-3's gate and up fused as its `ffn_up`: claimed before `up_proj`
    first = ("mlp.gate_up_proj",) if arch == "phi3" else ()
    per_layer = (
        f"model.layers.{i}.{name}" for i in range(layers) for name in (*first, *_LAYER_NAMES)
    )
    for hf in (*_GLOBAL_NAMES, *per_layer):
        found = table.get_name(hf)
        if found is not None and hf.endswith(".sinks"):  # gpt-oss's: llama.cpp adds `.weight`
            names[found + ".weight"] = hf
        elif found is not None:
            for suffix in (".weight", ".bias"):
                names.setdefault(found + suffix, hf + suffix)
    return names
