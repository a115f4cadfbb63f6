"""`jax_flash.serve`: a serving engine over the paged KV cache (continuous batching, chunked
prefill, prefix sharing, preemption) and an OpenAI-style completions endpoint
(``python -m jax_flash.serve --checkpoint DIR``, needs the ``serve`` extra)."""

from .detokenize import Detokenizer
from .engine import Engine, StepOutput
from .pages import PagePool
from .request import Request, SamplingParams, Status
from .scheduler import Scheduler, StepPlan

__all__ = [
    "Detokenizer",
    "Engine",
    "PagePool",
    "Request",
    "SamplingParams",
    "Scheduler",
    "Status",
    "StepOutput",
    "StepPlan",
]
