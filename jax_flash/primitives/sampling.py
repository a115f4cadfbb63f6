"""The sampling primitives: `jax_flash_sample` and `jax_flash_top_k_top_p_filter`.

    operands  logits [B,V] float32 | float16 | bfloat16, temperature [B] float32,
              top_k [B] int32, top_p [B] float32, min_p [B] float32,
              seeds [B,3] uint32 (sample only: Philox key words and the row's stream)
    results   sample: tokens [B] int32; filter: masked logits [B,V] (dtype of logits)

Semantics (order, fixed-point masses, Gumbel-max draw, bit-identical CPU and CUDA decisions):
cuda/include/jax_flash/sampling_params.h.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .. import reference
from .._compat import NOT_MAPPED, ShapedArray, batching
from ._common import make_primitive, register_lowerings
from .partitioning import Partitioning, make_rule


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    implementation: str | None


sample_p = make_primitive("jax_flash_sample")
top_k_top_p_filter_p = make_primitive("jax_flash_top_k_top_p_filter")


def _sample_abstract(logits, temperature, top_k, top_p, min_p, seeds, *, config):
    del temperature, top_k, top_p, min_p, seeds, config
    return (ShapedArray(logits.shape[:1], jnp.int32),)


def _filter_abstract(logits, temperature, top_k, top_p, min_p, *, config):
    del temperature, top_k, top_p, min_p, config
    return (ShapedArray(logits.shape, logits.dtype),)


sample_p.def_abstract_eval(_sample_abstract)
top_k_top_p_filter_p.def_abstract_eval(_filter_abstract)


def _no_attrs(config: SamplingConfig) -> dict:
    del config
    return {}


def _sample_reference(logits, temperature, top_k, top_p, min_p, seeds, *, config):
    del config
    return [reference.sample(logits, seeds, temperature, top_k, top_p, min_p)]


def _filter_reference(logits, temperature, top_k, top_p, min_p, *, config):
    del config
    return [reference.top_k_top_p_filter(logits, temperature, top_k, top_p, min_p)]


# Rows are independent (each row's stream is in its seeds, so a shard of rows draws what the
# whole batch draws); a row's vocabulary (ranked and filtered as a whole) and seeds stay whole.
def _sample_rule(config, shapes_in, shapes_out):
    del config
    ops = ["b v", "b", "b", "b", "b", "b r"]
    return make_rule(ops, ["b"], shapes_in, shapes_out, whole=("v", "r"))


def _filter_rule(config, shapes_in, shapes_out):
    del config
    ops = ["b v", "b", "b", "b", "b"]
    return make_rule(ops, ["b v"], shapes_in, shapes_out, whole=("v",))


register_lowerings(
    sample_p, "sample", _no_attrs, _sample_reference, partitioning=Partitioning(_sample_rule)
)
register_lowerings(
    top_k_top_p_filter_p, "top_k_top_p_filter", _no_attrs, _filter_reference,
    partitioning=Partitioning(_filter_rule),
)  # fmt: skip


def _batcher(p):
    # Rows of every instance are independent: fold the mapped axis into B. Seeds keep each
    # instance's row ids, so a vmapped call draws what the separate calls draw.
    def batch(args, dims, *, config):
        size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not NOT_MAPPED)
        moved = [
            jnp.broadcast_to(x, (size,) + x.shape) if d is NOT_MAPPED else jnp.moveaxis(x, d, 0)
            for x, d in zip(args, dims, strict=True)
        ]
        (out,) = p.bind(*(x.reshape(-1, *x.shape[2:]) for x in moved), config=config)
        return [out.reshape(size, -1, *out.shape[1:])], [0]

    return batch


batching.primitive_batchers[sample_p] = _batcher(sample_p)
batching.primitive_batchers[top_k_top_p_filter_p] = _batcher(top_k_top_p_filter_p)
