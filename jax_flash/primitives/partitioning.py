"""How every jax_flash primitive runs under a mesh: each device runs the kernel on its shard.

A primitive's sharding rule names the factors of each operand and result dimension, in the
einsum-like notation of Shardy (``"(b s) (h g) d"``: a dimension made of factors b and s, b
major). A factor that appears in several operands is split the same way in all of them; a factor
listed as `whole` is never split (the partitioner gathers it first, so results stay exact).
From one `Rule` come:

- the Shardy `sharding_rule` (Shardy, JAX's default partitioner, propagates shardings with it);
- the GSPMD callbacks of `custom_partitioning` (`infer_sharding_from_operands`);
- the `partition` callback (both partitioners): the operand and result shardings each device's
  call needs, decided from the operands' shardings by `assign` (an operand whose sharding differs
  is resharded by the partitioner; for batch and head shardings none is);
- the output shardings of the abstract eval under explicit sharding (`AxisType.Explicit`).

The lowering of each primitive (registered by `_common.register_lowerings`) lowers, under a
mesh, a `custom_partitioning` function whose per-shard body binds the primitive again; that bind
is lowered with every mesh axis manual, i.e. straight to the kernel. Inside `shard_map` (all
axes manual) and on one device the kernel is lowered directly. vmap, the batching rules and the
rest of the primitive do not change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax

from .._compat import (
    NamedSharding,
    PartitionSpec,
    custom_partitioning,
    explicit_axes,
    lowering_needs_partitioning,
    mark_needs_devices,
    mlir,
    tensor_shape,
    varying_axes,
    with_varying_axes,
)

Dim = tuple[str, ...]  # the factors of one dimension, major first


@dataclasses.dataclass(frozen=True)
class Rule:
    """Factors of every operand and result dimension, their sizes, and those kept whole."""

    operands: tuple[tuple[Dim, ...], ...]
    results: tuple[tuple[Dim, ...], ...]
    sizes: dict[str, int]
    whole: frozenset[str]
    # Pairs of factors that may be split over the same mesh axes (factors that never meet in
    # one operand or result, and whose per-shard call knows it: the query and key rows of a
    # sequence-sharded prefill). Otherwise an axis splits one factor only.
    share_axes: frozenset[frozenset[str]] = frozenset()

    def shardy(self):
        """(rule string, keyword arguments) for custom_partitioning's `sharding_rule`."""

        def drop_ones(d):
            # Shardy takes no size-1 factor in a compound dimension (it could not be split).
            kept = tuple(f for f in d if self.sizes[f] != 1)
            return kept or d[:1]

        def text(dims):
            return " ".join(d[0] if len(d) == 1 else "(" + " ".join(d) + ")" for d in dims)

        every = tuple(tuple(drop_ones(d) for d in dims) for dims in self.operands + self.results)
        standalone = {d[0] for dims in every for d in dims if len(d) == 1}
        # Factors in order of first appearance: Shardy wants the special ones in that order.
        order = list(dict.fromkeys(f for dims in every for d in dims for f in d))
        kwargs = {f: self.sizes[f] for f in order if f not in standalone}
        kwargs["need_replication_factors"] = tuple(f for f in order if f in self.whole)
        n = len(self.operands)
        rule = ", ".join(text(d) for d in every[:n]) + " -> " + ", ".join(map(text, every[n:]))
        return rule, kwargs


def parse(text: str) -> tuple[Dim, ...]:
    """'(b s) h d' -> (('b', 's'), ('h',), ('d',))."""
    dims, group = [], None
    for tok in text.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            group = []
        elif tok == ")":
            dims.append(tuple(group))
            group = None
        elif group is not None:
            group.append(tok)
        else:
            dims.append((tok,))
    return tuple(dims)


def make_rule(
    operands, results, shapes_in, shapes_out, whole=(), sizes=None, share_axes=()
) -> Rule:
    """A Rule from dimension strings and the operand/result shapes; the size of a factor is its
    dimension's size, or given in `sizes` for the minor factors of compound dimensions (the
    major one is the rest). A factor of size 0 is kept whole."""
    ops = tuple(parse(t) for t in operands)
    res = tuple(parse(t) for t in results)
    known = dict(sizes or {})
    for dims, shape in zip(ops + res, tuple(shapes_in) + tuple(shapes_out), strict=True):
        if len(dims) != len(shape):
            raise AssertionError(f"rule {dims} does not fit shape {shape}")
        for d, n in zip(dims, shape, strict=True):
            if len(d) == 1:
                known.setdefault(d[0], n)
            else:
                rest = math.prod(known[f] for f in d[1:])
                known.setdefault(d[0], n // rest if rest else 0)
    zero = {f for f, n in known.items() if n == 0}
    shared = frozenset(frozenset(pair) for pair in share_axes)
    return Rule(ops, res, known, frozenset(whole) | zero, shared)


def _spec_axes(spec, ndim) -> list[tuple[str, ...]]:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


def assign(rule: Rule, specs, axis_sizes: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """The mesh axes each factor is split over, from the operands' partition specs.

    Operands are read in order and a sharded dimension decides its factors (an unsharded one
    has no say, so a replicated operand never forces a sharded one to be gathered): its axes go
    to its factors major first, each factor taking axes while its size stays divisible (no
    padded shards), a minor factor only once the major ones are split to size 1 (so that a
    shard is one contiguous block of the dimension). Factors kept whole and axes already taken
    by another factor take none (unless the rule lets the two share axes)."""
    got: dict[str, tuple[str, ...]] = {}
    used: dict[str, str] = {}  # mesh axis -> the factor it splits
    for dims, spec in zip(rule.operands, specs, strict=True):
        for factors, axes in zip(dims, _spec_axes(spec, len(dims)), strict=True):
            rest = list(axes)
            for f in factors:
                if not rest:
                    break
                if f in got:
                    n = len(got[f])
                    if tuple(rest[:n]) != got[f]:
                        break
                    rest = rest[n:]
                else:
                    if f in rule.whole:
                        break
                    take = []
                    while (
                        rest
                        and (
                            rest[0] not in used or frozenset((used[rest[0]], f)) in rule.share_axes
                        )
                        and rule.sizes[f]
                        % (math.prod(axis_sizes[a] for a in take) * axis_sizes[rest[0]])
                        == 0
                    ):
                        take.append(rest.pop(0))
                    if take:
                        got[f] = tuple(take)
                        used.update(dict.fromkeys(take, f))
                if math.prod(axis_sizes[a] for a in got.get(f, ())) != rule.sizes[f]:
                    break  # the next factor may not be split: shards would not be contiguous
    return got


def _dim_spec(factors: Dim, got, rule, axis_sizes):
    axes = []
    for f in factors:
        axes += got.get(f, ())
        if math.prod(axis_sizes[a] for a in got.get(f, ())) != rule.sizes[f]:
            break
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def specs_of(dims_list, got, rule, axis_sizes):
    return [
        PartitionSpec(*(_dim_spec(d, got, rule, axis_sizes) for d in dims)) for dims in dims_list
    ]


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """A primitive's sharding: rule(config, shapes_in, shapes_out) -> Rule, and optionally
    per_shard(config, got) -> fn(*shard_operands) -> results, or None for a plain bind: a
    per-device call that differs (e.g. offsets made local to the shard; `got` from `assign`)."""

    rule: Callable[..., Rule]
    per_shard: Callable | None = None


def _shapes(xs):
    return [tuple(x.shape) for x in xs]


def partitioned(p, partitioning: Partitioning) -> Callable[[Callable], Callable]:
    """Gives `p` its sharding: its abstract eval (already defined) gets the explicit-sharding
    output shardings; returns wrap(lower) -> the lowering to register in place of `lower`."""
    cp = _custom_call(p, partitioning)
    mark_needs_devices(p)
    _wrap_abstract_eval(p, partitioning)

    def wrap(lower):
        def lowering(ctx, *args, config):
            if not lowering_needs_partitioning(ctx):
                return lower(ctx, *args, config=config)
            return mlir.lower_fun(lambda *a: cp(config, *a), multiple_results=True)(ctx, *args)

        return lowering

    return wrap


def _custom_call(p, partitioning: Partitioning):
    def body(config, *args):
        return p.bind(*args, config=config)

    def decide(config, mesh, arg_shapes, result_shape):
        rule = partitioning.rule(config, _shapes(arg_shapes), _shapes(result_shape))
        sizes = dict(mesh.shape)
        # GSPMD may ask before an operand's sharding is known (None): it has no say yet.
        specs = [PartitionSpec() if a.sharding is None else a.sharding.spec for a in arg_shapes]
        got = assign(rule, specs, sizes)
        return rule, got, sizes

    def partition(config, mesh, arg_shapes, result_shape):
        rule, got, sizes = decide(config, mesh, arg_shapes, result_shape)
        args = [NamedSharding(mesh, s) for s in specs_of(rule.operands, got, rule, sizes)]
        outs = [NamedSharding(mesh, s) for s in specs_of(rule.results, got, rule, sizes)]
        fn = None if partitioning.per_shard is None else partitioning.per_shard(config, got)
        if fn is None:
            fn = lambda *a: p.bind(*a, config=config)  # noqa: E731
        return mesh, _without_context_mesh(fn), outs, tuple(args)

    def infer(config, mesh, arg_shapes, result_shape):
        rule, got, sizes = decide(config, mesh, arg_shapes, result_shape)
        return [NamedSharding(mesh, s) for s in specs_of(rule.results, got, rule, sizes)]

    def shardy(config, mesh, value_types, result_types):
        del mesh
        shapes_in = [tensor_shape(t) for t in value_types]
        shapes_out = [tensor_shape(t) for t in result_types]
        return partitioning.rule(config, shapes_in, shapes_out).shardy()

    cp = custom_partitioning(body, static_argnums=(0,))
    cp.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=shardy)
    return cp


def _without_context_mesh(fn):
    """fn traced per device as a computation of its own, outside the caller's mesh: XLA asks for
    it while compiling a call made under `jax.set_mesh` with explicit axes, and traced in that
    context every array fn creates would carry a replicated sharding, lowered to `Sharding`
    custom calls that nothing removes once the program is partitioned (XLA then fails to find an
    implementation for them)."""

    def per_device(*args):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return fn(*args)

    return per_device


def _wrap_abstract_eval(p, partitioning: Partitioning):
    """Under explicit sharding every value's type carries its sharding: the outputs get the
    shardings the rule gives. A replicated operand that the rule splits is sliced locally (no
    communication); an operand sharded in a way the rule does not take would need communication,
    which explicit mode never inserts on its own: an error naming the operand.

    Inside shard_map the outputs vary over every manual axis an operand varies over: typed as
    invariant, a result would be broadcast (pvary) where it meets varying values, and the
    transpose of that broadcast sums cotangents over the devices."""
    inner = p.abstract_eval

    def abstract_eval(*avals, config):
        outs, effects = inner(*avals, config=config)
        varying = frozenset().union(*(varying_axes(a) for a in avals))
        outs = [with_varying_axes(o, varying) for o in outs]
        mesh, axes = explicit_axes(avals)
        if not axes:
            return outs, effects
        rule = partitioning.rule(config, _shapes(avals), _shapes(outs))
        sizes = {a: mesh.shape[a] for a in mesh.axis_names}
        specs = [a.sharding.spec for a in avals]
        got = assign(rule, specs, sizes)
        need = specs_of(rule.operands, got, rule, sizes)
        for i, (have, want) in enumerate(zip(specs, need, strict=True)):
            n = len(avals[i].shape)
            pairs = zip(_spec_axes(have, n), _spec_axes(want, n), strict=True)
            if any(h and h != w for h, w in pairs):
                raise ValueError(
                    f"{p.name}: under explicit sharding operand {i} {avals[i].str_short()} is "
                    f"sharded as {have}, but this call takes it as {want} (an axis it cannot "
                    "split, or split unlike the other operands); jax.sharding.reshard it first"
                )
        out_specs = specs_of(rule.results, got, rule, sizes)
        outs = [
            o.update(sharding=NamedSharding(mesh, s)) for o, s in zip(outs, out_specs, strict=True)
        ]
        return outs, effects

    p.def_effectful_abstract_eval(abstract_eval)


def local_index(axes: tuple[str, ...]):
    """This device's shard index along a dimension split over mesh `axes` (major first), inside
    a per-shard function."""
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
