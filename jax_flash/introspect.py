"""`kernel_for`: which kernel a call of a jax_flash op runs, told without running it."""

from __future__ import annotations

import functools

import jax

from .primitives._common import _KERNELS, XLA_REFERENCE, kernel_of


def _platform(platform: str | None) -> str:
    if platform is None:
        platform = jax.default_backend()
    return "cuda" if platform == "gpu" else platform


def _eqns(jaxpr):
    # Every equation, those of nested jaxprs (jit, vmap, scan, cond bodies...) included.
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def kernel_for(op, *args, platform: str | None = None, **kwargs) -> str:
    """Which kernel ``op(*args, **kwargs)`` runs on ``platform``, without running it.

    The call is traced (``args`` may be arrays or ``jax.ShapeDtypeStruct``), and each jax_flash
    primitive it binds is asked what its lowering will do: the same decision the lowering
    makes, from the kernels' policy in ``cuda/include/jax_flash/policy/*.h``.

    Parameters
    ----------
    op : a jax_flash op (e.g. ``jax_flash.paged_attention``) or any function that calls them.
    *args, **kwargs : the call's arguments.
    platform : "cuda", "cpu" (or "gpu", read as "cuda"); None: JAX's default backend. The answer
        for "cuda" is what a build with the CUDA kernels runs (one without them raises at
        lowering).

    Returns
    -------
    str : ``"cuda:tensor_core"`` (the mma kernels of prefill and paged decode),
        ``"cuda:cuda_core"`` (paged decode on CUDA cores), ``"cuda:simt"`` (prefill on CUDA
        cores), ``"cuda"`` (an op with one CUDA kernel), ``"cpu"``, or ``"xla reference"`` (the
        jnp reference: ``implementation="xla"``, or no native kernel takes the call, which then
        warns with a ``jax_flash.NativeFallbackWarning``). A call that binds several jax_flash
        primitives with different kernels gives them in order, joined by ", ".

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jax_flash
    >>> q = jax.ShapeDtypeStruct((1, 8, 80), jnp.bfloat16)
    >>> pages = jax.ShapeDtypeStruct((4, 16, 2, 80), jnp.bfloat16)
    >>> bt = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    >>> lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    >>> jax_flash.kernel_for(jax_flash.paged_attention, q, pages, pages, bt, lens, platform="cuda")
    'cuda:tensor_core'
    """
    platform = _platform(platform)
    jaxpr = jax.make_jaxpr(functools.partial(op, **kwargs))(*args)
    kernels: list[str] = []
    for eqn in _eqns(jaxpr.jaxpr):
        if eqn.primitive not in _KERNELS:
            continue
        config = eqn.params["config"]
        if config.implementation not in (None, platform):
            raise ValueError(
                f"jax_flash.{_KERNELS[eqn.primitive][0]}: implementation="
                f"{config.implementation!r} was asked for, but the platform is {platform!r}"
            )
        kernel, _ = kernel_of(eqn.primitive, platform, [v.aval for v in eqn.invars], config)
        if kernel not in kernels:
            kernels.append(kernel)
    return ", ".join(kernels) if kernels else XLA_REFERENCE
