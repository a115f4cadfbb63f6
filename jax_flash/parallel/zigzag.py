"""The zigzag sequence layout that balances causal attention over n devices.

The sequence is cut into 2n equal chunks; device d holds chunks d and 2n-1-d (in that order).
Under a causal mask a query's work grows with its position, so pairing an early chunk with a late
one gives every device the same work. Sharding a zigzag-ordered array in n equal blocks on the
sequence axis puts exactly those chunks on each device.

Two forms of the same permutation:

- `to_zigzag` / `from_zigzag` reorder a global array (plain jnp, any sharding): for positions
  (RoPE), tests, or a model that keeps its tokens in zigzag order from embedding to logits so the
  reorder is paid once per model instead of once per attention layer.
- `shard_to_zigzag` / `shard_from_zigzag` do it inside `jax.shard_map` on per-device blocks of a
  naturally ordered sequence, with two `ppermute`s: each device sends each half of its block
  straight to its new owner (no all-gather). The partitioned lowering of a sequence-sharded
  `flash_attention` balances a causal mask with them too (primitives/sequence_sharding.py).

`balances` says where the layout evens out the work: both uses ask it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _chunk_order(n: int) -> np.ndarray:
    """Natural chunk indices in zigzag order: 0, 2n-1, 1, 2n-2, ..."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def balances(window: tuple[int, int], seq_len: int, n: int) -> bool:
    """Does the zigzag layout balance this mask over n devices? Causal with no left window (a
    query's work grows linearly with its position, which the pairing of chunks d and 2n-1-d
    evens out) and a sequence of 2n equal chunks. ``window`` as `reference.normalize_window`
    gives it."""
    return tuple(window) == (-1, 0) and n > 1 and seq_len % (2 * n) == 0


def check_divisible(op: str, seq_len: int, n: int):
    if seq_len % (2 * n) != 0:
        raise ValueError(
            f"{op}: the zigzag layout cuts the sequence into 2 x {n} devices = {2 * n} equal "
            f"chunks, but the sequence length {seq_len} is not divisible by {2 * n}; pad it or "
            f"use layout='natural'"
        )


def _permute_chunks(x, n: int, axis: int, order: np.ndarray):
    s = x.shape[axis]
    chunks = x.reshape(*x.shape[:axis], 2 * n, s // (2 * n), *x.shape[axis + 1 :])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def to_zigzag(x, n: int, *, axis: int = 1):
    """x with its sequence axis in zigzag order for n devices.

    Parameters
    ----------
    x : Array whose axis ``axis`` has length S divisible by 2n.
    n : int, number of devices on the sequence's mesh axis.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from jax_flash.parallel import to_zigzag
    >>> to_zigzag(jnp.arange(8), 2, axis=0).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    axis = axis % x.ndim
    check_divisible("to_zigzag", x.shape[axis], n)
    return _permute_chunks(x, n, axis, _chunk_order(n))


def from_zigzag(x, n: int, *, axis: int = 1):
    """The inverse of `to_zigzag`: x's sequence axis back in natural order.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from jax_flash.parallel import from_zigzag, to_zigzag
    >>> x = jnp.arange(12)
    >>> bool((from_zigzag(to_zigzag(x, 3, axis=0), 3, axis=0) == x).all())
    True
    """
    axis = axis % x.ndim
    check_divisible("from_zigzag", x.shape[axis], n)
    return _permute_chunks(x, n, axis, np.argsort(_chunk_order(n)))


def _owner(c: int, n: int) -> int:
    """The device holding natural chunk c in the zigzag layout."""
    return c if c < n else 2 * n - 1 - c


def _even_axis(op: str, x, axis: int) -> int:
    axis = axis % x.ndim
    if x.shape[axis] % 2:
        raise ValueError(
            f"{op}: the local sequence length {x.shape[axis]} must be even (2 chunks per device)"
        )
    return axis


def _halves(x, axis: int):
    c = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, c, axis=axis), jax.lax.slice_in_dim(x, c, 2 * c, axis=axis)


def shard_to_zigzag(x, axis_name, n: int, *, axis: int = 1):
    """Inside `jax.shard_map`: the block of device d of a naturally ordered sequence (chunks 2d
    and 2d+1 of 2n) in, the zigzag block (chunks d and 2n-1-d) out; n = the size of mesh axis
    `axis_name`, the local length along `axis` even.

    Device d sends chunk 2d in one ppermute and chunk 2d+1 in another. Even chunks land on even
    devices as their first chunk and on odd devices as their second (odd chunks the other way
    round), so the receiver puts them in order by its parity.
    """
    axis = _even_axis("shard_to_zigzag", x, axis)
    first, second = _halves(x, axis)
    a = jax.lax.ppermute(first, axis_name, [(d, _owner(2 * d, n)) for d in range(n)])
    b = jax.lax.ppermute(second, axis_name, [(d, _owner(2 * d + 1, n)) for d in range(n)])
    even = jax.lax.axis_index(axis_name) % 2 == 0
    return jnp.where(even, jnp.concatenate([a, b], axis), jnp.concatenate([b, a], axis))


def shard_from_zigzag(x, axis_name, n: int, *, axis: int = 1):
    """The inverse of `shard_to_zigzag` (inside `jax.shard_map`): zigzag blocks in, natural
    blocks out; the same two transfers, reversed."""
    axis = _even_axis("shard_from_zigzag", x, axis)
    lo, hi = _halves(x, axis)
    even = jax.lax.axis_index(axis_name) % 2 == 0
    a, b = jnp.where(even, lo, hi), jnp.where(even, hi, lo)
    first = jax.lax.ppermute(a, axis_name, [(_owner(2 * d, n), d) for d in range(n)])
    second = jax.lax.ppermute(b, axis_name, [(_owner(2 * d + 1, n), d) for d in range(n)])
    return jnp.concatenate([first, second], axis)
