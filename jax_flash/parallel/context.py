"""Context parallelism: exact attention over one long sequence whose sequence axis is sharded.

Every device runs the single-device kernel (`jax_flash.flash_attention` with ``return_lse``) on
the q rows it holds against k/v rows it holds or receives, and merges the partial results by
their log-sum-exp. Two strategies move k/v:

- "ring": k/v blocks travel around the mesh axis (`jax.lax.ppermute`, one neighbour per step),
  the next block's transfer issued before this block's kernel calls so the two overlap; steps
  whose block the mask hides on every device are not computed, and trailing ones not sent.
- "allgather": k/v all-gathered once (`jax.lax.all_gather`), then one kernel call per query
  chunk against the keys it sees.

Which calls a device makes is static (`_tiles.plan`): positions follow from the layout and the
device index, and where plans differ between devices one `lax.switch` on the device index picks
the device's own. Causal masks are load-balanced by the zigzag layout (`zigzag`).

Gradients: reverse mode works through every strategy and layout. The merge is plain jnp,
ppermute/all_gather and switch have transpose rules, and `flash_attention` has a VJP that takes
the cotangent of its lse output (which the merge uses); tests/test_grad.py checks the gradients
against the reference on host devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import reference
from ..ops import _checks
from ..ops.flash_attention import flash_attention
from . import _tiles, zigzag

STRATEGIES = ("ring", "allgather")
LAYOUTS = ("natural", "zigzag")

# strategy="auto": all-gather k/v while the gathered k/v of one device stay below this.
ALLGATHER_MAX_BYTES = 4 << 30


def choose_strategy(*, n: int, gathered_kv_bytes: int, ring_steps: int) -> str:
    """The rule of ``strategy="auto"`` (tune it here, from benchmarks/context_parallel_bench.py).

    - A ring that stops early (a sliding window hides every block more than ``ring_steps - 1``
      devices away) sends only the blocks someone sees: "ring".
    - Else "allgather" while one device's gathered k/v (``gathered_kv_bytes``, all n blocks)
      stay below ALLGATHER_MAX_BYTES: one collective, fewer and larger kernel calls; GQA keeps
      k/v small (a 128k-token sequence with 8 KV heads of 128 in bf16: 512 MiB).
    - Else "ring", whose memory is two k/v blocks whatever n is.
    """
    if ring_steps < n:
        return "ring"
    return "allgather" if gathered_kv_bytes <= ALLGATHER_MAX_BYTES else "ring"


def _merge(acc, o, lse):
    """acc = (o [B, S, H, Dv] f32, lse [B, H, S] f32) merged with a partial (o, lse) of the same
    rows: the softmax over the union of their keys. Rows neither has seen stay o = 0,
    lse = -inf (the weights are taken against a finite max, never inf - inf)."""
    o_acc, lse_acc = acc
    m = jnp.maximum(lse_acc, lse)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w_acc, w = jnp.exp(lse_acc - m), jnp.exp(lse - m)
    total = w_acc + w
    seen = total > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)

    def rows(x):  # [B, H, S] -> [B, S, H, 1], o's layout
        return jnp.swapaxes(x, 1, 2)[..., None]

    o_new = o_acc * rows(w_acc * inv) + o.astype(jnp.float32) * rows(w * inv)
    lse_new = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return o_new, lse_new


def _apply_tiles(acc, q, k, v, *, tiles, kernel, merge):
    """acc merged with the kernel's result on each tile (static q/k row ranges); with
    merge=False the tiles' rows are disjoint and seen by nothing else, so the results are
    written as they are (the kernel's own rounding, no float32 pass)."""
    o_acc, lse_acc = acc
    rows = sorted((t.q0, t.q1) for t in tiles)
    assert merge or all(a[1] <= b[0] for a, b in zip(rows[:-1], rows[1:], strict=True)), tiles
    for t in tiles:
        window = None if (t.left, t.right) == (-1, -1) else (t.left, t.right)
        o, lse = kernel(q[:, t.q0 : t.q1], k[:, t.k0 : t.k1], v[:, t.k0 : t.k1], window)
        if merge:
            o, lse = _merge((o_acc[:, t.q0 : t.q1], lse_acc[:, :, t.q0 : t.q1]), o, lse)
        # Static row ranges, written by dynamic_update_slice rather than `.at[].set`: the
        # latter's scatter has an empty index array, a constant that jax hoists into an
        # input of the shard_map, and such inputs crash XLA's partitioner (jax 0.11.2).
        o_acc = jax.lax.dynamic_update_slice(o_acc, o.astype(o_acc.dtype), (0, t.q0, 0, 0))
        lse_acc = jax.lax.dynamic_update_slice(lse_acc, lse.astype(lse_acc.dtype), (0, 0, t.q0))
    return o_acc, lse_acc


def _apply_plans(acc, q, k, v, plans, axis_name, kernel, merge=True):
    """Each device applies its own plan (plans[d], a tuple of tiles): directly where all devices
    share one, else through a switch on the device index over the distinct plans."""
    distinct = list(dict.fromkeys(plans))
    apply = functools.partial(_apply_tiles, kernel=kernel, merge=merge)
    branches = [functools.partial(apply, tiles=p) for p in distinct]
    if len(distinct) == 1:
        return branches[0](acc, q, k, v)
    table = jnp.asarray([distinct.index(p) for p in plans], jnp.int32)
    return jax.lax.switch(table[jax.lax.axis_index(axis_name)], branches, acc, q, k, v)


@functools.lru_cache(maxsize=256)
def _ring_plans(q_layout, kv_layout, n, local_len, window):
    """plans[s][d]: device d's tiles at ring step s (holding the k/v block of device d - s),
    up to the last step where some device sees something."""
    plans = [
        tuple(
            _tiles.plan(
                _tiles.segments(q_layout, d, n, local_len),
                _tiles.segments(kv_layout, (d - s) % n, n, local_len),
                *window,
            )
            for d in range(n)
        )
        for s in range(n)
    ]
    while len(plans) > 1 and not any(plans[-1]):
        plans.pop()
    return tuple(plans)


@functools.lru_cache(maxsize=256)
def _gathered_plans(q_layout, n, local_len, window):
    """plans[d]: device d's tiles against all k/v in natural order (one segment)."""
    keys = (_tiles.Segment(0, 0, n * local_len),)
    return tuple(
        _tiles.plan(_tiles.segments(q_layout, d, n, local_len), keys, *window) for d in range(n)
    )


def _ring(q, k, v, acc, *, axis_name, n, plans, kernel):
    perm = [(d, (d + 1) % n) for d in range(n)]
    for s, step in enumerate(plans):
        if s + 1 < len(plans):  # issued first: in flight while this step computes
            k_next, v_next = jax.lax.ppermute((k, v), axis_name, perm)
        if any(step):
            acc = _apply_plans(acc, q, k, v, step, axis_name, kernel)
        if s + 1 < len(plans):
            k, v = k_next, v_next
    return acc


def _attend(q, k, v, *, axis_name, n, window, q_layout, kv_layout, strategy, kernel):
    """(o, lse) of the local q rows (o in float32 from the ring's merges, in q's dtype from the
    all-gather's one pass); strategy already resolved."""
    B, sl, Hq, _ = q.shape

    def empty(dtype):  # rows no tile reaches: o = 0, lse = -inf
        o = jnp.zeros((B, sl, Hq, v.shape[-1]), dtype)
        return o, jnp.full((B, Hq, sl), -jnp.inf, jnp.float32)

    if strategy == "ring":
        plans = _ring_plans(q_layout, kv_layout, n, sl, window)
        acc = empty(jnp.float32)
        return _ring(q, k, v, acc, axis_name=axis_name, n=n, plans=plans, kernel=kernel)
    k, v = (jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))
    if kv_layout == "zigzag":  # a local copy; the ring keeps zigzag blocks as they are
        k, v = zigzag.from_zigzag(k, n), zigzag.from_zigzag(v, n)
    # All keys form one segment, so a device's tiles are one per q segment: disjoint rows.
    plans = _gathered_plans(q_layout, n, sl, window)
    return _apply_plans(empty(q.dtype), q, k, v, plans, axis_name, kernel, merge=False)


def _check_local(op, q, k, v):
    _checks.array_arg(op, "q", q, 4, "[B, S_local, Hq, D]")
    _checks.array_arg(op, "k", k, 4, "[B, S_local, Hkv, D]")
    _checks.array_arg(op, "v", v, 4, "[B, S_local, Hkv, Dv]")
    _checks.float_dtype(op, "q", q)
    _checks.float_dtype(op, "k", k, like=q)
    _checks.float_dtype(op, "v", v, like=q)
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{op}: k must have q's batch, sequence length and head dim (self-attention over one "
            f"sharded sequence): q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{op}: v must have shape {tuple(k.shape[:3]) + ('Dv',)} to match k "
            f"{tuple(k.shape)}, got {tuple(v.shape)}"
        )
    _checks.heads(op, q.shape[2], k.shape[2])


def _choice(op, name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {allowed}, got {value!r}")


def _resolve_strategy(strategy, *, n, q_layout, kv_layout, sl, window, gathered_kv_bytes):
    if strategy != "auto":
        return strategy
    steps = len(_ring_plans(q_layout, kv_layout, n, sl, window))
    return choose_strategy(n=n, gathered_kv_bytes=gathered_kv_bytes, ring_steps=steps)


def _kernel(scale, cap, implementation, deterministic):
    def call(q, k, v, window):
        return flash_attention(
            q,
            k,
            v,
            softmax_scale=scale,
            sliding_window=window,
            logits_soft_cap=cap,
            return_lse=True,
            implementation=implementation,
            deterministic=deterministic,
        )

    return call


def ring_attention(
    q,
    k,
    v,
    *,
    axis_name,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    layout: str = "natural",
    kv_layout: str | None = None,
    strategy: str = "ring",
    return_lse: bool = False,
    axis_size: int | None = None,
    implementation: str | None = None,
    deterministic: bool = False,
):
    """Exact attention over a sequence sharded on mesh axis ``axis_name``: the per-device
    function, to call inside `jax.shard_map` (``axis_name`` manual there).

    Device d of n holds its q, k and v rows of one self-attention (q and k/v share positions):
    with ``layout="natural"`` rows ``[d * S_local, (d + 1) * S_local)`` of the sequence, with
    ``layout="zigzag"`` chunks d and 2n-1-d of 2n (see `jax_flash.parallel.to_zigzag`), which
    gives every device the same work under a causal mask. The result equals
    `jax_flash.flash_attention` on the whole sequence, rows in the same layout as q.

    Parameters
    ----------
    q : Array ``[B, S_local, Hq, D]`` float32, float16 or bfloat16: this device's q rows.
    k : Array ``[B, S_local, Hkv, D]``; v : Array ``[B, S_local, Hkv, Dv]``; same dtype,
        ``Hq % Hkv == 0`` (GQA/MQA).
    axis_name : the mesh axis the sequence is sharded on.
    causal, softmax_scale, sliding_window, logits_soft_cap : as in `jax_flash.flash_attention`,
        on absolute positions of the whole sequence (S = n * S_local queries and keys, so the
        causal diagonal is the plain one).
    layout : "natural" or "zigzag" (S_local even): the layout of q (and of the output).
    kv_layout : None (as ``layout``), "natural" or "zigzag": the layout of k and v. The
        all-gather strategy balances causal work with zigzag q alone, so naturally ordered k/v
        need no reorder there.
    strategy : "ring", "allgather" or "auto" (`choose_strategy`); see the module docstring.
    return_lse : bool
        Also return ``lse [B, Hq, S_local]`` float32 (natural log of each row's softmax
        denominator over the whole sequence).
    axis_size : int or None
        The size n of ``axis_name``; None asks `jax.lax.axis_size`.
    implementation, deterministic : as in `jax_flash.flash_attention` (the kernel each device
        runs; the merge is deterministic either way).

    Returns
    -------
    o : Array ``[B, S_local, Hq, Dv]`` in q's dtype (partial results merged in float32), and
        ``lse`` when ``return_lse``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> from jax.sharding import PartitionSpec as P
    >>> from jax_flash.parallel import ring_attention
    >>> mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 32), jnp.float32)
    >>> f = jax.shard_map(
    ...     lambda q, k, v: ring_attention(q, k, v, axis_name="seq", causal=True),
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> f(q, k, v).shape
    (1, 64, 4, 32)
    """
    op = "ring_attention"
    _check_local(op, q, k, v)
    _choice(op, "layout", layout, LAYOUTS)
    kv_layout = layout if kv_layout is None else kv_layout
    _choice(op, "kv_layout", kv_layout, LAYOUTS)
    _choice(op, "strategy", strategy, ("auto", *STRATEGIES))
    _checks.implementation(op, implementation)
    deterministic = _checks.boolean(op, "deterministic", deterministic)
    window = reference.normalize_window(causal, sliding_window, op)
    scale, cap = _checks.scale_and_cap(op, q.shape[3], softmax_scale, logits_soft_cap)
    n = jax.lax.axis_size(axis_name) if axis_size is None else axis_size
    n = _checks.static_int(op, "axis_size", n, 1)
    B, sl, _, D = q.shape
    if "zigzag" in (layout, kv_layout):
        zigzag.check_divisible(op, n * sl, n)
    gathered = B * n * sl * k.shape[2] * (D + v.shape[3]) * q.dtype.itemsize
    strategy = _resolve_strategy(
        strategy,
        n=n,
        q_layout=layout,
        kv_layout=kv_layout,
        sl=sl,
        window=window,
        gathered_kv_bytes=gathered,
    )
    o, lse = _attend(
        q,
        k,
        v,
        axis_name=axis_name,
        n=n,
        window=window,
        q_layout=layout,
        kv_layout=kv_layout,
        strategy=strategy,
        kernel=_kernel(scale, cap, implementation, deterministic),
    )
    o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def context_parallel_shard(
    q,
    k,
    v,
    *,
    axis_name,
    axis_size: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    strategy: str = "auto",
    implementation: str | None = None,
):
    """A per-shard form of a sequence-sharded `jax_flash.flash_attention` over the ring or
    all-gather strategies, for code that partitions by hand (the partitioned lowering of
    `flash_attention` itself runs primitives/sequence_sharding.py, an all-gather form that takes
    seqlens and Sq != Skv).

    Given this device's blocks of a naturally ordered sequence (device d of ``axis_size`` holds
    rows ``[d * S_local, (d + 1) * S_local)`` of q, k and v), returns this device's block of
    the single-device result ``(o [B, S_local, Hq, Dv], lse [B, Hq, S_local] float32)``: the
    output sharded like q, the lse on its last axis. It needs ``axis_name`` bound to the mesh
    axis (manual: inside `jax.shard_map`, or a per-shard lowering on that mesh), since it
    uses `jax.lax.axis_index`, `ppermute` or `all_gather` over it; ``axis_size`` is passed
    because a lowering knows it from the mesh. Not covered (raise before calling): Sq != Skv,
    ``q_seqlens`` / ``kv_seqlens`` and the packed varlen form. The remaining arguments are those
    of `ring_attention` (layout "natural", ``return_lse=True``).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jax_flash.parallel import context_parallel_shard
    >>> mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 4, 32), jnp.float32)
    >>> f = jax.shard_map(
    ...     lambda q, k, v: context_parallel_shard(q, k, v, axis_name="seq", axis_size=1),
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=(P(None, "seq"), P(None, None, "seq")))
    >>> [x.shape for x in f(q, k, v)]
    [(1, 64, 4, 32), (1, 4, 64)]
    """
    return ring_attention(
        q,
        k,
        v,
        axis_name=axis_name,
        axis_size=axis_size,
        causal=causal,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        layout="natural",
        strategy=strategy,
        return_lse=True,
        implementation=implementation,
    )


def _axes(op, mesh, name, axes):
    """A spec entry (None, a name or a tuple of names) and its size on the mesh."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in mesh.axis_names:
            raise ValueError(f"{op}: {name} {a!r} is not an axis of the mesh {mesh.axis_names}")
    size = 1
    for a in names:
        size *= mesh.shape[a]
    return (None if not names else names[0] if len(names) == 1 else names), names, size


def _place(x, mesh, spec):
    """x resharded to spec on the mesh's Explicit axes (shard_map reshards Auto axes itself but
    requires inputs already sharded as in_specs on Explicit ones)."""
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))

    def keep(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(a for a in names if kinds[a] == AxisType.Explicit)
        return None if not names else names[0] if len(names) == 1 else names

    explicit = P(*(keep(e) for e in spec))
    if all(e is None for e in explicit):
        return x
    return jax.reshard(x, NamedSharding(mesh, explicit))


def context_parallel_attention(
    q,
    k,
    v,
    *,
    mesh,
    seq_axis: str,
    batch_axis=None,
    head_axis=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    strategy: str = "auto",
    layout: str = "auto",
    reorder: bool = True,
    implementation: str | None = None,
    deterministic: bool = False,
):
    """`jax_flash.flash_attention` of one self-attention with its sequence sharded over the mesh
    axis ``seq_axis`` (context parallelism), on global arrays.

    q, k and v are sharded ``[batch_axis, seq_axis, head_axis, None]`` (inputs sharded
    otherwise are resharded to that); each device runs `ring_attention` on its blocks through
    `jax.shard_map`, and the output comes back sharded the same way (``lse``:
    ``[batch_axis, head_axis, seq_axis]``). Batch and heads split with no communication.

    Parameters
    ----------
    q : Array ``[B, S, Hq, D]``; k : ``[B, S, Hkv, D]``; v : ``[B, S, Hkv, Dv]``; as in
        `jax_flash.flash_attention` with Sq = Skv = S, divisible by the size n of ``seq_axis``.
    mesh : `jax.sharding.Mesh` (Auto or Explicit axes).
    seq_axis : the mesh axis sharding the sequence.
    batch_axis, head_axis : None, a mesh axis name or a tuple of names sharding B and the heads
        (Hkv divisible by the head axes' size, so each device keeps its q heads' KV group).
    causal, softmax_scale, sliding_window, logits_soft_cap, return_lse, implementation,
    deterministic :
        as in `jax_flash.flash_attention`.
    strategy : "auto" (`choose_strategy`), "ring" or "allgather".
    layout : "auto", "natural" or "zigzag". "auto" is "zigzag" for a causal mask with no left
        window and S divisible by 2n (the balanced layout), else "natural". "zigzag" with S
        not divisible by 2n raises.
    reorder : bool
        With the zigzag layout: True takes and returns naturally ordered arrays, permuting them
        on the devices (each device sends its two half-blocks to their zigzag owners, q, k and
        v before and o and lse after; k and v stay natural under "allgather"); False takes and
        returns arrays already in zigzag order (`jax_flash.parallel.to_zigzag`), for a model
        that keeps that order from its embedding on.

    Returns
    -------
    o : Array ``[B, S, Hq, Dv]`` in q's dtype, and ``lse [B, Hq, S]`` float32 when
        ``return_lse``.

    Notes
    -----
    Differentiable in q, k and v (and through ``lse``): the merge, the collectives and the
    switch differentiate, with the VJP of `jax_flash.flash_attention` on each device.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("seq",))
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 256, 4, 32), jnp.float32)
    >>> o = jax_flash.context_parallel_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True)
    >>> o.shape
    (1, 256, 4, 32)
    """
    op = "context_parallel_attention"
    _checks.array_arg(op, "q", q, 4, "[B, S, Hq, D]")
    _checks.array_arg(op, "k", k, 4, "[B, S, Hkv, D]")
    _checks.array_arg(op, "v", v, 4, "[B, S, Hkv, Dv]")
    _check_local(op, q, k, v)
    _choice(op, "layout", layout, ("auto", *LAYOUTS))
    _choice(op, "strategy", strategy, ("auto", *STRATEGIES))
    if not isinstance(reorder, bool):
        raise TypeError(f"{op}: reorder must be a bool, got {reorder!r}")
    window = reference.normalize_window(causal, sliding_window, op)
    if seq_axis not in mesh.axis_names:
        raise ValueError(
            f"{op}: seq_axis {seq_axis!r} is not an axis of the mesh {mesh.axis_names}"
        )
    b_spec, b_names, b_size = _axes(op, mesh, "batch_axis", batch_axis)
    h_spec, h_names, h_size = _axes(op, mesh, "head_axis", head_axis)
    used = (seq_axis, *b_names, *h_names)
    if len(set(used)) != len(used):
        raise ValueError(f"{op}: seq_axis, batch_axis and head_axis must be distinct: {used}")
    B, S, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    n = mesh.shape[seq_axis]
    if S % n:
        raise ValueError(
            f"{op}: the sequence length {S} must be divisible by the size {n} of seq_axis "
            f"{seq_axis!r}"
        )
    if B % b_size:
        raise ValueError(f"{op}: the batch {B} must be divisible by batch_axis's size {b_size}")
    if Hkv % h_size:
        raise ValueError(
            f"{op}: the KV heads ({Hkv}) must be divisible by head_axis's size {h_size}, so that "
            "each device holds whole GQA groups"
        )
    _checks.scale_and_cap(op, D, softmax_scale, logits_soft_cap)
    _checks.implementation(op, implementation)
    _checks.boolean(op, "deterministic", deterministic)
    if layout == "auto":
        layout = "zigzag" if zigzag.balances(window, S, n) else "natural"
    if layout == "zigzag":
        zigzag.check_divisible(op, S, n)
    shuffle = layout == "zigzag" and reorder and n > 1
    sl = S // n
    gathered = (B // b_size) * S * (Hkv // h_size) * (D + Dv) * q.dtype.itemsize
    strategy = _resolve_strategy(
        strategy,
        n=n,
        q_layout=layout,
        kv_layout=layout,
        sl=sl,
        window=window,
        gathered_kv_bytes=gathered,
    )
    # The all-gather strategy needs k/v in no particular layout: natural ones are not permuted.
    kv_layout = "natural" if shuffle and strategy == "allgather" else layout
    per_device = functools.partial(
        ring_attention,
        axis_name=seq_axis,
        axis_size=n,
        causal=causal,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        layout=layout,
        kv_layout=kv_layout,
        strategy=strategy,
        return_lse=True,
        implementation=implementation,
        deterministic=deterministic,
    )

    def body(q, k, v):
        if shuffle:
            q = zigzag.shard_to_zigzag(q, seq_axis, n)
            if kv_layout == "zigzag":
                k, v = (zigzag.shard_to_zigzag(x, seq_axis, n) for x in (k, v))
        o, lse = per_device(q, k, v)
        if shuffle:
            o = zigzag.shard_from_zigzag(o, seq_axis, n)
            lse = zigzag.shard_from_zigzag(lse, seq_axis, n, axis=2)
        return o, lse

    spec = P(b_spec, seq_axis, h_spec, None)
    lse_spec = P(b_spec, h_spec, seq_axis)
    q, k, v = (_place(x, mesh, spec) for x in (q, k, v))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec))
    o, lse = fn(q, k, v)
    return (o, lse) if return_lse else o
