"""Runs one plan: apply it to the persistent batch, build tensors, forward, sample."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor_svc.cpu_runtime import best_dtype, keep_freed_memory
from executor_svc.model.attention import AttentionBatch
from executor_svc.model.llama import LlamaModel
from executor_svc.model.weights import load_weights
from executor_svc.plan_applier import PlanApplier
from executor_svc.sampler import Sampler
from kernels import attention_backend
from shared.model_info import ModelInfo, read_model_info
from shared.protocol import BatchPlan, StepResult, pack_ids

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    model_path: Path
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 256
    kv_cache_gib: float = 1.5
    num_blocks: int | None = None  # overrides kv_cache_gib
    max_model_len: int | None = None  # defaults to the model's context
    attention_backend: str = "auto"  # "torch" (CPU production path) or "triton" (CUDA)


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = best_dtype(self.device) if config.dtype == "auto" else config.dtype
        self.dtype = DTYPES[dtype]
        self.info: ModelInfo = read_model_info(config.model_path)
        self.max_model_len = min(
            config.max_model_len or self.info.max_model_len, self.info.max_model_len
        )
        weights = load_weights(config.model_path, self.info)
        self.model = LlamaModel(self.info, weights, self.dtype, self.device)
        del weights
        self.num_blocks = config.num_blocks or self._blocks_for(config.kv_cache_gib)
        shape = (self.num_blocks, config.block_size, self.info.num_kv_heads, self.info.head_dim)
        # Zeroed, not empty: masked-out slots are multiplied by zero weights, and NaN * 0 = NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.model.activation_dtype, device=self.device),
                torch.zeros(shape, dtype=self.model.activation_dtype, device=self.device),
            )
            for _ in range(self.info.num_layers)
        ]
        self.applier = PlanApplier(config.max_num_seqs, self.max_model_len, config.block_size)
        self.sampler = Sampler()
        self.kernels = attention_backend(
            config.attention_backend,
            self.device.type,
            self.model.activation_dtype,
            self.info.head_dim,
        )
        self.load_seconds = time.perf_counter() - started
        log.info("model ready in %.1f s, %d KV blocks", self.load_seconds, self.num_blocks)

    def reset(self, first_step: int) -> None:
        """Forget the batch (a new or restarted scheduler): the next plan is `first_step`."""
        self.applier = PlanApplier(
            self.config.max_num_seqs, self.max_model_len, self.config.block_size
        )
        self.applier.step = first_step - 1

    def _blocks_for(self, gib: float) -> int:
        info = self.info
        per_block = 2 * info.num_layers * self.config.block_size * info.num_kv_heads
        per_block *= info.head_dim * self.model.activation_dtype.itemsize
        return max(1, int(gib * 2**30) // per_block)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        inputs = self.applier.apply(plan)
        if len(inputs.rows) == 0:
            self.applier.commit(np.empty(0, dtype=np.int64))
            return StepResult(step=plan.step)
        device = self.device

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        positions = tensor(inputs.positions)
        batch = AttentionBatch.build(
            self.kernels,
            tensor(inputs.query_start_loc),
            positions,
            tensor(inputs.seq_lens),
            tensor(inputs.block_tables),
            tensor(inputs.slot_mapping),
            self.config.block_size,
            tokens_as_rows=self.model.fuses(self.kernels),
        )
        hidden = self.model.forward(tensor(inputs.input_ids), positions, batch, self.kv_caches)
        logits = self.model.logits(hidden[tensor(inputs.logits_indices)])
        rows = inputs.sample_rows
        table = self.applier.batch
        params = [self.applier.sampling[slot] for slot in rows.tolist()]
        output_index = table.num_tokens[rows] - table.num_prompt[rows]
        tokens, logprobs = self.sampler.sample(logits, params, output_index)
        sampled = tokens.cpu().numpy()
        self.applier.commit(sampled)
        return StepResult(step=plan.step, sampled=pack_ids(sampled), logprobs=logprobs)
