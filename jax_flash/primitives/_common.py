"""What every jax_flash primitive shares: eager impl, platform lowerings to FFI targets, the
jnp-reference lowering for platforms and cases without a native kernel (with a warning), and
the one decision of which kernel a bind runs (`kernel_of`, also behind jax_flash.kernel_for)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from .. import _native
from .._compat import NOT_MAPPED, Primitive, ShapedArray, ffi, mlir
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


# The label of the jnp reference in kernel_of / jax_flash.kernel_for.
XLA_REFERENCE = "xla reference"


class NativeFallbackWarning(UserWarning):
    """implementation=None ran the jnp reference: no native kernel takes the call (the message
    names the op, the platform and the reason). Issued once per op, platform and reason."""


_WARNED: set[tuple[str, str, str]] = set()
# primitive -> (op name, cuda_kernel or None): filled by register_lowerings.
_KERNELS: dict[Primitive, tuple[str, Callable | None]] = {}


def warn_fallback(op: str, platform: str, reason: str) -> None:
    """Warns (once per op, platform and reason) that a call runs the jnp reference."""
    key = (op, platform, reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"jax_flash.{op}: no native kernel takes this call on {platform}: {reason}. It runs the "
        "jnp reference instead (slow; pass implementation='xla' to ask for it explicitly)",
        NativeFallbackWarning,
        stacklevel=2,
    )


def kernel_of(p: Primitive, platform: str, avals_in, config) -> tuple[str, str | None]:
    """The kernel that the lowering of one bind of `p` (operand avals, static config) runs on
    `platform`: ("cpu", None), ("cuda", None) or ("cuda:<kernel>", None) for ops with several
    CUDA kernels, or (XLA_REFERENCE, why) where no native kernel takes the call. The lowering
    acts on this answer; jax_flash.kernel_for reports it."""
    op, cuda_kernel = _KERNELS[p]
    if platform == "cpu":
        return "cpu", None
    if platform == "cuda":
        name, reason = (None, None) if cuda_kernel is None else cuda_kernel(avals_in, config)
        if reason is not None:
            return XLA_REFERENCE, reason
        return ("cuda" if name is None else f"cuda:{name}"), None
    return XLA_REFERENCE, f"jax_flash has no kernel for platform {platform!r}"


def register_lowerings(
    p: Primitive,
    op: str,
    attrs: Callable[..., dict],
    reference: Callable[..., list],
    cuda_kernel: Callable | None = None,
    aliases: dict[int, int] | None = None,
    *,
    partitioning: Partitioning,
    cuda_scratch: tuple[ShapedArray, ...] = (),
):
    """Lower `p` to FFI targets jax_flash_<op>_{cpu,cuda}, and elsewhere to `reference`; under a
    mesh each device lowers its shard (see partitioning.py; call after def_abstract_eval).

    attrs(config) -> FFI attributes; reference(*args, config=...) -> list of results;
    cuda_kernel(avals_in, config) -> (name, None): the CUDA kernel that takes this case (name
    None for an op with one kernel), or (None, why) the CUDA kernels do not take it: then
    implementation=None runs `reference` with a NativeFallbackWarning (documented per op) and
    implementation="cuda" raises. partitioning: p's sharding rule. cuda_scratch: results the CUDA
    target has after p's own, buffers XLA allocates for the kernel's private use (no memory is
    allocated at run time, so the call stays capturable in a CUDA graph); the lowering drops them.
    """
    _KERNELS[p] = (op, cuda_kernel)
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
                _, reason = kernel_of(p, platform, ctx.avals_in, config)
                if reason is not None:
                    if config.implementation == "cuda":
                        raise ValueError(f"jax_flash.{op}: {reason}; use implementation='xla'")
                    warn_fallback(op, platform, reason)
                    return lower_reference_fn(ctx, *args, config=config)
                if cuda_scratch:
                    n = len(ctx.avals_out)
                    ctx = ctx.replace(avals_out=[*ctx.avals_out, *cuda_scratch])
                    return target(ctx, *args, **attrs(config))[:n]
            return target(ctx, *args, **attrs(config))

        return lower

    def lower_reference(ctx, *args, config):
        if config.implementation is not None:
            raise ValueError(
                f"jax_flash.{op}: implementation={config.implementation!r} has no kernel on this "
                "platform; use implementation=None or 'xla'"
            )
        platform = ", ".join(ctx.module_context.platforms)
        warn_fallback(op, platform, f"jax_flash has no kernel for platform {platform!r}")
        return lower_reference_fn(ctx, *args, config=config)

    mlir.register_lowering(p, sharded(lower_reference))
    mlir.register_lowering(p, sharded(lowering("cpu")), platform="cpu")
    mlir.register_lowering(p, sharded(lowering("cuda")), platform="cuda")


def batch_first(x, bdim, size: int):
    """x with its vmapped axis first, broadcast to `size` when vmap does not map it."""
    if bdim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, bdim, 0)
