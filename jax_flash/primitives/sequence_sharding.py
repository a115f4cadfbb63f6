"""Dense prefill with its sequence axis sharded: exact context parallelism inside the partitioned
lowering of `jax_flash_attention` and `jax_flash_attention_bwd` (all-gather of K/V).

`sequence_sharded_prefill` is the one place that decides whether the sequence factors of a dense
call (q rows s, k/v rows t) may stay split; `SequenceShards` is what a device then does on its
shard. The strategy is the all-gather one: each device gathers the K/V rows of its sequence over
the mesh axes that split them and runs the kernel on the query rows it holds. The output and lse
stay sharded like q; the backward sums each device's dK/dV over the devices holding the other
query rows and keeps its own block of k rows (a reduce-scatter where q and k/v share their axes:
the rules let the factors s and t take the same mesh axes, partitioning.Rule.share_axes).

Why all-gather and not the ring of jax_flash.parallel: the per-shard call has the packed form's
starts/ends, so q_seqlens/kv_seqlens, Sq != Skv, q-only or k/v-only sharding and GQA need nothing
beyond local lengths, and it is one kernel call per device (one collective; the ring's n calls and
LSE merges live in jax_flash.parallel for explicit use). Its memory is the whole sequence's K/V
per device (small with GQA), and a causal mask is not load-balanced (the device with the last
rows does the most work): a long causal prefill that needs balance uses
`jax_flash.context_parallel_attention` (zigzag layout).

Bottom-right alignment on a shard: the kernel aligns a sequence's mask on its own lengths
(query row i sees key j <= i + klen - qlen). Device d holds global rows [r0, r0 + sl) with r0 =
d * sl; it runs qlen' = clip(qlen - r0, 0, sl) rows against the first klen' keys, with klen'
chosen so that klen' - qlen' = klen - qlen + r0. That truncation is exact when no key right of the
diagonal is visible (window_right == 0: causal, with or without a left window; the truncated keys
are hidden from every local row) and needless when nothing is aligned (no window at all: klen' =
klen). Any other window (a visible band right of the diagonal, or a left bound with an unbounded
right) would need keys the truncation drops: those calls keep the sequence whole (gathered first,
exact).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .partitioning import local_index


def sequence_sharded_prefill(config) -> tuple[str, ...]:
    """The factors of a dense call's query rows (s) and key rows (t) of a sequence that the
    partitioner must keep whole: none where a device can run its own rows exactly (see the module
    docstring), else both (the sequence is gathered first, which is exact)."""
    window = (config.window_left, config.window_right)
    aligned_on_shard = config.window_right == 0 or window == (-1, -1)
    return () if aligned_on_shard else ("s", "t")


def _axis(axes):
    return axes if len(axes) > 1 else axes[0]


@dataclasses.dataclass(frozen=True)
class SequenceShards:
    """What a device does when the dense call's sequence is split: `got` maps factors to the
    mesh axes splitting them (partitioning.assign). A shard then holds the rows of exactly one
    sequence (assign splits a minor factor only once the batch factor is split to size 1)."""

    q_axes: tuple[str, ...]  # axes splitting the query rows (s)
    kv_axes: tuple[str, ...]  # axes splitting the key rows (t)

    @staticmethod
    def of(got) -> SequenceShards | None:
        q_axes, kv_axes = tuple(got.get("s", ())), tuple(got.get("t", ()))
        return SequenceShards(q_axes, kv_axes) if q_axes or kv_axes else None

    def gather_kv(self, x):
        """The local sequence's k (or v) rows, all of them."""
        if not self.kv_axes:
            return x
        return jax.lax.all_gather(x, _axis(self.kv_axes), axis=0, tiled=True)

    def local_call(self, config, q, k_full, q_starts, q_ends, k_starts, k_ends):
        """(config, q_starts, q_ends, k_starts, k_ends) of this device's kernel call on its q rows
        against the gathered keys, given the global starts/ends of its one sequence."""
        if q_starts.shape[0] != 1:
            raise AssertionError(f"a sequence shard holds one sequence, got {q_starts.shape[0]}")
        sl, skv = q.shape[0], k_full.shape[0]
        sq = sl * (jax.lax.axis_size(_axis(self.q_axes)) if self.q_axes else 1)
        qlen = jnp.clip(q_ends - q_starts, 0, min(sq, config.max_seqlen_q))
        klen = jnp.clip(k_ends - k_starts, 0, skv)
        r0 = (local_index(self.q_axes) * sl).astype(jnp.int32) if self.q_axes else 0
        qlen_local = jnp.clip(qlen - r0, 0, sl)
        if config.window_right == 0:
            klen_local = jnp.clip(klen - qlen + r0 + qlen_local, 0, klen)
        else:  # no window: nothing is aligned (sequence_sharded_prefill allows no other)
            klen_local = klen
        zero = jnp.zeros_like(q_starts)
        local = dataclasses.replace(config, max_seqlen_q=sl)
        return local, (zero, zero + qlen_local, zero, zero + klen_local)

    def reduce_kv_grad(self, dx):
        """This device's block of dK (or dV) from its contribution over all keys: summed over
        the devices holding the other query rows, then cut to the local key rows."""
        if self.q_axes and self.q_axes == self.kv_axes:
            return jax.lax.psum_scatter(dx, _axis(self.q_axes), scatter_dimension=0, tiled=True)
        if self.q_axes:
            dx = jax.lax.psum(dx, _axis(self.q_axes))
        if self.kv_axes:
            n = jax.lax.axis_size(_axis(self.kv_axes))
            tl = dx.shape[0] // n
            dx = jax.lax.dynamic_slice_in_dim(dx, local_index(self.kv_axes) * tl, tl, axis=0)
        return dx
