"""A step's result: its tokens into the places held for them, the requests they end, and the
outputs for the gateways. A token of a row that left after its step was planned is dropped,
unless its request was preempted meanwhile (async scheduling): then it joins the tokens the
request resumes with."""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.in_flight import StepInFlight
from turnstile.scheduler_svc.lifecycle import RequestLifecycle
from turnstile.scheduler_svc.request import Status
from turnstile.shared.protocol import (
    REFUSED_BY_EXECUTOR,
    EngineOutputs,
    FrameError,
    StepResult,
    pack_ids,
    unpack_ids,
)


def take_result(lifecycle: RequestLifecycle, result: StepResult, latest: int) -> EngineOutputs:
    """The oldest step in flight is answered. Raises FrameError, changing nothing, for a
    result that does not fit it."""
    record = lifecycle.in_flight[0] if lifecycle.in_flight else None
    if record is None or result.step != record.step:
        raise FrameError(f"result for step {result.step}; step {latest} is the latest sent")
    sampled = unpack_ids(result.sampled)
    counts = unpack_ids(result.num_sampled).astype(np.int64)
    if len(counts) or len(record.drafted):
        _check_drafted(record, sampled, counts)
    elif len(sampled) != len(record.slots):
        raise FrameError(f"{len(sampled)} sampled ids for {len(record.slots)} sampling rows")
    if len(sampled) and not (sampled.min() >= 0 and sampled.max() < lifecycle.vocab_size):
        raise FrameError(f"sampled ids outside the vocabulary [0, {lifecycle.vocab_size})")
    if result.logprobs and len(result.logprobs) != len(sampled):
        raise FrameError(f"{len(result.logprobs)} logprobs entries for {len(sampled)} ids")
    embedded = {embedding.req_id for embedding in result.embeddings}
    if embedded and not embedded <= set(record.req_ids.tolist()):
        raise FrameError("an embedding for a request that sampled no token in this step")
    if any(reason not in REFUSED_BY_EXECUTOR for _, reason, _ in result.refused):
        raise FrameError(f"a refusal for a reason not among {REFUSED_BY_EXECUTOR}")
    lifecycle.in_flight.popleft()
    for req_id, reason, why in result.refused:
        req = lifecycle.requests.get(req_id)
        if req is not None:  # an adapter's row ran on the base model: its KV is not cached
            lifecycle.leave(req, reason, why, publish=reason != "adapter")
    if len(record.drafted):
        return _take_drafted(lifecycle, record, result, sampled, counts)
    batch = lifecycle.batch
    live = record.live(batch)
    batch.fill_places(record.slots[live], record.index[live], sampled[live])
    if lifecycle.pool.enable_caching:
        for slot in record.still_prefilled(batch):
            lifecycle.prefix_cache.publish(slot)
    if live.all() and not lifecycle.padding:  # the common case: every token answered
        # an embedding's request samples a token that is never answered
        lifecycle.stats.generation_tokens += len(sampled) - len(result.embeddings)
        _end_stopped(lifecycle, record.slots, sampled, record.index + 1)
        lifecycle.retire_padding()  # a static padded batch whose last live row just ended
        return EngineOutputs(
            step=result.step,
            req_ids=pack_ids(record.req_ids),
            token_ids=result.sampled,
            finished=lifecycle.take_finished(),
            logprobs=result.logprobs,
            prompt_logprobs=result.prompt_logprobs,
            embeddings=result.embeddings,
        )
    answered = live.copy()
    if lifecycle.padding:  # padding rows' tokens are computed, never answered
        answered &= ~np.isin(record.slots, list(lifecycle.padding))
    rows = np.flatnonzero(answered)
    for i in np.flatnonzero(~live).tolist():
        answered[i] = _late_token(lifecycle, record, i, int(sampled[i]))
    kept = np.flatnonzero(answered)
    answered_ids = set(record.req_ids[kept].tolist())
    embeddings = [e for e in result.embeddings if e.req_id in answered_ids]
    lifecycle.stats.generation_tokens += len(kept) - len(embeddings)
    _end_stopped(lifecycle, record.slots[rows], sampled[rows], record.index[rows] + 1)
    lifecycle.retire_padding()
    return EngineOutputs(
        step=result.step,
        req_ids=pack_ids(record.req_ids[kept]),
        token_ids=pack_ids(sampled[kept]),
        finished=lifecycle.take_finished(),
        logprobs=[result.logprobs[i] for i in kept.tolist()] if result.logprobs else [],
        prompt_logprobs=result.prompt_logprobs,
        embeddings=embeddings,
    )


def _check_drafted(record: StepInFlight, sampled: np.ndarray, counts: np.ndarray) -> None:
    if len(counts) != len(record.slots) or len(record.drafted) != len(record.slots):
        raise FrameError(f"{len(counts)} counts of sampled ids for {len(record.slots)} rows")
    fits = (counts >= 1) & (counts <= record.drafted + 1)
    if int(counts.sum()) != len(sampled) or not fits.all():
        raise FrameError("each row samples from 1 to its drafts + 1 ids, and they all come")


def _take_drafted(
    lifecycle: RequestLifecycle,
    record: StepInFlight,
    result: StepResult,
    sampled: np.ndarray,
    counts: np.ndarray,
) -> EngineOutputs:
    """A step with drafts: each row's drafts that stood, then the token after them, up to the
    first that ends it. Plans go in lockstep then, with no padding: a row that left while the
    step ran was aborted, and its tokens are dropped."""
    batch = lifecycle.batch
    live = np.flatnonzero(record.live(batch))
    starts = np.cumsum(counts) - counts
    answered, lengths = [], []
    for i in live.tolist():
        tokens = sampled[starts[i] : starts[i] + counts[i]]
        req = batch.requests[int(record.slots[i])]
        ends = np.isin(tokens, list(req.stop_token_ids))  # type: ignore[union-attr]
        if batch.stops_at_eos[record.slots[i]]:
            ends |= np.isin(tokens, lifecycle.eos_token_ids)
        length = int(np.argmax(ends)) + 1 if ends.any() else len(tokens)
        answered.extend(range(starts[i], starts[i] + length))
        lengths.append(length)
    slots, first = record.slots[live], (record.index - record.drafted)[live]
    emitted = [sampled[s : s + n] for s, n in zip(starts[live].tolist(), lengths, strict=True)]
    lifecycle.pool.release(batch.keep_drafted(slots, first, emitted))
    if lifecycle.pool.enable_caching:
        for slot in record.still_prefilled(batch):
            lifecycle.prefix_cache.publish(slot)
    stats = lifecycle.stats
    drafting = live[record.drafted[live] > 0]
    stats.spec_drafts += len(drafting)
    stats.spec_draft_tokens += int(record.drafted[drafting].sum())
    stats.spec_accepted_tokens += int((counts[drafting] - 1).sum())
    req_ids = np.repeat(record.req_ids[live], lengths)
    live_ids = set(record.req_ids[live].tolist())
    embeddings = [e for e in result.embeddings if e.req_id in live_ids]
    stats.generation_tokens += len(answered) - len(embeddings)
    last = np.array([tokens[-1] for tokens in emitted], dtype=np.int64)
    _end_stopped(lifecycle, slots, last, first + np.array(lengths, dtype=np.int64))
    return EngineOutputs(
        step=result.step,
        req_ids=pack_ids(req_ids),
        token_ids=pack_ids(sampled[answered]),
        finished=lifecycle.take_finished(),
        logprobs=[result.logprobs[j] for j in answered] if result.logprobs else [],
        prompt_logprobs=result.prompt_logprobs,
        embeddings=embeddings,
    )


def _end_stopped(
    lifecycle: RequestLifecycle, slots: np.ndarray, sampled: np.ndarray, length: np.ndarray
) -> None:
    """End the rows whose new token is EOS or a stop token id, or reaches their length."""
    batch = lifecycle.batch
    eos = lifecycle.eos_token_ids
    by_eos = (sampled == eos[0]) if len(eos) == 1 else np.isin(sampled, eos)
    by_eos &= batch.stops_at_eos[slots]
    ended = by_eos | (length >= batch.stop_len[slots])
    if batch.num_with_stop_ids:
        for i in np.flatnonzero(batch.has_stop_ids[slots]).tolist():
            request = batch.requests[int(slots[i])]
            by_eos[i] |= int(sampled[i]) in request.stop_token_ids  # type: ignore[union-attr]
        ended |= by_eos
    for i in np.flatnonzero(ended).tolist():
        lifecycle.finish_row(int(slots[i]), "stop" if by_eos[i] else "length")


def _late_token(lifecycle: RequestLifecycle, record: StepInFlight, i: int, token: int) -> bool:
    """A token for a row that left after its step was planned. It stands (and is answered)
    only for a request preempted meanwhile and not yet back: it joins the tokens the
    request resumes with, and may end it."""
    req = lifecycle.requests.get(int(record.req_ids[i]))
    if req is None or req.status is not Status.WAITING:
        return False
    if len(req.token_ids) != int(record.index[i]):
        return False
    req.token_ids = np.append(req.token_ids, np.int32(token))
    if (req.stops_at_eos and token in lifecycle.eos_set) or token in req.stop_token_ids:
        lifecycle.leave(req, "stop")
    elif len(req.token_ids) >= req.stop_len:
        lifecycle.leave(req, "length")
    return True
