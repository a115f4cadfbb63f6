"""`Scheduler`: which requests run in the next device step, and the pages they hold.

Each step has up to ``max_batch`` decode rows (a request with one token to feed: its last
drawn token, or the last token of a prompt) and up to ``max_prefill_rows`` chunk rows of up to
``prefill_chunk`` prompt tokens (chunked prefill), so a step's token budget is
``max_batch + max_prefill_rows * prefill_chunk``. A step with decode rows only may run up to
``decode_steps`` decode steps in one dispatch, each row as many as its request may still draw,
when the pool can hold the pages of all those tokens now (else one).

Pages: a request is admitted (first come, first served) only when the pool can hold all its
known tokens, less the full prompt pages it shares with earlier requests (prefix sharing; a
partly shared page is copied, copy-on-write, and its shared tokens not computed again), and
also every running request's reserve, its own included: the pages it takes for its next
``reserve_tokens`` tokens (none past its last token). A reserve is counted, not handed out:
it holds admission back, so that the requests running together have room to grow before one
of them must be preempted. While decoding a request takes one more page whenever its next
token starts one. When none is left (requests grow past their reserves), the most recently
admitted running request is preempted: its pages are released and it waits at the head of the
queue, to be fed again from its first token (recompute). Running requests are never touched
by another's allocation, so preemption never corrupts them; the oldest request can always
run, because a request that cannot fit the pool alone is refused (a reserve stops at the
request's last token, so alone it fits with its reserve too).
"""

from __future__ import annotations

import collections
import dataclasses

from .pages import PagePool, prefix_hashes
from .request import Request, Status

# The default reserve: in tools/serve_sim.py, on the serving benchmark's traces (pages of 16
# tokens), 16-32 tokens gave the best throughput and 32 the fewest preemptions among them (most
# of them gone); reserves of 64 and more hold back requests that the pool could run
# (docs/serving.md).
RESERVE_TOKENS = 32

# The default decode steps a dispatch may run: on an H200 (the 1.24B model, the uniform trace,
# max_batch 48; alternating rounds in one process) 4 steps took 7500 -> 8010 tokens/s and each
# request's time per output token p50 1.62 -> 1.46 ms against one step: the host's planning,
# packing and dispatch paid once for up to 4 tokens, and a 48-row step costs 1.28 ms in the loop
# against 1.36 alone (docs/serving.md).
DECODE_STEPS = 4


@dataclasses.dataclass
class StepPlan:
    """One device step. ``decode``: ``(request, source)`` per decode row, where ``source`` is
    the output row of the previous step that drew the token to feed (-1: a token the host
    knows); ``chunks``: ``(request, start, count)`` per chunk row. ``draws[i]``: the request
    whose next token row ``i`` (decode rows, then chunk rows) draws, or None. ``copies``:
    pages to copy before the step (copy-on-write of a shared partial prefix page)."""

    decode: list[tuple[Request, int]]
    chunks: list[tuple[Request, int, int]]
    draws: list[Request | None]
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) pages
    # Decode steps the device runs in this one dispatch (no chunk rows then), and how many of
    # them each decode row takes (the rest of its steps neither write the cache nor count).
    steps: int = 1
    counts: list[int] = dataclasses.field(default_factory=list)  # per decode row; [] = all 1


@dataclasses.dataclass
class SchedulerStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0  # tokens fed in chunk rows
    prompt_tokens_computed: int = 0  # prompt positions fed (rows of either kind)
    prefix_hit_tokens: int = 0  # prompt tokens found in shared pages, not fed
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        *,
        max_batch: int,
        max_prefill_rows: int,
        prefill_chunk: int,
        reserve_tokens: int = RESERVE_TOKENS,
        decode_steps: int = DECODE_STEPS,
    ):
        if reserve_tokens < 0:
            raise ValueError(f"Scheduler: reserve_tokens must be >= 0, got {reserve_tokens}")
        if decode_steps < 1:
            raise ValueError(f"Scheduler: decode_steps must be >= 1, got {decode_steps}")
        self.pool = pool
        self.page_size = page_size
        self.max_batch = max_batch
        self.max_prefill_rows = max_prefill_rows
        self.prefill_chunk = prefill_chunk
        self.reserve_tokens = reserve_tokens
        self.decode_steps = decode_steps
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.stats = SchedulerStats()
        self._hashes: dict[int, list[int]] = {}  # request id -> its prompt's full-page hashes

    def add(self, request: Request) -> None:
        P = self.page_size
        self._hashes[request.id] = prefix_hashes(request.prompt, P, len(request.prompt) // P)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Release a request's pages and forget it (the device may still write the slot of a
        step dispatched before this call: it runs before any step that reuses the page)."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.pool.release(request.pages)
        request.pages = []
        request.status = Status.FINISHED
        request.finish_reason = reason
        self._hashes.pop(request.id, None)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.pages)
        request.pages, request.num_cached = [], 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _grow(self) -> None:
        """A page for each decoding request whose next token starts one, preempting the most
        recently admitted request while none is left."""
        P = self.page_size
        for r in list(self.running):
            if r.status is not Status.RUNNING or r.to_feed != 1 or not r.may_draw:
                continue
            while r.num_cached // P >= len(r.pages):
                got = self.pool.allocate(1)
                if got is not None:
                    r.pages += got
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break

    def _reserve(self, r: Request, held: int) -> int:
        """Pages that ``r``, holding ``held``, still needs for its next ``reserve_tokens``
        tokens: it caches at most ``len(prompt) + max_new_tokens - 1`` tokens (its last drawn
        token is never fed), so a request near its end reserves less."""
        if not self.reserve_tokens:
            return 0
        last = len(r.prompt) + r.max_new_tokens - 1
        want = -(-min(r.num_tokens + self.reserve_tokens, last) // self.page_size)
        return max(0, want - held)

    def _admit(self, copies: list[tuple[int, int]]) -> None:
        P, pool = self.page_size, self.pool
        reserved = sum(self._reserve(r, len(r.pages)) for r in self.running)
        for r in list(self.waiting):
            if len(self.running) >= self.max_batch or r.pending:
                break  # a preempted request waits for its in-flight token first
            # Share whole pages of the prompt, but feed at least one token (its logits draw).
            hashes = self._hashes[r.id]
            cap = r.num_tokens - 1
            found = pool.lookup(hashes)
            shared = found[: cap // P]
            if not all(pool.is_written(p) for p in found[: len(shared) + 1]):
                continue  # an earlier request is prefilling this prefix: wait, don't repeat it
            k = len(shared)
            source, run = self._copy_source(r, found, k, cap - k * P)
            need = -(-r.num_tokens // P) - k
            revived = sum(pool.refs(p) == 0 for p in shared + [source][:run])
            reserve = self._reserve(r, k + need)
            if run and not self.running and need + reserve > pool.num_available - revived:
                # Alone a request must fit, or it waits forever: a cached page to copy is held
                # beside its copy, one page more than the request keeps, so feed its tokens.
                run = 0
                revived = sum(pool.refs(p) == 0 for p in shared)
            if need + reserve + reserved > pool.num_available - revived:
                break
            reserved += reserve
            pool.share(shared + [source][:run])  # the source stays put while pages are taken
            r.pages = shared + pool.allocate(need)
            if run:
                pool.release([source])
                copies.append((source, r.pages[k]))
            for j in range(k, len(hashes)):
                pool.register(r.pages[j], hashes[j])
            r.num_cached = k * P + run
            r.status = Status.RUNNING
            self.waiting.remove(r)
            self.running.append(r)
            self.stats.prefix_hit_tokens += min(r.num_cached, len(r.prompt))

    def _copy_source(self, r: Request, found, k: int, limit: int) -> tuple[int, int]:
        """A written page whose first tokens continue ``r``'s prompt after its ``k`` shared
        pages, to copy rather than compute: the next full prompt page when only the one-token
        rule kept it from being shared, else the page at that place of another prompt with the
        same first ``k`` pages that starts with the most of ``r``'s next tokens. ``(page,
        tokens)``, ``(0, 0)`` for none; at most ``limit`` tokens."""
        P, pool = self.page_size, self.pool
        if limit <= 0:
            return 0, 0
        if len(found) > k:  # written: checked by the caller
            return found[k], min(P, limit)
        parent = self._hashes[r.id][k - 1] if k else None
        page, run = pool.lookup_partial(parent, r.prompt[k * P : k * P + limit])
        return page, min(run, limit)

    def _fed(self, r: Request, count: int) -> None:
        P, n = self.page_size, len(r.prompt)
        start = r.num_cached
        self.stats.prompt_tokens_computed += max(0, min(n, start + count) - start)
        r.num_cached += count
        for j in range(start // P, r.num_cached // P):
            self.pool.mark_written(r.pages[j])
        # Index each prompt page whose prompt tokens are now written, for copy-on-write.
        for j in range(start // P, -(-min(n, r.num_cached) // P)):
            end = min((j + 1) * P, n)
            if start < end <= r.num_cached:
                parent = self._hashes[r.id][j - 1] if j else None
                self.pool.register_partial(r.pages[j], parent, r.prompt[j * P : end])

    def schedule(self, previous_rows: dict[int, int]) -> StepPlan | None:
        """The next step (None: nothing to run), its bookkeeping applied as if dispatched.
        ``previous_rows``: request id -> the previous step's output row that drew its pending
        token."""
        self._grow()
        copies: list[tuple[int, int]] = []
        self._admit(copies)
        decode, chunks, draws = [], [], []
        for r in self.running:
            if r.to_feed == 1 and r.may_draw and len(decode) < self.max_batch:
                pending = r.num_cached >= r.num_known
                decode.append((r, previous_rows[r.id] if pending else -1))
        for r in self.running:
            if r.to_feed > 1 and len(chunks) < self.max_prefill_rows:
                chunks.append((r, r.num_cached, min(r.to_feed, self.prefill_chunk)))
        if not decode and not chunks:
            assert not copies, "an admitted request always gets a row"
            return None
        counts = self._decode_counts(decode) if not chunks and not copies else [1] * len(decode)
        for (r, _), n in zip(decode, counts, strict=True):
            self._fed(r, n)
            r.pending += n
            draws.append(r)
            self.stats.decode_tokens += n
        for r, _, n in chunks:
            last = n == r.to_feed
            self._fed(r, n)
            self.stats.prefill_tokens += n
            if last:
                r.pending += 1
            draws.append(r if last else None)
        self.stats.steps += 1
        steps = max(counts, default=1)
        return StepPlan(decode, chunks, draws, copies, steps, counts if steps > 1 else [])

    def _decode_counts(self, decode: list[tuple[Request, int]]) -> list[int]:
        """Tokens each decode row draws in a step of decode rows only: up to ``decode_steps``,
        no more than its request may still draw, with the pages for the tokens they cache
        taken now. All 1 when the pool cannot hold them all (a row never preempts another for
        steps ahead)."""
        if self.decode_steps == 1:
            return [1] * len(decode)
        P, counts, need = self.page_size, [], []
        for r, _ in decode:
            n = min(self.decode_steps, r.max_new_tokens - len(r.output) - r.pending)
            counts.append(n)
            # The row feeds positions num_cached .. num_cached + n - 1.
            need.append(max(0, -(-(r.num_cached + n) // P) - len(r.pages)))
        if sum(need) > self.pool.num_available:
            return [1] * len(decode)
        for (r, _), k in zip(decode, need, strict=True):
            if k:
                r.pages += self.pool.allocate(k)
        return counts

    def check(self) -> None:
        """Assert the page pool's invariants against the requests' page lists."""
        holders = [r.pages for r in self.running] + [r.pages for r in self.waiting]
        assert all(not r.pages for r in self.waiting), "a waiting request holds pages"
        self.pool.check(holders)
        P = self.page_size
        for r in self.running:
            assert len(r.pages) * P >= r.num_cached, f"request {r.id} lost pages"
