"""Structured output on the executor (xgrammar): each constrained request's grammar, compiled in
a background thread as the request joins (xgrammar caches it by spec), and its matcher, which
says at each sampling step which tokens the grammar allows and follows the tokens sampled.

A request that comes back after a preemption brings the tokens it generated; its new matcher
replays them, so its state is as before. xgrammar (with transformers) is imported by the first
constrained request, in the compile thread: an executor that never sees one never loads it.

A reasoning model's answer that starts inside its thinking (`SamplingParams.think_end`, its
</think>) is constrained only after that token: its grammar waits for it, and a thinking budget
leaves it the only token allowed once spent.

A row that verifies drafted tokens (speculative decoding) needs a mask at each of its positions:
its matcher takes the drafts one by one between them, and is rolled back after.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import Histogram

from turnstile.shared.model_info import ModelInfo
from turnstile.shared.protocol import Grammar, SamplingParams
from turnstile.shared.tokenizer import Tokenizer

COMPILE_SECONDS = Histogram(
    "turnstile:grammar_compile_seconds",
    "Time to compile a request's grammar (a cached one takes microseconds)",
    buckets=(1e-4, 1e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
)
MASK_SECONDS = Histogram(
    "turnstile:grammar_mask_seconds",
    "Host time per step to compute the constrained rows' token masks",
    buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.25),
)
# The longest run of whitespace between two JSON elements (pretty-printing four levels deep
# fits): unbounded, a small model may write newlines until max_tokens and never close the JSON.
MAX_JSON_WHITESPACE = 16
# xgrammar's messages start with where in its C++ they were raised: "[12:00:00] /x.cc:83: ".
_WHERE = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(slots=True)
class _Row:
    compiled: Future[Any] | None  # None: no grammar, a thinking budget alone
    replay: np.ndarray  # tokens generated before a preemption, for the new matcher
    matcher: Any = None  # xgrammar.GrammarMatcher, once compiled
    failed: bool = False
    ended: bool = False  # the matcher accepted a stop token: later tokens are never answered
    think_end: int = -1  # while thinking: its end, before which no grammar constrains
    budget: int = -1  # tokens the thinking may still take (-1: no limit)


class Grammars:
    """The matchers of the batch's constrained requests (a grammar, a thinking budget), by
    request id."""

    def __init__(self, tokenizer_path: Path, info: ModelInfo) -> None:
        self._tokenizer_path, self._info = tokenizer_path, info
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built in the pool's thread
        self._rows: dict[int, _Row] = {}
        self._refused: list[tuple[int, str, str]] = []
        self._mask = torch.empty(0, dtype=torch.int32)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def join(self, req_id: int, sampling: SamplingParams, generated: np.ndarray) -> None:
        """A request with a grammar or a thinking budget, and what it generated before."""
        end, grammar, budget = sampling.think_end, sampling.grammar, sampling.thinking_budget
        if budget >= 0:
            budget = max(budget - generated.size, 0)  # what the thinking may still take
        if end >= 0 and (found := np.flatnonzero(generated == end)).size:
            generated, end = generated[found[0] + 1 :], -1  # it ended before a preemption
        compiled = None if grammar is None else self._pool.submit(self._compile, grammar)
        self._rows[req_id] = _Row(compiled, generated if end < 0 else generated[:0],
                                  think_end=end, budget=budget)  # fmt: skip

    def clear(self) -> None:
        """Forget every request (a new batch); the compiled grammars stay cached."""
        self._rows.clear()
        self._refused.clear()

    def leave(self, req_ids: np.ndarray) -> None:
        for req_id in req_ids.tolist():
            self._rows.pop(req_id, None)

    def bitmask(
        self, req_ids: np.ndarray, drafts: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """For the sampling rows (`req_ids`, in row order) whose next token is constrained:
        their row indices and their allowed tokens, 32 a word (bit j of word w: token 32w + j).
        Waits for a grammar still compiling. `drafts`: where rows verify drafts, the drafted
        token each position follows (-1 at a row's first), in `req_ids`' order."""
        started = time.perf_counter()
        rows = [i for i, req_id in enumerate(req_ids.tolist()) if self._live(req_id)]
        if not rows:
            return None
        words = (self._info.vocab_size + 31) // 32
        if self._mask.shape[0] < len(rows):
            self._mask = torch.empty(max(len(rows), 2 * self._mask.shape[0]), words,
                                     dtype=torch.int32)  # fmt: skip
        taken: dict[int, int] = {}  # drafts each matcher took, to roll back; -1: one it refused
        for k, i in enumerate(rows):
            req_id = int(req_ids[i])
            row = self._rows[req_id]
            if drafts is not None and drafts[i] >= 0 and taken.get(req_id, 0) >= 0:
                took = row.matcher.accept_token(int(drafts[i]))
                if took:
                    taken[req_id] = taken.get(req_id, 0) + 1
                else:
                    row.matcher.rollback(taken.pop(req_id, 0))
                    taken[req_id] = -1
            if row.think_end >= 0:  # its thinking's budget is spent: only its end is allowed
                self._mask[k] = 0
                word, bit = divmod(row.think_end, 32)
                self._mask[k, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's bits
            elif taken.get(req_id, 0) < 0 or row.matcher.is_terminated():
                self._mask[k] = -1  # after a draft that cannot stand: never sampled from
            else:
                row.matcher.fill_next_token_bitmask(self._mask, k)
        for req_id, count in taken.items():
            if count > 0:
                self._rows[req_id].matcher.rollback(count)
        MASK_SECONDS.observe(time.perf_counter() - started)
        return np.array(rows, dtype=np.int64), self._mask[: len(rows)].numpy()

    def accept(
        self, req_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray | None = None
    ) -> None:
        """The sampling rows' new tokens, into their matchers: `counts` each, rows laid end
        to end (drafts that stood and the token after them); one each without."""
        ends = np.arange(1, len(req_ids) + 1) if counts is None else np.cumsum(counts)
        starts = ends - (1 if counts is None else counts)
        for req_id, start, end in zip(
            req_ids.tolist(), starts.tolist(), ends.tolist(), strict=True
        ):
            for token in tokens[start:end].tolist():
                self._accept(req_id, token)

    def _accept(self, req_id: int, token: int) -> None:
        row = self._rows.get(req_id)
        if row is not None and row.think_end >= 0:
            if token == row.think_end and row.compiled is None:
                del self._rows[req_id]  # a budget alone: no step need wait for its tokens
            elif token == row.think_end:
                row.think_end = -1  # the answer, and its grammar, start
            elif row.budget > 0:
                row.budget -= 1
            return
        if row is None or row.matcher is None or row.ended:
            return
        if row.matcher.accept_token(token):
            row.ended = row.matcher.is_terminated()
        else:  # cannot happen while every live row is masked; end it rather than go on
            self._fail(req_id, row, f"the grammar refused token {token}, which it allowed")

    def take_refused(self) -> list[tuple[int, str, str]]:
        """(req_id, "grammar", why) for the requests whose grammar failed them since the last
        call (it did not compile, or refused a token)."""
        refused, self._refused = self._refused, []
        return refused

    def _live(self, req_id: int) -> bool:
        """Whether the request's next token is constrained."""
        row = self._rows.get(req_id)
        if row is None or row.failed or row.ended:
            return False
        if row.think_end >= 0:
            return row.budget == 0
        if row.compiled is None:
            return False
        if row.matcher is None:
            try:
                compiled = row.compiled.result()
            except Exception as exc:  # xgrammar's error for a spec it cannot compile
                self._fail(req_id, row, "the grammar does not compile: " + _reason(exc))
                return False
            import xgrammar

            row.matcher = xgrammar.GrammarMatcher(compiled)
            if not all(map(row.matcher.accept_token, row.replay.tolist())):
                self._fail(req_id, row, "the grammar refuses the tokens generated before")
                return False
            row.ended = row.matcher.is_terminated()
        return not row.ended

    def _fail(self, req_id: int, row: _Row, why: str) -> None:
        row.failed = True
        self._refused.append((req_id, "grammar", why))

    def _compile(self, grammar: Grammar) -> Any:
        started = time.perf_counter()
        compiler = self._compiler or self._start_compiler()
        if grammar.kind == "json":
            # Any JSON object, or the schema's (strict: no properties it does not name).
            schema = grammar.spec or '{"type": "object"}'
            compiled = compiler.compile_json_schema(
                schema,
                any_whitespace=grammar.any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if grammar.any_whitespace else None,
                strict_mode=bool(grammar.spec),
            )
        elif grammar.kind == "regex":
            compiled = compiler.compile_regex(grammar.spec)
        elif grammar.kind == "ebnf":
            compiled = compiler.compile_grammar(grammar.spec)
        else:
            raise RuntimeError(f"unknown grammar kind {grammar.kind!r}")
        COMPILE_SECONDS.observe(time.perf_counter() - started)
        return compiled

    def _start_compiler(self) -> Any:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tokenizer = Tokenizer(self._tokenizer_path, self._info)
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
            vocab_size=self._info.vocab_size,
            stop_token_ids=list(self._info.all_eos_token_ids),
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _reason(exc: Exception) -> str:
    return _WHERE.sub("", str(exc)).strip()
