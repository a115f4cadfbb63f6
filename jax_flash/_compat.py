"""Every version-dependent JAX import of jax_flash, in one place.

Supported: jax/jaxlib >= 0.10.0 (tested with 0.10.2 on CPU and 0.11.2 with CUDA 13).
"""

import jax
from jax import ffi
from jax._src import core as jax_core
from jax._src import dispatch, sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec

ShapedArray = jax.core.ShapedArray

# The batch dimension a batching rule receives for an operand that vmap does not map.
NOT_MAPPED = None


def mark_needs_devices(p: Primitive) -> None:
    """Lower `p` with the device assignment known: custom_partitioning (which p's lowering
    emits under a mesh) needs it, and jit passes it only for primitives in this set."""
    dispatch.prim_requires_devices_during_lowering.add(p)


def lowering_needs_partitioning(ctx) -> bool:
    """Whether a lowering runs for several devices with automatic (partitioner-decided)
    shardings on a named mesh. Not on one device, and not inside shard_map, whose body is
    lowered per device (and a partly manual shard_map runs the kernel replicated over its
    automatic axes: custom_partitioning does not take partly manual contexts)."""
    ac = ctx.module_context.axis_context
    return (
        isinstance(ac, sharding_impls.ShardingContext)
        and ac.num_devices > 1
        and ac.abstract_mesh is not None
        and not ac.abstract_mesh.empty
    )


def explicit_axes(avals):
    """(abstract mesh, its explicitly sharded axis names) of the first operand typed on a mesh
    with explicit axes (`AxisType.Explicit`), else (None, frozenset())."""
    for a in avals:
        mesh = getattr(getattr(a, "sharding", None), "mesh", None)
        if mesh is None or mesh.empty:
            continue
        names = frozenset(
            n
            for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if t == AxisType.Explicit
        )
        if names:
            return mesh, names
    return None, frozenset()


def varying_axes(aval) -> frozenset:
    """The manual mesh axes (inside shard_map) over which `aval` may vary."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def with_varying_axes(aval, axes: frozenset):
    """`aval` typed as varying over the manual mesh axes `axes` too."""
    mat = getattr(aval, "manual_axis_type", None)
    if not axes or mat is None or axes <= mat.varying:
        return aval
    if aval.sharding.mesh.empty:  # the manual axes belong to the mesh being traced
        aval = aval.update(sharding=jax_core.get_cur_mesh_sharding())
    return aval.update(manual_axis_type=mat.update(varying=mat.varying | axes))


def tensor_shape(ir_type) -> tuple[int, ...]:
    """The shape of an MLIR ranked tensor type (custom_partitioning's sharding_rule callback)."""
    return tuple(mlir.ir.RankedTensorType(ir_type).shape)


__all__ = [
    "NOT_MAPPED",
    "NamedSharding",
    "PartitionSpec",
    "Primitive",
    "ShapedArray",
    "batching",
    "custom_partitioning",
    "explicit_axes",
    "ffi",
    "lowering_needs_partitioning",
    "mark_needs_devices",
    "mlir",
    "tensor_shape",
    "varying_axes",
    "with_varying_axes",
]
