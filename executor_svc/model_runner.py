"""Runs one plan: apply it to the persistent batch, upload the step, forward, sample."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np
import torch

from turnstile.executor_svc.adapters import Adapters
from turnstile.executor_svc.backend import DTYPES, DeviceStep
from turnstile.executor_svc.backends import create_backend
from turnstile.executor_svc.cpu_runtime import zero_pages
from turnstile.executor_svc.grammar import Grammars
from turnstile.executor_svc.kv_cache_size import kv_cache_bytes
from turnstile.executor_svc.model.encoder import EncoderModel
from turnstile.executor_svc.model.layer_weights import Weight
from turnstile.executor_svc.model.llama import LlamaModel
from turnstile.executor_svc.model.lora import LoraWeights
from turnstile.executor_svc.model.modernbert import ModernBertModel
from turnstile.executor_svc.model.weights import load_weights
from turnstile.executor_svc.plan_applier import HOLE, PlanApplier, StepInputs
from turnstile.executor_svc.prompt_logprobs import PromptPositions, fold, prompt_table
from turnstile.executor_svc.runner_config import ExecutorConfig, RunnerConfig
from turnstile.executor_svc.sampler import Logprobs, Sampled, SamplingArrays
from turnstile.executor_svc.staging import Staging
from turnstile.executor_svc.step_in_flight import Carry, PendingStep, ReadyStep, StepInFlight
from turnstile.executor_svc.tensor_parallel import TensorParallel, join_group
from turnstile.shared.batch_table import spread
from turnstile.shared.lora import adapters as lora_adapters
from turnstile.shared.model_info import ModelInfo
from turnstile.shared.protocol import (
    BatchPlan,
    Embedding,
    StepResult,
    adjusts_logits,
    constrains,
    pack_ids,
    unpack_ids,
)

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        started = time.perf_counter()
        self.config = config
        engine, executor = config.engine, config.executor
        self.info: ModelInfo = engine.model_info()
        TensorParallel(executor.rank, engine.tensor_parallel_size).check(self.info)
        self.backend = create_backend(config, self.info)
        self.tp = join_group(
            executor.rank,
            engine.tensor_parallel_size,
            executor.distributed_init_method,
            self.backend.device,
            executor.distributed_timeout,
        )
        self.device = self.backend.device
        self.dtype = DTYPES[
            self.backend.default_dtype() if executor.dtype == "auto" else executor.dtype
        ]
        self.max_model_len = min(
            engine.max_model_len or self.info.max_model_len, self.info.max_model_len
        )
        self.quantized = self.backend.keeps_quantized()
        self.model = self._model(load_weights(config.model_path, self.info, self.quantized))
        self.kv_dtype = self.backend.kv_cache_dtype(self.model.activation_dtype, self.quantized)
        self.num_blocks = executor.num_blocks or self._blocks_for(executor)
        # Zeroed, not empty: masked-out slots are multiplied by zero weights, and NaN * 0 = NaN.
        layers = 0 if self.info.encoder_only else self.info.num_layers  # an encoder keeps none
        self.kv_caches = [(self._zeros(), self._zeros()) for _ in range(layers)]
        self.enable_lora = config.lora.enable_lora
        self.max_loras = config.lora.kept_loaded if self.enable_lora else 0
        dtype = self.model.activation_dtype
        lora = LoraWeights(self.info, dtype, self.device, self.tp) if self.enable_lora else None
        self.adapters = Adapters(config.lora, self.info, lora)
        named = lora_adapters(config.lora, self.info)
        self.adapters.preload([adapter.ref for adapter in named])
        self.backend.bind(self.model, self.kv_caches, lora)
        self.applier = PlanApplier(engine.max_num_seqs, self.max_model_len, engine.block_size)
        self.grammars = Grammars(engine.tokenizer_path, self.info)
        self._in_flight: list[StepInFlight] = []  # launched, oldest first, not yet settled
        self._mask_staging = Staging(self.device)  # the grammars' masks, once the step runs
        # Unseeded rows draw keys from this generator: every rank seeds it alike.
        seed = executor.seed  # --seed: the same on every rank
        self._rng = np.random.default_rng(
            self.tp.shared_seed(self.device) if seed is None else seed
        )
        self.load_seconds = time.perf_counter() - started
        log.info(
            "model ready in %.1f s on the %s backend%s, %d KV blocks",
            self.load_seconds,
            self.backend.name,
            f", {self.info.quantization.upper() or 'GGUF'} weights kept quantized"
            if self.quantized
            else "",
            self.num_blocks,
        )

    def reset(self, first_step: int) -> None:
        """Forget the batch (a new or restarted scheduler): the next plan is `first_step`."""
        self.applier = PlanApplier(
            self.config.engine.max_num_seqs, self.max_model_len, self.config.engine.block_size
        )
        self.applier.step = first_step - 1
        self.grammars.clear()
        self.adapters.take_refused()  # the old batch's
        self._in_flight = []

    def _model(self, weights: Mapping[str, Weight]) -> LlamaModel | EncoderModel:
        """The model on the backend's device, with its kernels; this rank's share of it."""
        backend, info = self.backend, self.info
        where = (self.dtype, backend.activation_dtype(self.dtype), self.device)
        if info.encoder_only:
            family = ModernBertModel if info.encoder_family == "modernbert" else EncoderModel
            return family(info, weights, *where, backend.projection)
        kernels = (backend.projection, backend.experts, backend.rms_norm)
        return LlamaModel(info, weights, *where, *kernels, self.tp)

    def _zeros(self) -> torch.Tensor:
        engine = self.config.engine
        assert isinstance(self.model, LlamaModel)
        shape = (self.num_blocks, engine.block_size, self.model.num_kv_heads, self.info.head_dim)
        if self.device.type == "cpu":
            return zero_pages(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _blocks_for(self, executor: ExecutorConfig) -> int:
        """The blocks the KV cache's memory holds (`kv_cache_size.py`), alike on every rank; an
        encoder's, bookkeeping only: as many as `--max-num-seqs` whole prompts fill."""
        info, size = self.info, self.config.engine.block_size
        if not isinstance(self.model, LlamaModel):
            return self.config.engine.max_num_seqs * -(-self.max_model_len // size)
        per_block = 2 * info.num_layers * size * self.model.num_kv_heads
        per_block *= info.head_dim * self.kv_dtype.itemsize
        memory = kv_cache_bytes(executor, self.device, self.tp.size)
        return self.tp.fewest(max(1, memory // per_block), self.device)

    def upload(self, inputs: StepInputs, carry: Carry | None = None) -> DeviceStep:
        """The step onto the device, with its rows' sampling parameters."""
        rows = inputs.sample_rows
        table = self.applier.batch
        output_index = table.num_tokens[rows] - table.num_prompt[rows]
        if inputs.sample_counts is not None:  # a row's drafts: a position each, as if known
            output_index = spread(output_index, inputs.sample_counts)
            rows = np.repeat(rows, inputs.sample_counts)
        params = [self.applier.sampling[slot] for slot in rows.tolist()]

        def history(row: int) -> tuple[np.ndarray, np.ndarray]:
            """A position's tokens before it: a draft's include the drafts ahead of it."""
            slot, prompt = rows[row], table.num_prompt[rows[row]]
            tokens = table.tokens[slot, : prompt + output_index[row]]
            return tokens[:prompt], tokens[prompt:]

        adjusting = np.flatnonzero(self.applier.adjusts[rows])
        sampling = SamplingArrays.build(
            params,  # type: ignore[arg-type]  # every row in a step has its parameters
            output_index,
            self._rng,
            history,
            adjusting,
        )
        if self.applier.wants_prompt_logprobs:
            sampling.prompt = PromptPositions.build(inputs, table, self.applier.sampling)
        return self.backend.upload(inputs, sampling, carry)

    @torch.inference_mode()
    def run(
        self, step: DeviceStep, constrained: np.ndarray | None = None,
        drafts: np.ndarray | None = None,
    ) -> tuple[Sampled, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Forward and sample, all on the device, with no host sync (the tokens leave later,
        in a `HostCopy`); with the prompt logprobs asked for, their table; with embeddings,
        their vectors. `constrained`: the sampled positions' request ids, where some have a
        grammar; `drafts`: the drafted token each position follows (`drafts_before`)."""
        hidden = self.backend.forward(step)
        last = hidden[step.logits_indices]
        logits = self.model.logits(last)
        embed_rows = step.sampling.device.get("embed_rows")
        vectors = None if embed_rows is None else self.model.pooled(last[embed_rows])
        mask = None if constrained is None else self.grammars.bitmask(constrained, drafts)
        if mask is not None:  # computed on the host while the device computes the logits
            rows, words = mask
            on = self._mask_staging.upload({"grammar_rows": rows, "grammar_mask": words})
            step.sampling.device |= on
        prompt = step.sampling.host.prompt
        table = None
        if prompt is not None:
            on = step.sampling.device
            width = max(top for *_, top in prompt.rows)
            prompt_logits = self.model.logits(hidden[on["prompt_tokens"]])
            table = prompt_table(prompt_logits, on["prompt_targets"], width)
        return self.backend.sample(logits, step.sampling), table, vectors

    def execute(self, plan: BatchPlan) -> StepResult:
        """Run a step to its end."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: BatchPlan) -> PendingStep:
        """Start a step without waiting for the one before it to end: where its inputs are
        that step's tokens, they are taken from it on the device. A step whose rows read the
        tokens on the host (a grammar, penalties, bad words) waits for them first."""
        for older in self._in_flight[:-1]:
            older.result()
        if self._in_flight and self._needs_tokens(plan):
            self._in_flight[-1].result()
        self._in_flight = [flight for flight in self._in_flight if not flight.settled]
        slots = {}  # joining requests' adapters: steady decode looks up none
        if plan.new:
            in_use = self.applier.lora[self.applier.batch.order]
            slots = self.adapters.slots_for(plan.new, in_use)
        inputs = self.applier.apply(plan, slots)
        self.follow_grammars(plan)
        if len(inputs.rows) == 0:
            self.applier.commit(np.empty(0, dtype=np.int64))
            return ReadyStep(plan.step, StepResult(step=plan.step))
        step = self.upload(inputs, self._carry(inputs))
        drafted = self.applier.drafted
        req_ids = self.applier.batch.req_ids[inputs.sample_rows]  # a sampled position's each
        req_ids = req_ids if drafted is None else np.repeat(req_ids, drafted + 1)
        grammars = bool(self.grammars)
        drafts = self.applier.drafts_before() if grammars else None
        sampled, table, vectors = self.run(step, req_ids if grammars else None, drafts)
        reserved = self.applier.reserve()
        prompt = step.sampling.host.prompt
        embedded = step.sampling.host.embed_rows

        def finish(tokens: np.ndarray, logprobs: Logprobs) -> StepResult:
            kept = None
            if drafted is not None:
                verified = self.applier.verify(reserved, drafted, tokens)
                tokens, kept = tokens[verified.kept], verified.counts
                logprobs = [logprobs[i] for i in verified.kept.tolist()]
            else:
                self.applier.fill(reserved, tokens)
            if grammars:
                self.grammars.accept(reserved.req_ids, tokens, kept)
            prompt_logprobs = (
                [] if prompt is None or table is None else fold(prompt, table.cpu().numpy())
            )
            return StepResult(
                step=plan.step,
                sampled=pack_ids(tokens),
                num_sampled=b"" if kept is None else pack_ids(kept),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                refused=self.grammars.take_refused() + self.adapters.take_refused(),
                embeddings=embeddings(req_ids, embedded, vectors),
            )

        flight = StepInFlight(plan.step, sampled, reserved.rows, finish)
        self._in_flight.append(flight)
        return flight

    def _needs_tokens(self, plan: BatchPlan) -> bool:
        """Whether the step's rows read their tokens on the host."""
        current = self.applier.adjusts[self.applier.batch.order].any()
        joining = any(adjusts_logits(n.sampling) or constrains(n.sampling) for n in plan.new)
        drafts = plan.drafts is not None or self.applier.drafted is not None  # rows' tokens moved
        return bool(self.grammars) or bool(current) or joining or drafts

    def _carry(self, inputs: StepInputs) -> Carry | None:
        """Which of the step's input tokens the step still in flight samples, and where."""
        holes = np.flatnonzero(inputs.input_ids == HOLE)
        if not len(holes):
            return None
        if not self._in_flight:
            raise RuntimeError("step inputs wait on tokens no step in flight samples")
        flight = self._in_flight[-1]  # only the latest can be unsettled here
        row_of = np.full(self.applier.batch.capacity, -1, dtype=np.int64)
        row_of[flight.rows] = np.arange(len(flight.rows))
        owner = np.repeat(inputs.rows, np.diff(inputs.query_start_loc))[holes]
        source = row_of[owner]
        if (source < 0).any():
            raise RuntimeError("step inputs wait on tokens no step in flight samples")
        return Carry(holes, source, flight.sampled.tokens)

    def follow_grammars(self, plan: BatchPlan) -> None:
        """Matchers for the constrained requests that joined; none for those that left."""
        if self.grammars and plan.removed:
            self.grammars.leave(unpack_ids(plan.removed))
        for new in plan.new:
            if constrains(new.sampling):
                tokens = unpack_ids(new.token_ids)
                self.grammars.join(new.req_id, new.sampling, tokens[new.num_prompt_tokens :])


def embeddings(
    req_ids: np.ndarray, rows: np.ndarray | None, vectors: torch.Tensor | None
) -> list[Embedding]:
    """The step's embeddings, on the host once its tokens are (rare: the copy may wait)."""
    if rows is None or vectors is None:
        return []
    host = vectors.cpu().numpy().astype("<f4")
    return [Embedding(int(req_ids[row]), host[i].tobytes()) for i, row in enumerate(rows)]
