"""Plain torch on any device: the reference the other backends are tested against, and the
CPU's backend where the native kernels cannot run."""

from __future__ import annotations

from turnstile.executor_svc.backend import Backend
from turnstile.executor_svc.cpu_runtime import native_bf16_matmul
from turnstile.executor_svc.model.attention import PagedAttention
from turnstile.kernels import reference

TORCH_ATTENTION = PagedAttention(
    reference.write_kv,
    reference.paged_decode_attention,
    reference.paged_prefill_attention,
    reference.plan_decode,
)


class TorchReferenceBackend(Backend):
    name = "torch"
    attention = TORCH_ATTENTION

    def default_dtype(self) -> str:
        """bfloat16 only where torch multiplies it in hardware."""
        return "bfloat16" if native_bf16_matmul(self.device) else "float32"
