"""Flax NNX attention on jax_flash kernels, and the KV-cache state it reads and writes.

`Attention` projects q/k/v (GQA, optional bias; one `FusedLinear` matmul for the three), rotates q
and k (RoPE), appends k/v to a paged cache in place and attends: packed prompts (`Prefill`) through
:func:`jax_flash.flash_attention_varlen`, decode steps (`Decode`) through
:func:`jax_flash.paged_attention`. Decode steps rotate q and k inside the cache write, which reads
the fused projection's packed rows (:func:`jax_flash.append_qkv`: one kernel, the same bits as
slicing, apply_rope then append_kv); prefill needs the rotated keys for its own attention, so it
rotates with :func:`jax_flash.apply_rope` and then appends. `Mixed` packs a serving step's decode
tokens and prompt chunks on one token axis (:mod:`jax_flash.serve`). `Dense` runs the same layer
over a dense ``[B, S_max, Hkv, D]`` cache with :func:`jax.nn.dot_product_attention`, the baseline
the end-to-end benchmark compares against.

The cache state (`KVCache`: pages of every layer, block tables, lengths) is a pytree of device
arrays, so a jitted decode step or loop takes it as a donated argument and updates it in place.

`TensorParallel` says how a layer's activations and the cache lie on a mesh for tensor
parallelism (heads split over the mesh's tensor axis); `Attention` pins its q/k/v, attention
output and cache pages to that layout when it has one.

`NoCache` and `PackedNoCache` run whole sequences with no cache at all (training, scoring):
causal attention through :func:`jax_flash.flash_attention` (``[B, S]`` rows) or
:func:`jax_flash.flash_attention_varlen` (packed sequences); every op on that path is
differentiable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .ops.flash_attention import flash_attention, flash_attention_varlen
from .ops.kv_cache import append_kv, append_qkv, slot_mapping
from .ops.paged_attention import paged_attention
from .ops.rope import apply_rope

IMPLEMENTATIONS = (None, "cpu", "cuda", "xla")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel layout of a decoder on a mesh: attention heads, KV heads and MLP
    columns split over the mesh axis ``axis``; the residual stream, norms, block tables and
    lengths replicated. Hashable (a static attribute of the layers under ``jit``).

    Every other axis of the mesh must have size 1: the paged cache is one page pool shared by
    all rows, so batch rows cannot be split over devices without a pool per device. The layout
    uses the mesh's devices with its axes as ``AxisType.Auto`` (whatever types it was made
    with, ``jax.make_mesh`` defaulting to Explicit): the layers constrain what must lie where
    and XLA propagates the rest.
    """

    mesh: Mesh
    axis: str = "tensor"

    def __post_init__(self):
        auto = (AxisType.Auto,) * len(self.mesh.axis_names)
        object.__setattr__(
            self, "mesh", Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=auto)
        )
        if self.axis not in self.mesh.shape:
            raise ValueError(
                f"TensorParallel: mesh axes {tuple(self.mesh.shape)} have no axis {self.axis!r}"
            )
        others = {a: n for a, n in self.mesh.shape.items() if a != self.axis and n != 1}
        if others:
            raise ValueError(
                f"TensorParallel: mesh axes other than {self.axis!r} must have size 1, got "
                f"{others} (batch sharding of the shared page pool is not supported)"
            )

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def sharding(self, ndim: int, split: int | None = None) -> NamedSharding:
        """``ndim`` axes, axis ``split`` (negative counts from the end) over the tensor axis;
        None: replicated."""
        spec = [None] * ndim
        if split is not None:
            spec[split] = self.axis
        return NamedSharding(self.mesh, P(*spec))

    def constrain(self, x, split: int | None = None):
        return jax.lax.with_sharding_constraint(x, self.sharding(x.ndim, split))

    def heads(self, x):
        """``[..., H, D]`` split on heads: q/k/v, attention outputs, cache pages."""
        return self.constrain(x, -2)

    def check_divides(self, name: str, n: int) -> None:
        """Raise unless ``n`` (the size called ``name``) splits evenly over the tensor axis."""
        if n % self.size:
            raise ValueError(
                f"tensor parallelism: {name} {n} must be divisible by the size {self.size} of "
                f"mesh axis {self.axis!r}"
            )


class FusedLinear(nnx.Module):
    """Several linear projections of one input as one matmul: kernel ``[in, *out_shape]``,
    bias ``out_shape``, output ``[..., *out_shape]``.

    A decode step at small batch reads every weight once per token; one matmul over the
    concatenated weights (q/k/v; the MLP's gate and up) reads the input once and launches one
    kernel instead of one per projection. The numerics are `nnx.Linear`'s: input, kernel and
    bias cast to ``dtype``, ``lax.dot_general`` at default precision, the bias added after.
    The kernel is initialised as `nnx.Linear`'s (LeCun normal over the fan-in ``in``).
    """

    def __init__(
        self,
        in_features: int,
        out_shape: Sequence[int],
        *,
        use_bias: bool,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.out_shape = tuple(int(n) for n in out_shape)
        shape = (in_features, *self.out_shape)
        init = nnx.initializers.lecun_normal(in_axis=0, out_axis=tuple(range(1, len(shape))))
        self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype))
        self.bias = (
            nnx.Param(jnp.zeros(self.out_shape, param_dtype)) if use_bias else nnx.data(None)
        )
        self.dtype = dtype

    def __call__(self, x):
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


# Decode steps of jax_flash's drivers (`jax_flash.models.generate`, the serving engine) run at
# least this many rows, padding with inactive ones: a one-row step pays `project`'s padding
# kernel per projection (four a layer), which a two-row step does not need; the inactive row
# costs less (a 1.24B model at batch 1, 2k context, H200: 852-863 -> 902-908 tokens/s, the same
# tokens; benchmarks/results/decode_two_rows_ab_NVIDIA_H200_20261128T0840.json).
MIN_DECODE_ROWS = 2


def project(linear, x):
    """``linear(x)`` (an `nnx.Linear` or `FusedLinear` on the last axis of ``x``), with a single
    row computed as a two-row matrix product, the second row zero and dropped.

    XLA on GPU rewrites a small vector-matrix product into an elementwise multiply and a
    reduction (seen for a batch-1 decode step's q/k/v and o projections of a 1B model, 6.3M and
    4.2M multiply-adds; its 16.8M and 33.5M MLP products stayed GEMMs). For a kernel
    contracted on its major axis (o_proj, ``[in, out]``) that writes the whole product to
    memory and reads it back, three times the weight's bytes, and the products are rounded to
    the compute dtype before the sum. Two rows keep the call a GEMM; the padding row costs
    nothing the weight read does not. Other shapes pass through."""
    lead = x.shape[:-1]
    if math.prod(lead) != 1:
        return linear(x)
    row = x.reshape(1, x.shape[-1])
    y = linear(jnp.concatenate([row, jnp.zeros_like(row)]))[:1]
    return y.reshape(*lead, *y.shape[1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Paged KV cache of a whole decoder, a pytree that ``jit`` can donate.

    Attributes
    ----------
    k_pages, v_pages : tuple (one per layer) of ``[num_pages, page_size, Hkv, D]`` arrays.
    block_tables : int32 ``[B, max_pages]``: token ``t`` of row ``b`` lives in page
        ``block_tables[b, t // page_size]`` at offset ``t % page_size``.
    kv_lens : int32 ``[B]``: tokens cached per row.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    kv_lens: jax.Array

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @classmethod
    def create(
        cls,
        num_layers,
        num_pages,
        page_size,
        num_kv_heads,
        head_dim,
        block_tables,
        dtype,
        parallel: TensorParallel | None = None,
    ) -> KVCache:
        """A zeroed cache with the given block tables ``[B, max_pages]`` and empty rows; with
        ``parallel``, created on its mesh: pages split on KV heads (each device allocates only
        its own heads), block tables and lengths replicated."""
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        pages, table, lens = None, None, None
        if parallel is not None:
            parallel.check_divides("num_key_value_heads", num_kv_heads)
            pages, table, lens = (
                parallel.sharding(4, -2),
                parallel.sharding(2),
                parallel.sharding(1),
            )
        block_tables = jnp.asarray(block_tables, jnp.int32)
        if table is not None:
            block_tables = jax.device_put(block_tables, table)
        return cls(
            k_pages=tuple(jnp.zeros(shape, dtype, device=pages) for _ in range(num_layers)),
            v_pages=tuple(jnp.zeros(shape, dtype, device=pages) for _ in range(num_layers)),
            block_tables=block_tables,
            kv_lens=jnp.zeros((block_tables.shape[0],), jnp.int32, device=lens),
        )

    def layers(self):
        """The per-layer ``(k_pages, v_pages)`` pairs."""
        return tuple(zip(self.k_pages, self.v_pages, strict=True))

    def replace(self, **changes) -> KVCache:
        return dataclasses.replace(self, **changes)


class PageAllocator:
    """Host-side free list of cache pages. Page 0 is reserved as the null page, the id that
    unused block-table entries hold; it is never handed out.

    >>> pool = PageAllocator(8)
    >>> pool.allocate(3), pool.num_free
    ([1, 2, 3], 4)
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(
                f"PageAllocator: need at least 2 pages (page 0 is null), got {num_pages}"
            )
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"PageAllocator: {n} pages requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(list(pages)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoCache:
    """Whole sequences ``[B, S]``, each from position 0, attended causally with
    :func:`jax_flash.flash_attention` and no cache (training, scoring).

    Attributes
    ----------
    lengths : int32 ``[B]`` or None: valid tokens per row (right padding; rows at or past
        ``lengths[b]`` give zeros). None: every row is full.
    """

    lengths: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedNoCache:
    """Packed sequences ``[T]``, each from position 0, attended causally with
    :func:`jax_flash.flash_attention_varlen` and no cache (training, scoring).

    Attributes
    ----------
    cu_seqlens : int32 ``[B + 1]``: sequence ``b`` owns packed rows ``cu[b]:cu[b+1]``; rows
        past ``cu[B]`` are padding (zeros).
    """

    cu_seqlens: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
    """Packed prompts written into an empty paged cache and attended with
    :func:`jax_flash.flash_attention_varlen`.

    Attributes
    ----------
    cu_seqlens : int32 ``[B + 1]``: prompt ``b`` owns packed rows ``cu[b]:cu[b+1]``.
    slots : int32 ``[T]``: cache slot of every packed row (-1: padding, not written).
    """

    cu_seqlens: jax.Array
    slots: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decode:
    """New tokens appended to a paged cache and attended with :func:`jax_flash.paged_attention`.

    Attributes
    ----------
    block_tables : int32 ``[B, max_pages]``.
    kv_lens : int32 ``[B]``: cached tokens per row *after* this step's append.
    slots : int32 ``[B]`` (one token per row) or ``[B, S]``; -1 = not written.
    """

    block_tables: jax.Array
    kv_lens: jax.Array
    slots: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
    """A step over a dense cache ``[B, S_max, Hkv, D]`` with :func:`jax.nn.dot_product_attention`.

    With ``S > 1`` new tokens per row the step is a prefill into an empty cache (causal among
    the new tokens); with ``S == 1`` it appends at ``lens`` and attends to the whole row.

    Attributes
    ----------
    lens : int32 ``[B]``: cached tokens per row before this step.
    new_lens : int32 ``[B]``: valid new tokens per row (the rest of the S are padding).
    implementation : static; ``jax.nn.dot_product_attention``'s ("xla", "cudnn" or None).
    """

    lens: jax.Array
    new_lens: jax.Array
    implementation: str | None = dataclasses.field(default=None, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mixed:
    """One serving step: decode rows (one new token each) and prompt chunks (up to ``chunk`` new
    tokens each) packed on one token axis, appended to a paged cache and attended with
    :func:`jax_flash.paged_attention` (a chunk continues a prompt whose earlier tokens are
    already cached).

    The packed axis holds ``num_decode`` decode tokens, then ``R - num_decode`` chunk rows of
    ``chunk`` places each. A chunk of ``n < chunk`` tokens fills the last ``n`` places of its
    row (the places before are padding: not written, their outputs meaningless), so every row's
    last token sits at a fixed place and the causal rule of a multi-token paged query (query
    ``i`` sees positions ``<= kv_len - chunk + i``) is right for the real tokens.

    Attributes
    ----------
    block_tables : int32 ``[R, max_pages]``: the decode rows', then the chunk rows'.
    kv_lens : int32 ``[R]``: cached tokens per row after this step's append (0: unused row).
    slots : int32 ``[T]``, ``T = num_decode + (R - num_decode) * chunk``; -1 = not written.
    num_decode, chunk : static.
    """

    block_tables: jax.Array
    kv_lens: jax.Array
    slots: jax.Array
    num_decode: int = dataclasses.field(metadata={"static": True})
    chunk: int = dataclasses.field(metadata={"static": True})

    def last_tokens(self):
        """Packed indices ``[R]`` of every row's last place (whose logits a step samples)."""
        d, c = self.num_decode, self.chunk
        rows = self.kv_lens.shape[0] - d
        return np.concatenate([np.arange(d), d + c * np.arange(rows) + c - 1]).astype(np.int32)


def _check_impl(attention_impl):
    if attention_impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention_impl must be one of {IMPLEMENTATIONS} (None = jax_flash kernels, "
            f"'xla' = the pure-XLA reference path of the same ops), got {attention_impl!r}"
        )


class Attention(nnx.Module):
    """Multi-head attention with GQA and RoPE over a paged (or dense) KV cache.

    Parameters
    ----------
    hidden_size, num_heads, num_kv_heads : ints, ``num_heads % num_kv_heads == 0``.
    head_dim : int, default ``hidden_size // num_heads``.
    qkv_bias, o_bias : biases of the q/k/v and of the output projections (Qwen2: True, False).
    rope_theta, rope_scaling, rotary_dim : RoPE as :func:`jax_flash.apply_rope` ("neox" style,
        the Hugging Face ``rotate_half``); ``rope_scaling`` is a ``config.json`` ``rope_scaling``
        dict (linear or llama3) or None.
    sliding_window : int or None
        Mistral-style: a token sees the last ``sliding_window`` tokens, itself included.
    softmax_scale : float, default ``head_dim ** -0.5``.
    attention_impl : None, "cpu", "cuda" or "xla"
        Passed as ``implementation`` to every jax_flash op the layer calls (RoPE, cache append,
        prefill and decode attention): None runs jax_flash's kernels, "xla" the pure-XLA
        reference path of the same ops.
    dtype, param_dtype : compute and parameter dtypes.

    ``qkv_proj`` projects q, k and v in one matmul, kernel ``[hidden, Hkv, G + 2, D]`` (``G =
    num_heads // num_kv_heads``; bias ``[Hkv, G + 2, D]``): KV head ``g`` holds its ``G`` query
    heads (query head ``g * G + j`` at ``[:, g, j]``), then its k (``[:, g, G]``), then its v
    (``[:, g, G + 1]``). ``o_proj`` is an ``nnx.Linear``, kernel ``[H * D, hidden]``. Hugging
    Face ``Linear.weight`` tensors are ``[out, in]``: :func:`jax_flash.models.hf_parameters`
    maps them in and out of this layout.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
        sliding_window: int | None = None,
        softmax_scale: float | None = None,
        attention_impl: str | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(
                f"Attention: num_heads {num_heads} must be a multiple of num_kv_heads "
                f"{num_kv_heads}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(
                f"Attention: sliding_window must be >= 1 or None, got {sliding_window}"
            )
        _check_impl(attention_impl)
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = float(rope_theta)
        # A tuple of items: module attributes that are not arrays must be hashable (jit statics).
        self.rope_scaling = None if rope_scaling is None else tuple(sorted(rope_scaling.items()))
        self.rotary_dim = rotary_dim
        self.sliding_window = sliding_window
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.attention_impl = attention_impl
        self.parallel: TensorParallel | None = None
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # Grouped by KV head, not [all q | all k | all v]: a tensor-parallel split of the Hkv
        # axis then hands each device whole groups, its query heads with the k and v they read,
        # as column-parallel q/k/v projections split by heads did (no collective added), and
        # the split does not depend on the number of devices.
        group = num_heads // num_kv_heads
        self.qkv_proj = FusedLinear(
            hidden_size, (num_kv_heads, group + 2, head_dim), use_bias=qkv_bias, **linear
        )
        self.o_proj = nnx.Linear(num_heads * head_dim, hidden_size, use_bias=o_bias, **linear)

    def set_attention_impl(self, attention_impl: str | None) -> None:
        _check_impl(attention_impl)
        self.attention_impl = attention_impl

    def set_parallel(self, parallel: TensorParallel | None) -> None:
        """Pin q/k/v (and their fused projection's output, split on its KV-head axis), the
        attention output and the cache pages to ``parallel``'s head split (None: no
        constraint). The projections' kernels are placed by the caller
        (:func:`jax_flash.models.shard_model`)."""
        if parallel is not None:
            parallel.check_divides("num_key_value_heads", self.num_kv_heads)
        self.parallel = parallel

    def _heads(self, *xs):
        if self.parallel is None:
            return xs
        return tuple(self.parallel.heads(x) for x in xs)

    def _window(self):
        return None if self.sliding_window is None else (self.sliding_window - 1, None)

    def _rope_options(self) -> dict:
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        return dict(
            style="neox", rotary_dim=self.rotary_dim, theta=self.rope_theta, scaling=scaling
        )

    def _rope(self, x, positions):
        return apply_rope(x, positions, **self._rope_options(), implementation=self.attention_impl)

    def __call__(self, x, positions, kv, batch):
        """Attention of new tokens, with their k/v appended to the cache.

        Parameters
        ----------
        x : ``[T, hidden]`` packed rows (`Prefill`, `PackedNoCache`), ``[B, hidden]`` or
            ``[B, S, hidden]`` (`Decode`, `Dense`, `NoCache`).
        positions : int32 like ``x`` without the last axis: each token's position (RoPE).
        kv : ``(k_pages, v_pages)`` of this layer (``[B, S_max, Hkv, D]`` caches for `Dense`;
            None for `NoCache` / `PackedNoCache`).
        batch : `Prefill`, `Decode`, `Dense`, `NoCache` or `PackedNoCache`.

        Returns
        -------
        ``(y like x, (k_pages, v_pages))`` (None for the cache-free batches).
        """
        lead = x.shape[:-1]
        qkv = project(self.qkv_proj, x)  # [*lead, Hkv, G + 2, D]
        if self.parallel is not None:
            qkv = self.parallel.constrain(qkv, -3)
        impl = self.attention_impl
        if isinstance(batch, Decode):
            # The decode step reads k from the cache only: RoPE of q and k fused into the cache
            # write, which reads the projection's packed rows as they are (one kernel; the same
            # bits as slicing, apply_rope then append_kv).
            q_rot, k_pages, v_pages = append_qkv(
                *kv,
                qkv.reshape(-1, *qkv.shape[-3:]),
                batch.slots.reshape(-1),
                jnp.broadcast_to(jnp.asarray(positions), lead).reshape(-1),
                rope=self._rope_options(),
                implementation=impl,
            )
            (q_rot,) = self._heads(q_rot)
            k_pages, v_pages = self._heads(k_pages, v_pages)
            o = paged_attention(
                q_rot.reshape(*lead, self.num_heads, self.head_dim),
                k_pages,
                v_pages,
                batch.block_tables,
                batch.kv_lens,
                causal=True,
                softmax_scale=self.softmax_scale,
                sliding_window=self._window(),
                implementation=impl,
            )
            return self._out(o, lead), (k_pages, v_pages)
        if isinstance(batch, Mixed):
            return self._mixed(qkv, positions, kv, batch)
        group = self.num_heads // self.num_kv_heads
        q = qkv[..., :group, :].reshape(*lead, self.num_heads, self.head_dim)
        q, k, v = self._heads(q, qkv[..., group, :], qkv[..., group + 1, :])
        heads = (-1, self.num_kv_heads, self.head_dim)
        # Prefill attends to the rotated k itself (not through the cache): rotate, then append.
        q, k = self._rope(q, positions), self._rope(k, positions)
        if isinstance(batch, (NoCache, PackedNoCache)):
            return self._out(self._attend_no_cache(q, k, v, batch), lead), None
        if isinstance(batch, Dense):
            o, kv = self._dense(q, k, v, kv, batch)
        else:
            k_pages, v_pages = append_kv(
                *kv,
                k.reshape(heads),
                v.reshape(heads),
                batch.slots.reshape(-1),
                implementation=impl,
            )
            kv = self._heads(k_pages, v_pages)
            if isinstance(batch, Prefill):
                o = flash_attention_varlen(
                    q,
                    k,
                    v,
                    batch.cu_seqlens,
                    batch.cu_seqlens,
                    causal=True,
                    softmax_scale=self.softmax_scale,
                    sliding_window=self._window(),
                    implementation=impl,
                )
            else:
                raise TypeError(f"Attention: batch must be Prefill, Decode or Dense, got {batch!r}")
        return self._out(o, lead), kv

    def _mixed(self, qkv, positions, kv, batch: Mixed):
        """A `Mixed` step: RoPE fused into the cache write from the packed q/k/v rows (as a
        decode step), then the decode rows' one-token queries and the chunk rows' ``[chunk]``
        queries attend separately."""
        impl = self.attention_impl
        q_rot, k_pages, v_pages = append_qkv(
            *kv,
            qkv,
            batch.slots,
            positions,
            rope=self._rope_options(),
            implementation=impl,
        )
        (q_rot,) = self._heads(q_rot)
        k_pages, v_pages = self._heads(k_pages, v_pages)
        d, c = batch.num_decode, batch.chunk
        attend = functools.partial(
            paged_attention,
            k_pages=k_pages,
            v_pages=v_pages,
            causal=True,
            softmax_scale=self.softmax_scale,
            sliding_window=self._window(),
            implementation=impl,
        )
        parts = []
        if d:
            parts.append(
                attend(q_rot[:d], block_tables=batch.block_tables[:d], kv_lens=batch.kv_lens[:d])
            )
        if q_rot.shape[0] > d:
            chunks = q_rot[d:].reshape(-1, c, self.num_heads, self.head_dim)
            o = attend(chunks, block_tables=batch.block_tables[d:], kv_lens=batch.kv_lens[d:])
            parts.append(o.reshape(-1, self.num_heads, self.head_dim))
        o = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return self._out(o, qkv.shape[:1]), (k_pages, v_pages)

    def _out(self, o, lead):
        """The output projection of the attention output ``o`` (``[*lead, H, D]``); cast back
        to the compute dtype because a tensor-parallel o_proj sums its per-device partial
        products in float32 (:func:`jax_flash.models.shard_model`)."""
        (o,) = self._heads(o)
        o = o.reshape(*lead, self.num_heads * self.head_dim)
        y = project(self.o_proj, o).astype(o.dtype)
        return y if self.parallel is None else self.parallel.constrain(y)

    def _attend_no_cache(self, q, k, v, batch):
        """Causal attention of whole sequences among themselves (no cache read or written)."""
        options = dict(
            causal=True,
            softmax_scale=self.softmax_scale,
            sliding_window=self._window(),
            implementation=self.attention_impl,
        )
        if isinstance(batch, PackedNoCache):
            cu = batch.cu_seqlens
            return flash_attention_varlen(q, k, v, cu, cu, **options)
        lens = batch.lengths
        return flash_attention(q, k, v, q_seqlens=lens, kv_seqlens=lens, **options)

    def _dense(self, q, k, v, kv, batch: Dense):
        k_cache, v_cache = kv
        if q.ndim == 3:  # one token per row
            q, k, v = q[:, None], k[:, None], v[:, None]
        attend = dict(scale=self.softmax_scale, implementation=batch.implementation)
        if q.shape[1] > 1:  # prefill into an empty cache
            k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
            window = None if self.sliding_window is None else (self.sliding_window - 1, 0)
            o = jax.nn.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                query_seq_lengths=batch.new_lens,
                key_value_seq_lengths=batch.new_lens,
                local_window_size=window,
                **attend,
            )
        else:
            if self.sliding_window is not None:
                raise NotImplementedError("Attention: Dense decode steps take no sliding window")
            rows = jnp.arange(q.shape[0])
            # Inactive rows write past the end of the cache: dropped.
            pos = jnp.where(batch.new_lens > 0, batch.lens, k_cache.shape[1])
            k_cache = k_cache.at[rows, pos].set(k[:, 0].astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[rows, pos].set(v[:, 0].astype(v_cache.dtype), mode="drop")
            o = jax.nn.dot_product_attention(
                q, k_cache, v_cache, key_value_seq_lengths=batch.lens + batch.new_lens, **attend
            )
        return o, (k_cache, v_cache)


def packed_positions(cu_seqlens, num_tokens: int):
    """Of ``num_tokens`` packed rows (sequence ``b`` at ``cu_seqlens[b]:cu_seqlens[b+1]``): each
    row's sequence ``[T]``, its position in that sequence ``[T]``, and whether it belongs to a
    sequence ``[T]`` (rows before ``cu[0]`` or past ``cu[B]`` do not)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    B = cu.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, B - 1)
    valid = (t >= cu[0]) & (t < cu[B])
    return seq, t - cu[seq], valid


def prefill_batch(cache: KVCache, cu_seqlens, num_tokens: int, rows=None):
    """Positions ``[T]`` and the `Prefill` batch of packed prompts written to cache rows ``rows``
    (default ``0..B-1``), each from position 0. Rows past ``cu_seqlens[B]`` are padding."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    B = cu.shape[0] - 1
    rows = jnp.arange(B, dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
    seq, positions, valid = packed_positions(cu, num_tokens)
    slots = slot_mapping(cache.block_tables[rows[seq]], positions, cache.page_size, valid)
    return jnp.where(valid, positions, 0), Prefill(cu, slots)


def decode_batch(cache: KVCache, num_new: int, active=None):
    """Positions ``[B, num_new]``, the `Decode` batch of ``num_new`` tokens per row appended at
    ``kv_lens``, and the new lengths. Inactive rows (``active[b]`` False) are not written and
    keep their length."""
    B = cache.kv_lens.shape[0]
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    positions = cache.kv_lens[:, None] + jnp.arange(num_new, dtype=jnp.int32)
    valid = jnp.broadcast_to(active[:, None], positions.shape)
    slots = slot_mapping(cache.block_tables, positions, cache.page_size, valid)
    kv_lens = cache.kv_lens + jnp.where(active, num_new, 0).astype(jnp.int32)
    return positions, Decode(cache.block_tables, kv_lens, slots), kv_lens


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def block_table(rows: Sequence[Sequence[int]], max_pages: int | None = None) -> np.ndarray:
    """An int32 ``[B, max_pages]`` block table from per-row page lists, padded with the null
    page 0."""
    width = max((len(r) for r in rows), default=0) if max_pages is None else max_pages
    out = np.zeros((len(rows), max(width, 1)), np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out
