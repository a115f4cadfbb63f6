"""Multi-device attention: context parallelism (the sequence axis sharded over a mesh axis).

`context_parallel_attention` works on global arrays under a mesh; `ring_attention` is its
per-device function for use inside `jax.shard_map`; `context_parallel_shard` is a per-shard form for
code that partitions by hand; `choose_strategy` is the rule of ``strategy="auto"``;
`to_zigzag` / `from_zigzag` (global arrays) and `shard_to_zigzag` / `shard_from_zigzag` (inside
`shard_map`) convert between the natural and the load-balanced zigzag sequence layouts.
"""

from .context import (
    choose_strategy,
    context_parallel_attention,
    context_parallel_shard,
    ring_attention,
)
from .zigzag import from_zigzag, shard_from_zigzag, shard_to_zigzag, to_zigzag

__all__ = [
    "choose_strategy",
    "context_parallel_attention",
    "context_parallel_shard",
    "from_zigzag",
    "ring_attention",
    "shard_from_zigzag",
    "shard_to_zigzag",
    "to_zigzag",
]
