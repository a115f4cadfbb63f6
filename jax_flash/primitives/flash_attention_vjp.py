"""Reverse-mode differentiation of `jax_flash_attention`: `flash_attention_packed`, the
differentiable form of the forward's bind, which the ops call.

A `jax.custom_vjp` around the bind. Residuals are q, k, v, the forward's o and lse, and the int32
starts/ends (O(S) memory: the backward recomputes the probabilities from lse, never keeping
[Sq, Skv]); the cotangents of o and lse flow into `jax_flash_attention_bwd` as do and dlse (JAX
passes zeros for one that is symbolically zero, e.g. dlse when lse is not used). The starts/ends
get no cotangent.

Everything composes through JAX's handling of custom_vjp: jit, vmap (the forward and backward
primitives' batching rules), checkpoint/remat, shard_map (each device binds both primitives on
its shard), and meshes (each primitive lowers to its own custom_partitioning).

This lives in its own module because it binds both primitives: the backward's module imports
the forward's (FlashConfig, the attributes, the sharding rule's pieces), and the forward
primitive stays free of the backward.
"""

from __future__ import annotations

from functools import partial

import jax

from .flash_attention import FlashConfig, flash_attention_p
from .flash_attention_bwd import flash_attention_bwd_p


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, q_starts, q_ends, k_starts, k_ends, config):
    o, lse = flash_attention_p.bind(q, k, v, q_starts, q_ends, k_starts, k_ends, config=config)
    return o, lse


def _forward(q, k, v, q_starts, q_ends, k_starts, k_ends, config):
    o, lse = flash_attention_p.bind(q, k, v, q_starts, q_ends, k_starts, k_ends, config=config)
    return (o, lse), (q, k, v, o, lse, q_starts, q_ends, k_starts, k_ends)


def _backward(config, residuals, cotangents):
    q, k, v, o, lse, q_starts, q_ends, k_starts, k_ends = residuals
    do, dlse = cotangents
    dq, dk, dv = flash_attention_bwd_p.bind(
        q, k, v, o, lse, do, dlse, q_starts, q_ends, k_starts, k_ends,
        config=config,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_forward, _backward)


def flash_attention_packed(q, k, v, q_starts, q_ends, k_starts, k_ends, *, config: FlashConfig):
    """(o [Tq,Hq,Dv], lse [Hq,Tq] float32) of `jax_flash_attention` (operands as there),
    differentiable in q, k and v."""
    return _attention(q, k, v, q_starts, q_ends, k_starts, k_ends, config)
