"""The device side of an engine step: the layout of a step's packed inputs (`StepShape`) and
the jitted programs `Engine` dispatches.

- `run_step`: one step of decode rows and prompt chunks (`jax_flash.nn.Mixed`), one token
  drawn per row.
- `run_decode_steps`: ``StepShape.steps`` decode steps of the decode rows in one device loop.
- `copy_cache_pages`: copy-on-write of partly shared prompt pages.
- `place_like_step`: a new engine's arrays in the layouts a step returns.

The model reaches them as a static `ModelStatic` (interned by `model_static`) and a flat
parameter list; on a tensor-parallel model every output is pinned to the layout its input came
in (`pin_layouts`), so the donated pools stay split from step to step.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn import Mixed
from ..ops.kv_cache import copy_pages
from ..ops.sampling import argmax_tokens, sample


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Static shape of one device step."""

    num_decode: int
    num_chunks: int
    chunk: int
    max_pages: int  # block-table columns
    out_rows: int  # rows of every step's output (the next step reads it by row)
    greedy: bool  # every row greedy: argmax, no sampling kernel (static: no device branch)
    steps: int = 1  # decode steps in one dispatch (decode rows only when > 1)
    page_size: int = 0  # for the cache slots of steps past the first (steps > 1)

    @property
    def rows(self) -> int:
        return self.num_decode + self.num_chunks

    @property
    def tokens(self) -> int:
        return self.num_decode + self.num_chunks * self.chunk

    def int_fields(self):
        """(name, size) of the fields packed in the step's int32 input, in order."""
        T, R, d = self.tokens, self.rows, self.num_decode
        return (
            ("tokens", T),
            ("source", d),
            ("positions", T),
            ("slots", T),
            ("block_tables", R * self.max_pages),
            ("kv_lens", R),
            ("top_k", R),
            ("seeds", R),
            ("index", R),
        ) + ((("counts", d),) if self.steps > 1 else ())


# The float32 input's fields, ``shape.rows`` values each, in order.
FLOAT_FIELDS = ("temperature", "top_p", "min_p")  # SamplingParams attributes


def unpack_inputs(shape: StepShape, ints, floats) -> dict:
    """The step's fields by name from its packed int32 and float32 inputs (on the device)."""
    out, at = {}, 0
    for name, size in shape.int_fields():
        out[name] = ints[at : at + size]
        at += size
    out["block_tables"] = out["block_tables"].reshape(shape.rows, shape.max_pages)
    R = shape.rows
    for i, name in enumerate(FLOAT_FIELDS):
        out[name] = floats[i * R : (i + 1) * R]
    return out


def draw_tokens(logits, f, greedy: bool, impl):
    """One token per row: argmax when every row is greedy (``greedy``), else each row alone
    with its own key, as `generate` draws for a lone prompt."""
    if greedy:
        return argmax_tokens(logits)

    def one(row, seed, index, temperature, top_k, top_p, min_p):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return sample(
            row[None],
            key,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            implementation=impl,
        )[0]

    args = (f["seeds"], f["index"], f["temperature"], f["top_k"], f["top_p"], f["min_p"])
    return jax.vmap(one)(logits, *args)


class ModelStatic:
    """The model's graph definition and parameter tree as one static argument of the jitted
    step, hashed by identity: an nnx GraphDef hashes its whole structure, milliseconds for a
    16-layer model, which a step per token cannot pay. Interned (`model_static`), so the
    engines of one model share their compiled steps."""

    __slots__ = ("graphdef", "state_def", "__weakref__")

    def __init__(self, graphdef, state_def):
        self.graphdef, self.state_def = graphdef, state_def


_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def model_static(graphdef, state_def) -> ModelStatic:
    """The one `ModelStatic` of an equal (graphdef, state_def) while any engine holds it."""
    key = (graphdef, state_def)
    static = _INTERNED.get(key)
    if static is None:
        static = _INTERNED[key] = ModelStatic(graphdef, state_def)
    return static


def pin_layouts(parallel, out, kv):
    """The step's outputs in the layouts its inputs came in, for a tensor-parallel model: the
    tokens replicated (the next step and the host read them whole), the pools split by KV
    heads (donated back in by the next step); unchanged on one device."""
    if parallel is None:
        return out, kv
    return parallel.constrain(out), jax.tree.map(parallel.heads, kv)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def place_like_step(parallel, out, kv):
    """A new engine's previous-step tokens and pools in the layouts a step returns, as the
    step's own outputs spell them: jit caches an executable per input layout as written, so
    an equal layout spelled otherwise (``P(None)`` for ``P()``) would compile the step again."""
    return pin_layouts(parallel, out, kv)


def merged_model(static: ModelStatic, params):
    # The parameters come as a flat list, which jit flattens quicker than an nnx.State.
    return nnx.merge(static.graphdef, jax.tree.unflatten(static.state_def, params))


def decode_fed(f, previous, d: int):
    """The token each of the ``d`` decode rows feeds: the previous step's output row
    ``source`` drew it, or (source -1) the host packed it."""
    return jnp.where(f["source"] >= 0, previous[jnp.maximum(f["source"], 0)], f["tokens"][:d])


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def run_step(static: ModelStatic, shape: StepShape, params, kv, previous, ints, floats):
    model = merged_model(static, params)
    f = unpack_inputs(shape, ints, floats)
    d = shape.num_decode
    tokens = f["tokens"]
    if d:
        tokens = tokens.at[:d].set(decode_fed(f, previous, d))
    batch = Mixed(f["block_tables"], f["kv_lens"], f["slots"], d, shape.chunk)
    h, kv = model.forward(tokens, f["positions"], kv, batch)
    logits = model.logits(h[batch.last_tokens()])
    drawn = draw_tokens(logits, f, shape.greedy, getattr(model, "attention_impl", None))
    out = jnp.full((shape.out_rows,), -1, jnp.int32).at[: shape.rows].set(drawn)
    return pin_layouts(getattr(model, "parallel", None), out, kv)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def run_decode_steps(static: ModelStatic, shape: StepShape, params, kv, previous, ints, floats):
    """``shape.steps`` decode steps of the decode rows in one dispatch: step ``i`` feeds the
    token step ``i - 1`` drew (step 0: as `run_step` does) at position ``start + i`` and
    draws the next, for the rows whose ``counts`` exceed ``i``; past its count a row writes no
    cache slot and its tokens mean nothing. Returns each row's last counted token (the
    ``previous`` of the next dispatch), every step's tokens ``[steps, out_rows]`` and the
    pools."""
    model = merged_model(static, params)
    f = unpack_inputs(shape, ints, floats)
    d, P = shape.num_decode, shape.page_size
    rows = jnp.arange(d)
    counts, start, tables = f["counts"], f["positions"], f["block_tables"]
    fed = decode_fed(f, previous, d)
    impl = getattr(model, "attention_impl", None)

    def step(i, carry):
        tokens, kv, drawn_all = carry
        pos = start + i
        counted = i < counts
        slots = jnp.where(counted, tables[rows, pos // P] * P + pos % P, -1)
        # A row past its count attends its counted tokens only (no page beyond them is its).
        kv_lens = jnp.where(counts > 0, start + jnp.minimum(i, counts - 1) + 1, 0)
        batch = Mixed(tables, kv_lens, slots, d, shape.chunk)
        positions = jnp.where(counted, pos, start + jnp.maximum(counts - 1, 0))
        h, kv = model.forward(tokens, positions, kv, batch)
        logits = model.logits(h[batch.last_tokens()])
        drawn = draw_tokens(logits, dict(f, index=f["index"] + i), shape.greedy, impl)
        return drawn, kv, drawn_all.at[i].set(drawn)

    # Always shape.steps steps (rows past their counts write nothing): a trip count the device
    # computes makes the GPU loop copy its predicate to the host each step, which blocks the
    # dispatch until the loop ends and so loses the host's overlap with the device.
    drawn_all = jnp.zeros((shape.steps, d), jnp.int32)
    _, kv, drawn_all = jax.lax.fori_loop(0, shape.steps, step, (fed, kv, drawn_all))
    last = drawn_all[jnp.maximum(counts - 1, 0), rows]
    out = jnp.full((shape.out_rows,), -1, jnp.int32).at[:d].set(jnp.where(counts > 0, last, -1))
    every = jnp.full((shape.steps, shape.out_rows), -1, jnp.int32).at[:, :d].set(drawn_all)
    parallel = getattr(model, "parallel", None)
    out, kv = pin_layouts(parallel, out, kv)
    return out, every if parallel is None else parallel.constrain(every), kv


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def copy_cache_pages(impl, parallel, kv, src, dst):
    """Copy pages ``src[i] -> dst[i]`` in every layer's cache (ids -1: padding, skipped); on
    split pools each device copies its own KV heads (the op's partitioning rule)."""
    kv = tuple(copy_pages(k, v, src, dst, implementation=impl) for k, v in kv)
    return kv if parallel is None else jax.tree.map(parallel.heads, kv)
