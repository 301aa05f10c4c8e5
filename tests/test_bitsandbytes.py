"""bitsandbytes 4-bit checkpoints as transformers writes them (a random Llama quantized by
bitsandbytes itself on the CPU, through `BitsAndBytesConfig`, then saved): read, each matrix is
exactly what bitsandbytes' own `dequantize_4bit` gives; served, they generate transformers'
tokens on those values (logprobs to 1e-4; bitsandbytes' CPU forward itself rounds its products
further, 0.13 in logprobs here); what is not served is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_families import _checkpoint, generates_what_transformers_generates
from test_model_info import BASE_CONFIG

from turnstile.shared.model_info import read_model_info
from turnstile.shared.model_support import UnsupportedModel

pytestmark = pytest.mark.slow  # loads transformers and bitsandbytes


@pytest.mark.parametrize(("kind", "double"), [("nf4", True), ("nf4", False), ("fp4", True)])
def test_a_4bit_checkpoint_generates_what_transformers_generates(
    kind: str, double: bool, tmp_path: Path
) -> None:
    """NF4 and FP4 codes, absmax plain or double-quantized (8-bit codes of their own)."""
    import bitsandbytes
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from turnstile.executor_svc.model.weights import load_weights

    _checkpoint("linear").save_pretrained(tmp_path / "float")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                bnb_4bit_use_double_quant=double,
                                bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=config, device_map="cpu"
    )
    model.save_pretrained(tmp_path / kind)
    info = read_model_info(tmp_path / kind)
    assert (info.quantization, info.weight_type) == ("bitsandbytes", kind)
    values = {
        f"{name}.weight": dequantize_4bit(module.weight, module.weight.quant_state)
        for name, module in model.named_modules()
        if isinstance(module, bitsandbytes.nn.Linear4bit)
    }
    ours = load_weights(tmp_path / kind, info)
    assert len(values) == 14 and all(torch.equal(ours[name], v) for name, v in values.items())
    reference = _checkpoint("linear")
    missing, _ = reference.load_state_dict(values, strict=False)
    assert not [name for name in values if name in missing]
    generates_what_transformers_generates(tmp_path / kind, reference, "linear", "cpu")


BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({**BNB, "load_in_4bit": False, "load_in_8bit": True}, "load_in_8bit"),
        ({**BNB, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type"),
        ({**BNB, "bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
    ],
)
def test_a_bitsandbytes_config_not_served_is_refused_by_field(
    quant: dict, field: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | {"quantization_config": quant}))
    with pytest.raises(UnsupportedModel, match=f"config.json: quantization_config.{field} = "):
        read_model_info(tmp_path)
