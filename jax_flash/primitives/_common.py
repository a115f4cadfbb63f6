"""What every jax_flash primitive shares: eager impl, platform lowerings to FFI targets, and the
jnp-reference lowering for platforms without a native kernel."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from .. import _native
from .._compat import NOT_MAPPED, Primitive, ffi, mlir
from .partitioning import Partitioning, partitioned


def make_primitive(name: str) -> Primitive:
    p = Primitive(name)
    p.multiple_results = True

    @lru_cache(maxsize=256)
    def compiled(params: tuple):
        # One jitted bind per static configuration, so repeated eager calls reuse the executable.
        return jax.jit(partial(p.bind, **dict(params)))

    def impl(*args, **params):
        # Eager calls run the same lowering as jit. Under jax.disable_jit that jit would be a
        # plain call of bind, which lands here again (endless recursion): the jit of a single
        # primitive is switched back on, as JAX does for its own primitives.
        with jax.disable_jit(False):
            return compiled(tuple(sorted(params.items())))(*args)

    p.def_impl(impl)
    return p


def register_lowerings(
    p: Primitive,
    op: str,
    attrs: Callable[..., dict],
    reference: Callable[..., list],
    check_cuda: Callable | None = None,
    aliases: dict[int, int] | None = None,
    *,
    partitioning: Partitioning,
):
    """Lower `p` to FFI targets jax_flash_<op>_{cpu,cuda}, and elsewhere to `reference`; under a
    mesh each device lowers its shard (see partitioning.py; call after def_abstract_eval).

    attrs(config) -> FFI attributes; reference(*args, config=...) -> list of results;
    check_cuda(ctx, config) -> None, or why the CUDA kernels do not take this case: then
    implementation=None runs `reference` (documented per op) and implementation="cuda" raises.
    partitioning: p's sharding rule.
    """
    sharded = partitioned(p, partitioning)

    def lower_reference_fn(ctx, *args, config):
        return mlir.lower_fun(partial(reference, config=config), multiple_results=True)(ctx, *args)

    def lowering(platform: str):
        target = ffi.ffi_lowering(f"jax_flash_{op}_{platform}", operand_output_aliases=aliases)

        def lower(ctx, *args, config):
            if config.implementation not in (None, platform):
                raise ValueError(
                    f"jax_flash.{op}: implementation={config.implementation!r} was asked for, "
                    f"but the computation is placed on {platform!r}"
                )
            if platform == "cuda":
                if not _native.has_cuda_kernels():
                    raise RuntimeError(
                        "jax_flash was built without its CUDA kernels (no CUDA compiler at build "
                        "time); reinstall with a CUDA compiler on PATH, or use "
                        "implementation='xla'"
                    )
                reason = None if check_cuda is None else check_cuda(ctx, config)
                if reason is not None:
                    if config.implementation == "cuda":
                        raise ValueError(f"jax_flash.{op}: {reason}; use implementation='xla'")
                    return lower_reference_fn(ctx, *args, config=config)
            return target(ctx, *args, **attrs(config))

        return lower

    def lower_reference(ctx, *args, config):
        if config.implementation is not None:
            raise ValueError(
                f"jax_flash.{op}: implementation={config.implementation!r} has no kernel on this "
                "platform; use implementation=None or 'xla'"
            )
        return lower_reference_fn(ctx, *args, config=config)

    mlir.register_lowering(p, sharded(lower_reference))
    mlir.register_lowering(p, sharded(lowering("cpu")), platform="cpu")
    mlir.register_lowering(p, sharded(lowering("cuda")), platform="cuda")


def batch_first(x, bdim, size: int):
    """x with its vmapped axis first, broadcast to `size` when vmap does not map it."""
    if bdim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, bdim, 0)
