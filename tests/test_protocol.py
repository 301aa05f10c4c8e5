from __future__ import annotations

import msgspec
import numpy as np
import pytest

from turnstile.shared.protocol import (
    AddRequest,
    BatchPlan,
    EngineOutputs,
    Finished,
    NewRequest,
    SamplingParams,
    StepResult,
    pack_ids,
    unpack_ids,
)

MESSAGES = [
    BatchPlan(
        step=7,
        removed=pack_ids([3]),
        new=[
            NewRequest(
                req_id=9,
                token_ids=pack_ids([1, 2, 3]),
                num_prompt_tokens=3,
                num_computed=0,
                num_scheduled=3,
                block_ids=pack_ids([4]),
                sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, logprobs=2),
            )
        ],
        override_ids=pack_ids([1]),
        override_counts=pack_ids([0]),
        new_block_ids=pack_ids([10, 11]),
    ),
    StepResult(step=7, sampled=pack_ids([42, 43]), logprobs=[[(42, -0.5)], [(43, -1.25)]]),
    AddRequest(req_id=1, prompt_ids=pack_ids([5, 6]), max_tokens=4, stop_token_ids=[7]),
    EngineOutputs(
        step=2,
        req_ids=pack_ids([1]),
        token_ids=pack_ids([8]),
        finished=[Finished(1, "error", "bad")],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_msgpack(message: msgspec.Struct) -> None:
    wire = msgspec.msgpack.encode(message)
    assert msgspec.msgpack.decode(wire, type=type(message)) == message


def test_tagged_union_tells_message_kinds_apart() -> None:
    decoder = msgspec.msgpack.Decoder(BatchPlan | StepResult | AddRequest | EngineOutputs)
    for message in MESSAGES:
        assert type(decoder.decode(msgspec.msgpack.encode(message))) is type(message)


def test_id_arrays_are_four_bytes_each() -> None:
    ids = np.array([0, 1, 2**31 - 1], dtype=np.int64)
    assert len(pack_ids(ids)) == 12
    assert unpack_ids(pack_ids(ids)).tolist() == ids.tolist()


def test_empty_steady_decode_plan_is_tiny() -> None:
    assert len(msgspec.msgpack.encode(BatchPlan(step=123456))) <= 17


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode(MESSAGES[0])[:-3],
        msgspec.msgpack.encode([1, "seven"]),
        msgspec.msgpack.encode({"step": 1}),
    ],
)
def test_malformed_frames_raise_a_decode_error(wire: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(wire, type=BatchPlan)
