"""`turnstile bench serve`: load any OpenAI-compatible server (Turnstile, vLLM, llama.cpp) and
measure what users feel: TTFT, TPOT, ITL, end-to-end latency, throughput, goodput.

Datasets (all seeded): `random` (token ids, lengths fixed or within +-range-ratio), `longtail`
(output lengths lognormal around --output-len with sigma 1, clipped to 8..1024),
`shared-prefix` (--num-prefixes long prefixes of --prefix-len tokens, each prompt one of them plus
--input-len tokens of its own). Arrivals: at --rate with gamma-distributed gaps of shape
--burstiness (1: Poisson; below 1 burstier; inf: evenly spaced, as vLLM's bench), or --concurrency
clients in a loop. `--structured-output`: every request answers as JSON of `ORDER_SCHEMA`, a list
of at least 64 items, so the grammar constrains each token of an answer of up to ~1,000.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
import uvloop

ORDER_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                       "size": {"enum": ["small", "medium", "large"]}},
        "required": ["name", "quantity", "size"],
    }, "minItems": 64}},
    "required": ["items"],
}  # fmt: skip
STRUCTURED = {
    "response_format": {
        "type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}
    }
}  # fmt: skip


@dataclass(slots=True)
class Job:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class Outcome:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def make_jobs(
    dataset: str, count: int, input_len: int, output_len: int, seed: int,
    range_ratio: float = 0.0, num_prefixes: int = 4, prefix_len: int = 512,
) -> list[Job]:  # fmt: skip
    rng = np.random.default_rng(seed)

    def lengths(center: int) -> np.ndarray:
        low, high = max(1, int(center * (1 - range_ratio))), int(center * (1 + range_ratio))
        return rng.integers(low, high + 1, count)

    def tokens(n: int) -> list[int]:
        return rng.integers(100, 40000, n).tolist()

    if dataset == "random":
        pairs = zip(lengths(input_len), lengths(output_len), strict=True)
        return [Job(tokens(i), int(o)) for i, o in pairs]
    if dataset == "longtail":
        outputs = np.clip(np.round(rng.lognormal(math.log(output_len), 1.0, count)), 8, 1024)
        return [Job(tokens(input_len), int(o)) for o in outputs]
    if dataset == "shared-prefix":
        prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
        return [
            Job(prefixes[i % num_prefixes] + tokens(input_len), output_len) for i in range(count)
        ]
    raise ValueError(f"unknown dataset {dataset!r}")


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, job: Job, extra: dict
) -> Outcome:
    body = {
        "model": model, "prompt": job.prompt, "max_tokens": job.output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    outcome = Outcome(ok=False, start=time.perf_counter())
    last = outcome.start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    outcome.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    outcome.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if outcome.ttft == 0.0:
                        outcome.ttft = now - outcome.start
                    else:
                        outcome.itl.append(now - last)
                    last = now
        outcome.e2e = time.perf_counter() - outcome.start
        outcome.ok = outcome.output_tokens > 0
    except aiohttp.ClientError as exc:
        outcome.error = str(exc)
    return outcome


def arrival_gap(rng: np.random.Generator, rate: float, burstiness: float) -> float:
    """Seconds to the next request: gamma-distributed with mean 1 / rate and shape
    `burstiness`, so 1 is a Poisson process and infinity an even spacing."""
    if math.isinf(burstiness):
        return 1 / rate
    return float(rng.gamma(burstiness, 1 / (rate * burstiness)))


def run_load(
    url: str, model: str, jobs: list[Job], rate: float, concurrency: int | None, seed: int,
    progress: bool = True, burstiness: float = 1.0, structured: bool = False,
) -> tuple[list[Outcome], float]:  # fmt: skip
    """Outcomes in job order and the wall time of the whole run. On uvloop: the client shares
    the CPU with the server it measures here, and takes a fifth less of it than on asyncio's
    own loop. `structured`: each request's answer constrained to `ORDER_SCHEMA`."""
    extra = STRUCTURED if structured else {}
    return uvloop.run(_load(url, model, jobs, rate, concurrency, seed, progress, burstiness, extra))


async def _load(
    url: str, model: str, jobs: list[Job], rate: float, concurrency: int | None, seed: int,
    progress: bool, burstiness: float, extra: dict,
) -> tuple[list[Outcome], float]:  # fmt: skip
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), disable=not progress, unit="req")
    rng = np.random.default_rng(seed + 1)
    limit = asyncio.Semaphore(concurrency or len(jobs))
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def guarded(job: Job) -> Outcome:
            async with limit:
                outcome = await _one(session, url, model, job, extra)
            bar.update()
            return outcome

        started = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(guarded(job)))
            if math.isfinite(rate):
                await asyncio.sleep(arrival_gap(rng, rate, burstiness))
        outcomes = await asyncio.gather(*tasks)
    bar.close()
    return list(outcomes), time.perf_counter() - started


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.array(values) * 1000
    return {
        "mean": float(array.mean()),
        **{f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)},
    }


def summarize(
    outcomes: list[Outcome], duration: float, slo_ttft: float, slo_tpot: float
) -> dict[str, object]:
    done = [o for o in outcomes if o.ok]
    good = [o for o in done if o.ttft <= slo_ttft and o.tpot <= slo_tpot]
    return {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": duration,
        "prompt_tokens": sum(o.prompt_tokens for o in done),
        "output_tokens": sum(o.output_tokens for o in done),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(o.output_tokens for o in done) / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "ttft_ms": _stats([o.ttft for o in done]),
        "tpot_ms": _stats([o.tpot for o in done if o.output_tokens > 1]),
        "itl_ms": _stats([gap for o in done for gap in o.itl]),
        "e2e_ms": _stats([o.e2e for o in done]),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def plot(outcomes: list[Outcome], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [o for o in outcomes if o.ok]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    for axis, values, name in (
        (axes[0], [o.ttft * 1000 for o in done], "TTFT (ms)"),
        (axes[1], [o.tpot * 1000 for o in done if o.output_tokens > 1], "TPOT (ms)"),
        (axes[2], [o.e2e for o in done], "end-to-end (s)"),
    ):
        axis.hist(values, bins=30)
        axis.set_xlabel(name)
        axis.set_ylabel("requests")
    start = min(o.start for o in done)
    finish = [o.start + o.e2e - start for o in done]
    axes[3].hist(finish, bins=30, weights=[o.output_tokens for o in done])
    axes[3].set_xlabel("time (s)")
    axes[3].set_ylabel("output tokens completed")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def result_record(outcomes: list[Outcome], summary: dict[str, object]) -> dict[str, object]:
    return {"summary": summary, "requests": [asdict(o) for o in outcomes]}
