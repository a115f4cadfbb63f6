"""A request's parameters (`SamplingParams`) and its host-side state (`Request`)."""

from __future__ import annotations

import dataclasses
import enum
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request draws its tokens, as :func:`jax_flash.sample` (``temperature`` 0: greedy).

    Token ``i`` of the output (0-based) is drawn with the key
    ``jax.random.fold_in(jax.random.key(seed), i)`` from the request's own logits row alone, the
    keys :func:`jax_flash.models.generate` uses for a lone prompt with ``seed``: a request draws
    the same tokens whatever else the engine runs beside it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        t, k, p, m, s = self.temperature, self.top_k, self.top_p, self.min_p, self.seed
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"SamplingParams: temperature must be finite and >= 0, got {t}")
        if not (isinstance(k, int) and k >= 0):
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0 = off), got {k!r}")
        if not 0 < p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {p}")
        if not 0 <= m <= 1:
            raise ValueError(f"SamplingParams: min_p must be in [0, 1], got {m}")
        if not (isinstance(s, int) and 0 <= s < 2**31):
            raise ValueError(f"SamplingParams: seed must be an int in [0, 2^31), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no pages
    RUNNING = "running"  # holds the pages of every token it has fed
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """The host-side state of one request.

    The request's token sequence is ``prompt + output`` followed by ``pending`` tokens that
    device steps have drawn but the host has not read yet. The cache holds the keys/values of
    its first ``num_cached`` tokens (counting those of steps dispatched but not finished: steps
    run in dispatch order, so a later step sees them), in ``pages`` (page ``j`` holds tokens
    ``j * page_size ...``). Preemption frees the pages and sets ``num_cached`` to 0: the tokens
    are fed again (recomputed) when the request is admitted again.
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    stop_tokens: frozenset[int]
    sampling: SamplingParams
    arrival_s: float
    output: list[int] = dataclasses.field(default_factory=list)
    pending: int = 0
    num_cached: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (a stop token, or `Engine.stop`), "length", "abort"
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # when each was read
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, the pending ones included."""
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def num_known(self) -> int:
        """Tokens the host knows (the prompt and the output read so far)."""
        return len(self.prompt) + len(self.output)

    @property
    def to_feed(self) -> int:
        """Tokens not yet in the cache: the next step feeds them (the last one's logits draw
        the next token)."""
        return self.num_tokens - self.num_cached

    @property
    def may_draw(self) -> bool:
        """Whether another token may be drawn (the token limit counts pending ones)."""
        return len(self.output) + self.pending < self.max_new_tokens

    def token(self, i: int) -> int:
        """Known token ``i`` of the sequence."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]
