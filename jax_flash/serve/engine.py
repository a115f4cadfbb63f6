"""`Engine`: continuous batching of requests over a paged KV cache.

Every :meth:`Engine.step` plans one device step on the host (`Scheduler`), dispatches it (one
jitted call: the model over the step's packed decode tokens and prompt chunks, `jax_flash.nn.
Mixed`, then one token drawn per row), and only then reads the tokens of the step before. So
the device runs step ``k + 1`` while the host reads step ``k``'s tokens, checks stop tokens and
plans: a decode row feeds its previous token straight from the previous step's output on the
device. A request that stops at step ``k`` has already been given a row in step ``k + 1``;
that row's token is dropped. With ``decode_steps`` > 1, a dispatch without prompt chunks runs
several decode steps in one device loop (`run_decode_steps`), so that the host's share of
a step is paid once for several tokens.

Shapes are static: decode rows and chunk rows are padded to buckets (powers of two up to
``max_batch`` / ``max_prefill_rows``), chunks to ``prefill_chunk`` places, block tables to the
pages of ``max_seq_len`` tokens, and every step's output to ``max_batch + max_prefill_rows``
rows; so a run compiles at most two executables per (decode bucket, chunk bucket) pair: one
for steps whose rows are all greedy (argmax) and one that samples (and, with ``decode_steps`` >
1, two more per decode bucket for the decode loop).

A tensor-parallel model (`jax_flash.models.shard_model`) is served as it is: the engine reads
its layout (``model.parallel``) and keeps every array it creates on the model's mesh, the cache
pools split by KV heads (as the model's ``init_cache`` builds them) and everything else (packed
step inputs, the previous step's tokens, copy-on-write page ids) replicated; the step and the
page copy pin their outputs to the same layouts, so the donated pools stay split from step to
step and no step gathers them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..nn import MIN_DECODE_ROWS
from .device_step import (
    FLOAT_FIELDS,
    StepShape,
    copy_cache_pages,
    model_static,
    place_like_step,
    run_decode_steps,
    run_step,
)
from .pages import PagePool
from .request import Request, SamplingParams, Status
from .scheduler import DECODE_STEPS, RESERVE_TOKENS, Scheduler, StepPlan


@dataclasses.dataclass
class StepOutput:
    """What one :meth:`Engine.step` read back: the tokens each request produced (in order;
    a finished request's last token is its stop token, if one stopped it) and the ids of the
    requests that finished, with why ("stop", "length" or "abort")."""

    tokens: dict[int, list[int]]
    finished: dict[int, str]


def _buckets(limit: int) -> list[int]:
    out = [0]
    while out[-1] < limit:
        out.append(min(limit, max(1, 2 * out[-1])))
    return out


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


class Engine:
    """Serve generation requests with continuous batching over a paged KV cache.

    Parameters
    ----------
    model : a :class:`jax_flash.models.LlamaForCausalLM` (any decoder with ``forward``,
        ``logits``, ``init_cache`` and ``config``); its ``attention_impl`` picks the kernels.
        A model placed tensor-parallel by :func:`jax_flash.models.shard_model` is served over
        its mesh (detected from ``model.parallel``; see the module docstring).
    num_pages, page_size : the cache: ``num_pages`` pages of ``page_size`` tokens (page 0 is
        the null page). A request whose prompt and output cannot fit alone is refused.
    max_batch : decode rows per step (and requests running at once).
    max_prefill_rows, prefill_chunk : prompt chunks per step, and tokens per chunk.
    reserve_tokens : admission's reserve (default 32): a request is admitted only while the
        pool can also hold the next ``reserve_tokens`` tokens of every running request, itself
        included (`Scheduler`). 0 admits on the known tokens alone, which fills the pool to its
        last page and preempts as soon as its requests grow; requests that grow past their
        reserves are still preempted when the pool runs dry.
    decode_steps : decode steps one dispatch may run (default 4; 1 for one token a step). A
        step that has no prompt chunk to feed runs up to this many decode steps on the device
        in one call (each row as many as its request may still draw, the pages for them taken
        at once; one step when the pool cannot hold them), and the host reads their tokens
        together:
        the host's planning, packing and dispatch are paid once for several tokens, the
        tokens of a request arrive in bursts, and a request that stops early has its further
        tokens of the burst dropped. A waiting request is admitted at the next dispatch.
    max_seq_len : the longest prompt + output (default the model's
        ``max_position_embeddings``, at most what the pool holds).
    decode_buckets : decode-row counts a step is padded to (default powers of two from 2 up to
        ``max_batch``: a lone decode row runs beside a padding row, `jax_flash.nn.
        MIN_DECODE_ROWS`; ``max_batch`` is always one). Fewer buckets, fewer compilations:
        padded decode rows cost little where a step reads the weights anyway.

    ``step()`` returns the tokens of the step dispatched by the previous call (see the module
    docstring), so a request's first token shows one call after the step that drew it.

    Examples
    --------
    >>> from jax_flash.models import LlamaConfig, LlamaForCausalLM
    >>> from jax_flash.serve import Engine, SamplingParams
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=1, num_attention_heads=2)
    >>> engine = Engine(LlamaForCausalLM.random(cfg), num_pages=16, page_size=4, max_batch=2)
    >>> outs = engine.run([dict(prompt_tokens=[1, 2, 3], max_new_tokens=3),
    ...                    dict(prompt_tokens=[4, 5], max_new_tokens=2,
    ...                         sampling=SamplingParams(temperature=0.8, seed=1))])
    >>> [len(t) for t in outs]
    [3, 2]
    """

    def __init__(
        self,
        model,
        *,
        num_pages: int = 256,
        page_size: int = 16,
        max_batch: int = 8,
        max_prefill_rows: int = 1,
        prefill_chunk: int = 64,
        max_seq_len: int | None = None,
        decode_buckets: Sequence[int] | None = None,
        reserve_tokens: int = RESERVE_TOKENS,
        decode_steps: int = DECODE_STEPS,
    ):
        for name, v in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_batch", max_batch),
            ("max_prefill_rows", max_prefill_rows),
            ("prefill_chunk", prefill_chunk),
        ):
            if not isinstance(v, (int, np.integer)) or v < (2 if name == "num_pages" else 1):
                raise ValueError(f"Engine: {name} must be an int >= 1 (num_pages >= 2), got {v!r}")
        if not isinstance(reserve_tokens, (int, np.integer)) or reserve_tokens < 0:
            raise ValueError(f"Engine: reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
        if not isinstance(decode_steps, (int, np.integer)) or decode_steps < 1:
            raise ValueError(f"Engine: decode_steps must be an int >= 1, got {decode_steps!r}")
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.page_size = P = int(page_size)
        limit = (num_pages - 1) * P
        default = getattr(model.config, "max_position_embeddings", limit)
        self.max_seq_len = min(limit, default) if max_seq_len is None else int(max_seq_len)
        if not 1 <= self.max_seq_len <= limit:
            raise ValueError(
                f"Engine: max_seq_len must be in [1, {limit}] ((num_pages - 1) * page_size), "
                f"got {max_seq_len}"
            )
        self.pool = PagePool(int(num_pages))
        self.scheduler = Scheduler(
            self.pool,
            P,
            max_batch=int(max_batch),
            max_prefill_rows=int(max_prefill_rows),
            prefill_chunk=int(prefill_chunk),
            reserve_tokens=int(reserve_tokens),
            decode_steps=int(decode_steps),
        )
        # No bucket below nn.MIN_DECODE_ROWS: a lone decode row runs beside a padding row.
        floor = min(MIN_DECODE_ROWS, int(max_batch))
        self._decode_buckets = [b for b in _buckets(int(max_batch)) if b == 0 or b >= floor]
        if decode_buckets is not None:
            if not all(
                isinstance(b, (int, np.integer)) and 0 < b <= max_batch for b in decode_buckets
            ):
                raise ValueError(
                    f"Engine: decode_buckets must be ints in [1, max_batch={max_batch}], got "
                    f"{decode_buckets!r}"
                )
            self._decode_buckets = sorted({0, int(max_batch), *map(int, decode_buckets)})
        self._chunk_buckets = _buckets(int(max_prefill_rows))
        self._max_pages = -(-self.max_seq_len // P)
        self._out_rows = int(max_batch) + int(max_prefill_rows)
        graphdef, state = nnx.split(model)
        self._params, state_def = jax.tree.flatten(state)
        self._model_static = model_static(graphdef, state_def)
        # The tensor-parallel layout of a sharded model (None: one device). The pools come
        # from the model's init_cache, split by KV heads on its mesh when it has one.
        self.parallel = getattr(model, "parallel", None)
        cache = model.init_cache(int(num_pages), P, np.zeros((1, 1), np.int32))
        self._kv = cache.layers()
        self._previous = self._to_device(np.full((self._out_rows,), -1, np.int32))
        if self.parallel is not None:
            self._previous, self._kv = place_like_step(self.parallel, self._previous, self._kv)
        # The step dispatched last: its plan, its output and the output row of each plan row.
        self._in_flight: tuple[StepPlan, jax.Array, list[int]] | None = None
        self._requests: dict[int, Request] = {}
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_tokens: Iterable[int] = (),
    ) -> int:
        """Queue a request; returns its id. It generates up to ``max_new_tokens`` tokens and
        stops early after any of ``stop_tokens`` (kept as its last token)."""
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise ValueError("Engine.add_request: prompt_tokens must hold at least one token")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(
                f"Engine.add_request: prompt_tokens must lie in [0, {self.vocab_size})"
            )
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(
                f"Engine.add_request: max_new_tokens must be an int >= 1, got {max_new_tokens!r}"
            )
        if len(prompt) + max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(
                f"Engine.add_request: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens})"
                f" - 1 tokens exceed max_seq_len {self.max_seq_len}"
            )
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(
                f"Engine.add_request: sampling must be SamplingParams, got {sampling!r}"
            )
        request = Request(
            id=self._next_id,
            prompt=prompt,
            max_new_tokens=int(max_new_tokens),
            stop_tokens=frozenset(int(t) for t in stop_tokens),
            sampling=sampling,
            arrival_s=time.perf_counter(),
        )
        self._next_id += 1
        self._requests[request.id] = request
        self.scheduler.add(request)
        return request.id

    def abort(self, request_id: int) -> None:
        """Stop a request now (its pages are released); unknown or finished ids are ignored."""
        self._end(request_id, "abort")

    def stop(self, request_id: int) -> None:
        """End a request now as stopped (finish reason "stop"), for a stop condition the engine
        does not check itself, such as a stop string in its text: its pages are released and
        no later step gives it a row (a token the step in flight draws for it is dropped).
        Unknown or finished ids are ignored."""
        self._end(request_id, "stop")

    def _end(self, request_id: int, reason: str) -> None:
        r = self._requests.get(request_id)
        if r is not None and r.status is not Status.FINISHED:
            self.scheduler.finish(r, reason)

    def request(self, request_id: int) -> Request:
        return self._requests[request_id]

    def forget(self, request_id: int) -> None:
        """Drop a finished request's record (a server calls this once it has sent the
        tokens, so that records do not pile up)."""
        r = self._requests.get(request_id)
        if r is not None and r.status is Status.FINISHED:
            del self._requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def stats(self):
        return self.scheduler.stats

    # -- steps ------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Dispatch the next device step (if there is work), then read the previous one's
        tokens: stop checks, finished requests' pages released."""
        previous = self._in_flight
        rows = {}
        if previous is not None:
            plan, _, out_rows = previous
            rows = {r.id: i for r, i in zip(plan.draws, out_rows, strict=True) if r is not None}
        plan = self.scheduler.schedule(rows)
        self._in_flight = None if plan is None else (plan, *self._dispatch(plan))
        return self._read(previous)

    def run(self, requests: Iterable[Mapping]) -> list[list[int]]:
        """Add ``requests`` (each a dict of :meth:`add_request`'s arguments) and step until
        all of them finish; returns their tokens, in order."""
        ids = [self.add_request(**r) for r in requests]
        while any(self._requests[i].status is not Status.FINISHED for i in ids):
            self.step()
        return [self._requests[i].output for i in ids]

    def warmup(self, sampling: bool = True) -> float:
        """Compile the step of every bucket pair now, greedy and (with ``sampling``) sampling
        variants (steps of padding rows only: nothing is written); returns the seconds."""
        t0 = time.perf_counter()
        empty = StepPlan([], [], [])
        steps = self.scheduler.decode_steps
        for d in self._decode_buckets:
            for c in self._chunk_buckets:
                for greedy in (True, False) if sampling else (True,):
                    if d or c:
                        out, self._kv = self._call(self._shape(d, c, greedy), empty)
                    if d and not c and steps > 1:
                        out, _, self._kv = self._call(self._shape(d, c, greedy, steps), empty)
        jax.block_until_ready(self._kv)
        return time.perf_counter() - t0

    def _shape(self, num_decode: int, num_chunks: int, greedy: bool, steps: int = 1) -> StepShape:
        return StepShape(
            _bucket(num_decode, self._decode_buckets),
            _bucket(num_chunks, self._chunk_buckets),
            self.scheduler.prefill_chunk,
            self._max_pages,
            self._out_rows,
            greedy,
            steps,
            self.page_size if steps > 1 else 0,
        )

    def _to_device(self, host: np.ndarray) -> jax.Array:
        """A host array on the device, or replicated over a tensor-parallel model's mesh."""
        if self.parallel is None:
            return jnp.asarray(host)
        # P(), not P(None, ...): one spelling for every step, so no step compiles twice.
        return jax.device_put(host, NamedSharding(self.parallel.mesh, PartitionSpec()))

    def _step_args(self, shape: StepShape, plan: StepPlan) -> tuple:
        """The arguments of `run_step` for ``plan`` padded to ``shape``."""
        ints, floats = self._pack(shape, plan)
        if self.parallel is not None:  # else jit's own transfer, as fast for one device
            ints, floats = self._to_device(ints), self._to_device(floats)
        return (
            self._model_static,
            shape,
            self._params,
            self._kv,
            self._previous,
            ints,
            floats,
        )

    def _call(self, shape: StepShape, plan: StepPlan):
        """The step's outputs: (tokens, pools), or with ``shape.steps > 1`` (each row's last
        token, every step's tokens, pools)."""
        step = run_step if shape.steps == 1 else run_decode_steps
        return step(*self._step_args(shape, plan))

    def _dispatch(self, plan: StepPlan) -> tuple[jax.Array, list[int]]:
        """Dispatch ``plan``; returns the tokens the host reads (``[out_rows]``, or
        ``[steps, out_rows]`` for several steps) and each plan row's output row."""
        if plan.copies:  # copy-on-write of partly shared prefix pages, before the step
            pairs = np.full((2, self.scheduler.max_batch), -1, np.int32)
            pairs[:, : len(plan.copies)] = np.asarray(plan.copies, np.int32).T
            impl = getattr(self.model, "attention_impl", None)
            src, dst = self._to_device(pairs[0]), self._to_device(pairs[1])
            self._kv = copy_cache_pages(impl, self.parallel, self._kv, src, dst)
        greedy = all(r.sampling.greedy for r in plan.draws if r is not None)
        steps = self.scheduler.decode_steps if plan.steps > 1 else 1  # the compiled bound
        shape = self._shape(len(plan.decode), len(plan.chunks), greedy, steps)
        if plan.steps == 1:
            out, self._kv = self._call(shape, plan)
            self._previous = out
        else:  # the host reads every step's tokens; the next dispatch feeds the last ones
            self._previous, out, self._kv = self._call(shape, plan)
        # The drawn tokens start for the host as soon as the step ends, so that `_read` finds
        # them there instead of starting the copy itself. Measured on an H200 (the 1.24B model,
        # the uniform serving trace, max_batch 48; four alternating rounds in one process):
        # 3776-4338 -> 4219-4776 tokens/s, time between tokens p50 3.0-3.5 -> 2.3-3.1 ms.
        out.copy_to_host_async()
        d = shape.num_decode
        out_rows = list(range(len(plan.decode))) + [d + j for j in range(len(plan.chunks))]
        return out, out_rows

    def _pack(self, shape: StepShape, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """The step's int32 and float32 inputs (`StepShape.int_fields`, `FLOAT_FIELDS`)."""
        P, M = self.page_size, self._max_pages
        T, R, d, C = shape.tokens, shape.rows, shape.num_decode, shape.chunk
        tokens = np.zeros(T, np.int32)
        source = np.full(d, -1, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        tables = np.zeros((R, M), np.int32)
        kv_lens = np.zeros(R, np.int32)
        top_k, seeds, index = (np.zeros(R, np.int32) for _ in range(3))
        # Named as FLOAT_FIELDS names them (SamplingParams' attributes); top_p 1 on padding rows.
        floats = {name: np.zeros(R, np.float32) for name in FLOAT_FIELDS}
        floats["top_p"][:] = 1.0

        def row_fields(row, r, kv_len, draw_index):
            """The row's block table, cache length after the step, and sampling parameters
            for its token number ``draw_index``."""
            tables[row, : len(r.pages)] = r.pages
            kv_lens[row] = kv_len
            s = r.sampling
            top_k[row], seeds[row], index[row] = s.top_k, s.seed, draw_index
            for name, values in floats.items():
                values[row] = getattr(s, name)

        counts = plan.counts or [1] * len(plan.decode)
        for i, ((r, src), n) in enumerate(zip(plan.decode, counts, strict=True)):
            # The scheduler counted the row's n tokens as cached and pending: it feeds
            # positions start .. start + n - 1 and draws tokens index .. index + n - 1. Plain
            # scalars, not arrays: a step packs up to max_batch of these rows.
            start = r.num_cached - n
            positions[i] = start
            slots[i] = r.pages[start // P] * P + start % P
            row_fields(i, r, start + 1, len(r.output) + r.pending - n)
            if src >= 0:
                source[i] = src
            else:
                tokens[i] = r.token(start)
        for j, (r, start, n) in enumerate(plan.chunks):
            places = d + j * C + C - n + np.arange(n)
            end = start + n  # prompt tokens (a recomputed request's outputs come after)
            tokens[places] = (
                r.prompt[start:end]
                if end <= len(r.prompt)
                else [r.token(t) for t in range(start, end)]
            )
            pos = np.arange(start, end)
            positions[places] = pos
            slots[places] = np.asarray(r.pages, np.int32)[pos // P] * P + pos % P
            row_fields(d + j, r, end, len(r.output) + r.pending - 1)
        fields = dict(tokens=tokens, source=source, positions=positions, slots=slots,
                      block_tables=tables.ravel(), kv_lens=kv_lens, top_k=top_k, seeds=seeds,
                      index=index)  # fmt: skip
        if shape.steps > 1:
            fields["counts"] = np.zeros(d, np.int32)
            fields["counts"][: len(counts)] = counts
        # In the order (and sizes) unpack_inputs reads them on the device.
        ints = np.concatenate([fields[name] for name, _ in shape.int_fields()])
        return ints, np.concatenate([floats[name] for name in FLOAT_FIELDS])

    def _read(self, step) -> StepOutput:
        result = StepOutput({}, {})
        if step is None:
            return result
        plan, out, out_rows = step
        drawn = np.asarray(out)  # waits for that step (the next one is already queued)
        now = time.perf_counter()
        if plan.steps == 1:
            drawn = drawn[None]
        counts = plan.counts or [1] * len(plan.draws)
        for r, i, n in zip(plan.draws, out_rows, counts, strict=True):
            if r is None:
                continue
            for t in range(n):
                r.pending -= 1
                if r.status is Status.FINISHED:
                    continue  # stopped before this token; its row ran before that was known
                token = int(drawn[t, i])
                r.output.append(token)
                r.token_times_s.append(now)
                result.tokens.setdefault(r.id, []).append(token)
                if token in r.stop_tokens or len(r.output) >= r.max_new_tokens:
                    reason = "stop" if token in r.stop_tokens else "length"
                    self.scheduler.finish(r, reason)
                    result.finished[r.id] = reason
        return result
