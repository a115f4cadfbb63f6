"""The `jax_flash_apply_rope` primitive: rotary position embeddings.

    operands  x [T,H,D] float32 | float16 | bfloat16, positions [T] int32
    results   out [T,H,D] (dtype of x)
    attrs     style (0 NeoX, 1 GPT-J), rotary_dim, inv_freq [rotary_dim // 2] float32

inv_freq is static (it comes from theta and the frequency scaling, Python values): it lives in
the config and reaches the kernels as an FFI attribute, so vmap never has to batch it.
Semantics: cuda/include/jax_flash/rope_params.h.

Differentiation (w.r.t. x): RoPE is linear in x, so its JVP is RoPE of the tangent, and its
transpose is the inverse rotation, RoPE at the negated positions (the kernels take any position;
the angle ``-pos * inv_freq`` is the exact negation of ``pos * inv_freq``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .. import reference
from .._compat import NOT_MAPPED, ShapedArray, ad, batching
from ._common import make_primitive, register_lowerings
from .partitioning import Partitioning, make_rule

STYLES = {"neox": 0, "gptj": 1}
MAX_ROTARY_DIM = 512  # rope_params.h: kMaxRotaryDim


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    style: str  # "neox" | "gptj"
    rotary_dim: int
    inv_freq: tuple[float, ...]  # float32 values
    implementation: str | None


rope_p = make_primitive("jax_flash_apply_rope")


def _abstract_eval(x, positions, *, config):
    del positions, config
    return (ShapedArray(x.shape, x.dtype),)


rope_p.def_abstract_eval(_abstract_eval)


def _attrs(config: RopeConfig) -> dict:
    return {
        "style": np.int32(STYLES[config.style]),
        "rotary_dim": np.int32(config.rotary_dim),
        "inv_freq": np.asarray(config.inv_freq, np.float32),
    }


def _reference(x, positions, *, config):
    inv_freq = np.asarray(config.inv_freq, np.float32)
    return [
        reference.apply_rope(
            x, positions, inv_freq, style=config.style, rotary_dim=config.rotary_dim
        )
    ]


def _rule(config, shapes_in, shapes_out):
    # Tokens and heads are independent; a head's features are rotated together.
    del config
    return make_rule(["t h d", "t"], ["t h d"], shapes_in, shapes_out, whole=("d",))


register_lowerings(rope_p, "apply_rope", _attrs, _reference, partitioning=Partitioning(_rule))


def _batch(args, dims, *, config):
    # Tokens of every instance are independent rows: fold the mapped axis into T.
    x, positions = args
    xd, pd = dims
    size = x.shape[xd] if xd is not NOT_MAPPED else positions.shape[pd]
    xm = jnp.broadcast_to(x, (size,) + x.shape) if xd is NOT_MAPPED else jnp.moveaxis(x, xd, 0)
    pm = (
        jnp.broadcast_to(positions, (size,) + positions.shape)
        if pd is NOT_MAPPED
        else jnp.moveaxis(positions, pd, 0)
    )
    (out,) = rope_p.bind(xm.reshape(-1, *xm.shape[2:]), pm.reshape(-1), config=config)
    return [out.reshape(xm.shape)], [0]


batching.primitive_batchers[rope_p] = _batch


def _jvp(primals, tangents, *, config):
    x, positions = primals
    tx, _ = tangents  # positions are integers: no tangent
    out = rope_p.bind(x, positions, config=config)
    if isinstance(tx, ad.Zero):
        return out, [ad.Zero.from_primal_value(out[0])]
    return out, rope_p.bind(tx, positions, config=config)


def _transpose(cts, x, positions, *, config):
    (ct,) = cts
    if isinstance(ct, ad.Zero):
        return [ad.Zero(x.aval), None]
    (back,) = rope_p.bind(ct, -positions, config=config)
    return [back, None]


ad.primitive_jvps[rope_p] = _jvp
ad.primitive_transposes[rope_p] = _transpose
