"""Grammar-constrained decoding: `response_format` JSON object / JSON schema, and this
server's `{"type": "regex", "regex": P}` / `{"type": "choice", "choice": [...]}` (issue 63),
via llguidance.

`ResponseFormat.parse(raw)` validates an OpenAI `response_format` (a ValueError names the
field), or the internal `{"type": "grammar", "grammar": <lark>}` that tool calling builds
(`minisgl.tools`; the HTTP API does not take it from clients); the sampler asks a `GrammarBank` for the allowed tokens of each constrained row, and
only those rows pay. A row's matcher is keyed by its request id (`rid`; else its `input_ids`
array, ended by a weak reference) and its format, and catches up with the row's committed
outputs before each mask, so it works for any request type that has `output_ids`; one not
asked for during `IDLE_CALLS` masks is dropped (rebuilt, by catching up, if its request comes
back). The rid keeps one matcher per request even where a row's `input_ids` is a property
that may build a new array each step (an array key would then replay every token). A new
matcher is a copy of its grammar's unused template (~3 us; building one ~200 us). `start`
computes a step's masks on the bank's one worker thread (llguidance drops the GIL while it
builds a matcher or computes a mask), so the engine starts them before the step's forward and
the sampler waits for them after it; the jobs run in order, one at a time, so a matcher is never
touched by two threads. Masks cost ~5-60 us a row on a 49k vocabulary (SmolLM2, AMD EPYC dev
VM); llguidance is a Rust crate as well, which the Rust service can use directly.

llguidance is chosen over xgrammar (torch- and transformers-pinned wheels, no Rust API) and
outlines-core (slower to compile large schemas): one `abi3` wheel, no torch dependency, and
the same engine in Python and Rust.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

KINDS = ("json_object", "json_schema", "grammar", "regex", "choice")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
MAX_GRAMMARS = 256
IDLE_CALLS = 4096  # `allowed` calls after which a matcher nobody asked for is dropped


@dataclass(frozen=True)
class ResponseFormat:
    """A validated `response_format`: its kind and what it constrains to (the JSON schema's
    text, or a llguidance lark grammar)."""

    kind: Literal["json_object", "json_schema", "grammar", "regex", "choice"]
    # the schema's JSON text, keys in the order given (the grammar emits properties in that
    # order: never sorted); the lark grammar for kind "grammar"; the pattern for "regex"; the
    # choices as a JSON list for "choice"
    schema: str

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | ResponseFormat) -> ResponseFormat | None:
        """None for `{"type": "text"}`; ValueError naming the field for anything invalid."""
        if isinstance(raw, ResponseFormat):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"response_format must be an object, got {type(raw).__name__}")
        kind = raw.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", JSON_OBJECT_SCHEMA)
        if kind == "grammar":
            return cls.lark(raw.get("grammar"))
        if kind == "regex":
            return cls.regex(raw.get("regex"))
        if kind == "choice":
            return cls.choice(raw.get("choice"))
        if kind != "json_schema":
            raise ValueError(
                "response_format.type must be one of text, json_object, json_schema, regex, "
                f"choice; got {kind!r}"
            )
        spec = raw.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema")
        if not isinstance(schema, Mapping | bool):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        text = json.dumps(schema)  # the same schema, the same text: the bank's cache key
        fmt = cls("json_schema", text)
        fmt.check()
        return fmt

    @classmethod
    def lark(cls, grammar: Any) -> ResponseFormat:
        """A llguidance lark grammar (it may embed JSON schemas with `%json {...}`), checked."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("response_format.grammar must be a non-empty lark grammar")
        fmt = cls("grammar", grammar)
        fmt.check()
        return fmt

    @classmethod
    def regex(cls, pattern: Any) -> ResponseFormat:
        """The whole output fullmatches `pattern` (llguidance's syntax: Rust's `regex` crate,
        no look-around or back-references), checked."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format.regex must be a non-empty string (a regex)")
        fmt = cls("regex", pattern)
        fmt.check()
        return fmt

    @classmethod
    def choice(cls, choices: Any) -> ResponseFormat:
        """The whole output is exactly one of `choices` (non-empty strings)."""
        if not isinstance(choices, list) or not choices:
            raise ValueError("response_format.choice must be a non-empty list of strings")
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise ValueError(f"response_format.choice[{i}] must be a non-empty string")
        fmt = cls("choice", json.dumps(choices))
        fmt.check()
        return fmt

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-shaped mapping that `parse` reads back (what travels on the wire)."""
        if self.kind == "grammar":
            return {"type": "grammar", "grammar": self.schema}
        if self.kind == "regex":
            return {"type": "regex", "regex": self.schema}
        if self.kind == "choice":
            return {"type": "choice", "choice": json.loads(self.schema)}
        if self.kind == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"schema": json.loads(self.schema)}}

    def grammar(self) -> str:
        import llguidance

        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.schema)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.schema)
        if self.kind == "choice":  # lark string literals are JSON strings
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.schema))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_json_schema(
            self.schema, defaults={"whitespace_flexible": False}
        )

    def check(self) -> None:
        """The schema or grammar compiles (without a tokenizer): else a ValueError with
        llguidance's reason."""
        import llguidance

        try:
            message = llguidance.LLMatcher.validate_grammar(self.grammar())  # "" when valid
        except (ValueError, TypeError, RuntimeError) as exc:
            message = str(exc) or type(exc).__name__
        if message:
            what = {
                "grammar": "grammar: invalid grammar",
                "regex": "regex: invalid regex",
                "choice": "choice: invalid choices",
            }.get(self.kind, "json_schema: unsupported schema")
            raise ValueError(f"response_format.{what}: {' '.join(message.split())}")


class ConstrainedRow(Protocol):
    """What the bank reads of a sampled row (`Req`, `SampleView`, the service worker's
    `WorkerReq`). A speculative verify row (`SampleView`) also has `drafts`: how many of its
    last outputs are drafts, not yet the request's; a row without it has none."""

    input_ids: np.ndarray

    @property
    def output_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class BankStats:
    """What a bank has done: mask batches computed, rows masked, matchers built, tokens its
    matchers consumed."""

    masks: int = 0
    rows: int = 0
    matchers: int = 0
    tokens: int = 0


class MaskJob:
    """The allowed tokens of one step's constrained rows, being computed on the bank's worker
    thread; `result()` waits for them."""

    def __init__(self, future: Future[np.ndarray]) -> None:
        self._future = future
        self.collected = False

    def result(self) -> np.ndarray:
        """bool [rows, vocab]: True where a row may not sample the token next."""
        self.collected = True
        return self._future.result()


def _common_prefix(done: list[int], outputs: Sequence[int]) -> int:
    """How many leading tokens `done` and `outputs` share (all of `done` in the usual case:
    the outputs extend what was consumed)."""
    if len(outputs) >= len(done) and (not done or int(outputs[len(done) - 1]) == done[-1]):
        return len(done)
    n = min(len(done), len(outputs))
    differ = np.flatnonzero(np.asarray(done[:n]) != np.asarray(outputs[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


@dataclass
class _State:
    matcher: Any  # llguidance.LLMatcher
    consumed: list[int] = field(default_factory=list)
    error: str | None = None
    seen: int = 0  # the bank's call count when it was last asked for


class GrammarBank:
    """Matchers of the constrained requests of one model (its tokenizer, its vocab size)."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path = str(model_path)
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._states: dict[tuple[str, int, str, str], _State] = {}
        self._calls = 0
        # a never-advanced matcher of each grammar, the newest MAX_GRAMMARS: copied for a request
        self._templates: dict[tuple[str, str], Any] = {}
        self._counts = {"masks": 0, "rows": 0, "matchers": 0, "tokens": 0}
        self._worker: ThreadPoolExecutor | None = None
        self._last: MaskJob | None = None

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.model_path)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
        return self._tokenizer

    def _state(self, row: ConstrainedRow, fmt: ResponseFormat) -> _State:
        rid = getattr(row, "rid", None)
        owner = ("rid", rid) if isinstance(rid, int) else ("ids", id(row.input_ids))
        key = (*owner, fmt.kind, fmt.schema)  # a reused rid with another format: a new matcher
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _State(self._template(fmt).deep_copy())
            self._counts["matchers"] += 1
            if owner[0] == "ids":
                weakref.finalize(row.input_ids, self._states.pop, key, None)
        state.seen = self._calls
        return state

    def _template(self, fmt: ResponseFormat) -> Any:
        key = (fmt.kind, fmt.schema)
        template = self._templates.get(key)
        if template is None:
            import llguidance

            if len(self._templates) >= MAX_GRAMMARS:  # each tool set is its own grammar
                del self._templates[next(iter(self._templates))]
            template = llguidance.LLMatcher(self._lltokenizer(), fmt.grammar())
            self._templates[key] = template
        return template

    def _evict_idle(self) -> None:
        self._calls += 1
        if self._calls % 256:
            return
        stale = [k for k, st in self._states.items() if self._calls - st.seen > IDLE_CALLS]
        for k in stale:
            del self._states[k]

    def _catch_up(self, state: _State, outputs: Sequence[int], drafts: int) -> bool:
        """Feed the matcher the row's outputs it has not consumed, first rolling it back past
        tokens the outputs no longer hold (a verify step's drafts it did not keep). A rejected
        output fails the row (`state.error`); a rejected draft stops the feed there and
        returns False: the row is past it, its token never kept (it cannot equal a draw the
        grammar masks), so it may sample anything."""
        done = state.consumed
        keep = _common_prefix(done, outputs)
        if keep < len(done):
            if state.error is None:
                state.matcher.rollback(len(done) - keep)
                del done[keep:]
            else:  # a failed row's matcher stopped at its error: start it again
                state.matcher.reset()
                done.clear()
                state.error = None
        own = len(outputs) - drafts
        for i in range(len(done), len(outputs)):
            token = int(outputs[i])
            if state.error is None and not state.matcher.try_consume_tokens([token]):
                if i >= own:
                    return False
                state.error = f"the grammar rejected token {token}"
            done.append(token)
            self._counts["tokens"] += 1
        return True

    def start(self, rows: Sequence[ConstrainedRow], formats: Sequence[ResponseFormat]) -> MaskJob:
        """Start computing the tokens each row may not sample next, on the worker thread (each
        matcher first consumes the row's outputs it has not seen): the rows' outputs must not
        change until the job's `result()`."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="minisgl-grammar")
        job = MaskJob(self._worker.submit(self._allowed, list(rows), list(formats)))
        self._last = job
        return job

    def allowed(
        self, rows: Sequence[ConstrainedRow], formats: Sequence[ResponseFormat]
    ) -> np.ndarray:
        """bool [len(rows), vocab]: the tokens each row may sample next."""
        return ~self.start(rows, formats).result()

    @property
    def busy(self) -> bool:
        """A job was started and its result not yet asked for."""
        return self._last is not None and not self._last.collected

    def stats(self) -> BankStats:
        return BankStats(**self._counts)

    def close(self) -> None:
        """Stop the worker thread (after the job it runs); a later `start` starts another."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _allowed(self, rows: list[ConstrainedRow], formats: list[ResponseFormat]) -> np.ndarray:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self._evict_idle()
        masks = allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (row, fmt) in enumerate(zip(rows, formats, strict=True)):
            state = self._state(row, fmt)
            if not self._catch_up(state, row.output_ids, getattr(row, "drafts", 0)):
                masks[i] = -1  # past a rejected draft: anything (its token is never kept)
            elif state.error is None and not state.matcher.is_error():
                fill_next_token_bitmask(state.matcher, masks, i)
            else:
                masks[i] = 0  # nothing allowed: the sampler fails this row alone
        self._counts["masks"] += 1
        self._counts["rows"] += len(rows)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        return bits == 0  # what the sampler fills with -inf

    @property
    def live(self) -> int:
        """Matchers held (one per constrained request alive)."""
        return len(self._states)
