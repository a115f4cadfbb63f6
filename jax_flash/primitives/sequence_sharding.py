"""Dense prefill with its sequence axis sharded: exact context parallelism inside the partitioned
lowering of `jax_flash_attention` and `jax_flash_attention_bwd` (all-gather of K/V).

`sequence_sharded_prefill` is the one place that decides whether the sequence factors of a dense
call (q rows s, k/v rows t) may stay split; `SequenceShards` is what a device then does on its
shard. The strategy is the all-gather one: each device gathers the K/V rows of its sequence over
the mesh axes that split them and runs the kernel on query rows against them. The output and lse
stay sharded like q; the backward sums each device's dK/dV over the devices holding the other
query rows and keeps its own block of k rows (a reduce-scatter where q and k/v share their axes:
the rules let the factors s and t take the same mesh axes, partitioning.Rule.share_axes).

Why all-gather and not the ring of jax_flash.parallel: the per-shard call has the packed form's
starts/ends, so q_seqlens/kv_seqlens, Sq != Skv, q-only or k/v-only sharding and GQA need nothing
beyond local lengths, and it is one kernel call per device (one collective; the ring's n calls and
LSE merges live in jax_flash.parallel for explicit use). Its memory is the whole sequence's K/V
per device (small with GQA).

Causal balance (`row_layout`): device d of n holds the contiguous q rows [d*sl, (d+1)*sl); under a
causal mask the device with the last rows would do (2n-1)/n^2 of the work (7/16 on 4 devices, a
speed-up of at most 16/7). Where `zigzag.balances` holds (causal, no left window, sl even) the
rows a device computes are not the rows it holds: the sequence is cut into 2n half-blocks of
c = sl/2 rows and device d computes half-blocks d and 2n-1-d (the zigzag layout of
jax_flash.parallel, `_tiles.segments("zigzag", ...)`). A query row's work is the keys it sees,
i + 1 + Skv - Sq for global row i: linear in i, so the two half-blocks' rows d*c + r and
(2n-1-d)*c + r see (2n-1)*c + 2r + 2(1 + Skv - Sq) keys together, the same on every device (up
to rows that see no key when Skv < Sq, and to valid lengths). The half-blocks travel with two
`ppermute`s each way (`zigzag.shard_to_zigzag` / `shard_from_zigzag`): q in, o and lse back; in
the backward q, o, do, lse and dlse in, dq back. What the user sees does not change: o, lse and
dq keep q's sharding and row order. The forward runs both half-blocks in one kernel call (two
packed sequences reading the same keys); the backward runs one call per half-block, since two
packed sequences may not share k rows there (each writes its own dK/dV rows), and adds their
dK/dV (float32) before the reduce-scatter. `device_work` counts each device's tiles from the
same `segment_extents` the lowering uses. Other masks (non-causal, windows) and odd sl keep the
natural layout, whose work is already even (no mask, a window) or which cannot be halved.

Bottom-right alignment on a shard: the kernel aligns a sequence's mask on its own lengths
(query row i sees key j <= i + klen - qlen). A run of rows holding global rows [r0, r0 + m)
runs qlen' = clip(qlen - r0, 0, m) rows against the first klen' keys, with klen' chosen so that
klen' - qlen' = klen - qlen + r0. That truncation is exact when no key right of the diagonal is
visible (window_right == 0: causal, with or without a left window; the truncated keys are hidden
from every local row) and needless when nothing is aligned (no window at all: klen' = klen). Any
other window (a visible band right of the diagonal, or a left bound with an unbounded right)
would need keys the truncation drops: those calls keep the sequence whole (gathered first,
exact).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .partitioning import local_index

SEQUENCE_LAYOUTS = ("auto", "natural")  # FlashConfig._sequence_layout


def sequence_sharded_prefill(config) -> tuple[str, ...]:
    """The factors of a dense call's query rows (s) and key rows (t) of a sequence that the
    partitioner must keep whole: none where a device can run its own rows exactly (see the module
    docstring), else both (the sequence is gathered first, which is exact)."""
    window = (config.window_left, config.window_right)
    aligned_on_shard = config.window_right == 0 or window == (-1, -1)
    return () if aligned_on_shard else ("s", "t")


def _parallel():
    """jax_flash.parallel's `_tiles` and `zigzag`, imported when a call is partitioned, not with
    this module: that package imports the ops, which import this module."""
    from ..parallel import _tiles, zigzag

    return _tiles, zigzag


def row_layout(config, n: int, local_rows: int) -> str:
    """The q rows a device computes when one sequence's q rows are split n ways in blocks of
    `local_rows`: "zigzag" (half-blocks d and 2n-1-d, see the module docstring) where that
    balances the mask, else "natural" (its own block). config._sequence_layout "natural" keeps
    the natural layout (benchmarks compare the two)."""
    if config._sequence_layout == "natural":
        return "natural"
    _, zigzag = _parallel()
    window = (config.window_left, config.window_right)
    return "zigzag" if zigzag.balances(window, n * local_rows, n) else "natural"


def row_segments(layout: str, device, n: int, local_rows: int):
    """The runs of rows a device computes: `_tiles.Segment`s (rows [start, start + length) of
    its buffer hold global rows [pos, pos + length)); `device` an int or a traced index."""
    _tiles, _ = _parallel()
    return _tiles.segments(layout, device, n, local_rows)


def segment_extents(config, segments, qlen, klen):
    """(qlen', klen') of each segment's kernel call, its mask aligned on the global rows (module
    docstring): the rows of the segment that hold a query of the sequence (qlen valid rows in
    all), and the keys the call reads (of klen). Ints or arrays."""
    out = []
    for seg in segments:
        q_seg = jnp.clip(qlen - seg.pos, 0, seg.length)
        if config.window_right == 0:
            k_seg = jnp.clip(klen - qlen + seg.pos + q_seg, 0, klen)
        else:  # no window: nothing is aligned (sequence_sharded_prefill allows no other)
            k_seg = klen
        out.append((q_seg, k_seg))
    return out


def device_work(config, n: int, sq: int, skv: int, block_q: int = 128, block_k: int = 128):
    """[tiles of device d for d in range(n)]: the (block_q x block_k) tiles of (query, key)
    pairs holding a visible pair that each device's kernel calls compute when one sequence of sq
    queries and skv keys (all valid; a mask that sequence_sharded_prefill keeps split) has its
    q rows split n ways; from the layout and `segment_extents` the lowering uses. The busiest
    device bounds the speed-up: sum(work) / max(work)."""
    sl = sq // n
    layout = row_layout(config, n, sl)
    work = []
    for d in range(n):
        tiles = 0
        segments = row_segments(layout, d, n, sl)
        for q_seg, k_seg in segment_extents(config, segments, sq, skv):
            q_seg, k_seg = int(q_seg), int(k_seg)
            shift = k_seg - q_seg  # row r sees keys [r + shift - left, r + shift + right]
            for r0 in range(0, q_seg, block_q):
                last = min(r0 + block_q, q_seg) - 1
                hi = k_seg if config.window_right < 0 else min(k_seg, last + shift + 1)
                lo = 0 if config.window_left < 0 else max(0, r0 + shift - config.window_left)
                if hi > lo:  # key tiles from the first row's first key to the last row's last
                    tiles += -(-hi // block_k) - lo // block_k
        work.append(tiles)
    return work


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

    def q_shards(self) -> int:
        return jax.lax.axis_size(_axis(self.q_axes)) if self.q_axes else 1

    def layout(self, config, local_rows: int) -> str:
        """row_layout of this device's q rows."""
        return row_layout(config, self.q_shards(), local_rows)

    def gather_kv(self, x):
        """The local sequence's k (or v) rows, all of them."""
        if not self.kv_axes:
            return x
        return jax.lax.all_gather(x, _axis(self.kv_axes), axis=0, tiled=True)

    def to_layout(self, layout, x, axis: int = 0):
        """This device's natural block of q rows (axis `axis` of x) -> the rows it computes."""
        if layout == "natural":
            return x
        _, zigzag = _parallel()
        return zigzag.shard_to_zigzag(x, _axis(self.q_axes), self.q_shards(), axis=axis)

    def from_layout(self, layout, x, axis: int = 0):
        """The inverse of to_layout: results back to this device's natural block."""
        if layout == "natural":
            return x
        _, zigzag = _parallel()
        return zigzag.shard_from_zigzag(x, _axis(self.q_axes), self.q_shards(), axis=axis)

    def segment_calls(self, config, layout, local_rows, skv, q_starts, q_ends, k_starts, k_ends):
        """[(segment, qlen', klen')] of this device's rows in `layout` against the gathered skv
        keys, given the global starts/ends of its one sequence (arrays [1])."""
        if q_starts.shape[0] != 1:
            raise AssertionError(f"a sequence shard holds one sequence, got {q_starts.shape[0]}")
        n = self.q_shards()
        qlen = jnp.clip(q_ends - q_starts, 0, min(n * local_rows, config.max_seqlen_q))
        klen = jnp.clip(k_ends - k_starts, 0, skv)
        d = local_index(self.q_axes).astype(jnp.int32) if self.q_axes else 0
        segments = row_segments(layout, d, n, local_rows)
        extents = segment_extents(config, segments, qlen, klen)
        return [(seg, q, k) for seg, (q, k) in zip(segments, extents, strict=True)]

    @staticmethod
    def packed(config, calls):
        """(config, q_starts, q_ends, k_starts, k_ends) of one kernel call running `calls` as
        packed sequences of the local rows, each reading keys from row 0."""
        zero = jnp.zeros((1,), jnp.int32)
        q_starts = jnp.concatenate([zero + seg.start for seg, _, _ in calls])
        q_ends = q_starts + jnp.concatenate([q for _, q, _ in calls])
        k_ends = jnp.concatenate([k for _, _, k in calls])
        local = dataclasses.replace(config, max_seqlen_q=max(seg.length for seg, _, _ in calls))
        return local, (q_starts, q_ends, jnp.zeros_like(k_ends), k_ends)

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
