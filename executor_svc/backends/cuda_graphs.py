"""CUDA graphs of the model for decode steps: a decode step of a small model launches a few
hundred kernels, each costing the CPU more than the GPU spends on it; replaying a captured graph
launches them all at once. Captured at start for a list of batch sizes; a step is padded to the
next captured size (padding rows write no KV and read none); larger steps run eagerly."""

from __future__ import annotations

import torch

from turnstile.executor_svc.backend import DeviceStep, KVCaches
from turnstile.executor_svc.model.attention import AttentionBatch, PagedAttention
from turnstile.executor_svc.model.llama import LlamaModel


def capture_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """vLLM's list: 1, 2, 4, 8, then every multiple of 16, up to the batch's limit."""
    top = min(max_num_seqs, largest)
    return sorted({size for size in (1, 2, 4, 8, *range(16, top + 1, 16)) if size <= top})


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCaches,
        attention: PagedAttention,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
    ) -> None:
        """`max_blocks`: the widest block table a sequence can have."""
        device = kv_caches[0][0].device
        rows = max(sizes)
        self.sizes = sizes
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(sizes):  # largest first: the smaller ones reuse its memory
                plan = attention.plan_decode(
                    self.block_tables[:size], self.seq_lens[:size], block_size
                )
                batch = AttentionBatch(attention, self.slot_mapping[:size], plan, None, None, None)

                def run(size: int = size, batch: AttentionBatch = batch) -> torch.Tensor:
                    hidden = model.embed(self.input_ids[:size])
                    hidden = model.layers_forward(hidden, self.positions[:size], batch, kv_caches)
                    return model.final_norm(hidden)

                run()  # compiles the Triton kernels and warms cuBLAS outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = run()
                self.graphs[size] = graph

    def replay(self, step: DeviceStep) -> torch.Tensor | None:
        """The hidden states of an all-decode step, or None when it is larger than every
        captured size."""
        rows = step.input_ids.shape[0]
        size = next((size for size in self.sizes if size >= rows), None)
        if size is None or step.layers is None or step.layers.decode is None:
            return None
        plan = step.layers.decode
        self.input_ids[:rows].copy_(step.input_ids, non_blocking=True)
        self.positions[:rows].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(step.layers.slot_mapping, non_blocking=True)
        self.slot_mapping[rows:size].fill_(-1)
        self.block_tables[:rows, : plan.block_tables.shape[1]].copy_(plan.block_tables)
        self.seq_lens[:rows].copy_(plan.seq_lens, non_blocking=True)
        self.seq_lens[rows:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:rows]
