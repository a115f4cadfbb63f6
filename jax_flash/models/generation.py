"""`generate`: batched generation with a paged KV cache, the decode loop inside ``jit``.

Prompts of different lengths are packed into one prefill (no padding compute); then a
``lax.while_loop`` runs the decode steps on the device with the cache donated, so no token makes
a host round trip. Every request gets all the cache pages it can need when it is admitted
(prompt + ``max_new_tokens``, and for beam search one spare page per beam for copy-on-write),
never per token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn import MIN_DECODE_ROWS, PageAllocator, block_table, pages_needed
from ..ops.kv_cache import reorder_beams
from ..ops.sampling import argmax_tokens, sample

# Shapes are rounded up to these multiples (packed prompt rows, cache pages, block-table
# columns) so that calls of similar sizes share their compiled executables.
_TOKEN_BUCKET = 64
_PAGE_BUCKET = 64
_COLUMN_BUCKET = 8
_STEP_BUCKET = 16  # new-token buffer width
_EOS_BUCKET = 4


@dataclasses.dataclass
class GenerateOutput:
    """What :func:`generate` returns.

    Attributes
    ----------
    tokens : per prompt, the generated tokens (the best beam for beam search), ending with the
        EOS token when one stopped it.
    beams, scores : beam search only: per prompt, ``num_beams`` sequences sorted by score
        (descending), and their scores ``sum(log p) / len ** length_penalty``.
    num_prompt_tokens, num_decode_tokens : tokens run through prefill, and through the decode
        loop (all rows, beams included).
    compile_s, prefill_s, decode_s : wall times (compilation is timed apart; 0 when cached).
    """

    tokens: list[list[int]]
    beams: list[list[list[int]]] | None
    scores: list[list[float]] | None
    num_prompt_tokens: int
    num_decode_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static configuration of the jitted steps (the sampling parameters, EOS ids, length
    penalty and token limits are device data: changing them does not recompile)."""

    greedy: bool
    num_beams: int
    impl: str | None


_COMPILED: collections.OrderedDict = collections.OrderedDict()


def _run(fn, statics, *args, compile_times):
    """Call the jitted ``fn(*statics, *args)`` through an ahead-of-time compiled executable,
    cached on the statics and the arguments' shapes, so that compilation is timed apart."""
    leaves, tree = jax.tree.flatten(args)
    key = (fn, statics, tree, tuple((x.shape, jnp.result_type(x)) for x in leaves))
    exe = _COMPILED.get(key)
    if exe is None:
        t0 = time.perf_counter()
        exe = fn.lower(*statics, *args).compile()
        compile_times.append(time.perf_counter() - t0)
        _COMPILED[key] = exe
        while len(_COMPILED) > 32:
            _COMPILED.popitem(last=False)
    return exe(*args)


def _draw(logits, key, step, spec: _Spec, params):
    if spec.greedy:  # sample's temperature-0 choice, without the sampling kernel
        return argmax_tokens(logits)
    return sample(
        logits,
        jax.random.fold_in(key, step),
        temperature=params["temperature"],
        top_k=params["top_k"],
        top_p=params["top_p"],
        min_p=params["min_p"],
        implementation=spec.impl,
    )


def _is_eos(tokens, params):
    return jnp.any(tokens[..., None] == params["eos"], axis=-1)  # eos padded with -1


# ---------------------------------------------------------------------------------------------
# Greedy and sampling: one cache row per prompt.


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _sample_prefill(graphdef, spec, width, state, cache, tokens, cu, params, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(cache, tokens, cu)
    tok = _draw(logits, key, 0, spec, params)
    B = cu.shape[0] - 1
    return dict(
        cache=cache,
        params=params,
        key=key,
        last=tok,
        out=jnp.full((B, width), -1, jnp.int32).at[:, 0].set(tok),
        n_gen=jnp.ones((B,), jnp.int32),
        done=_is_eos(tok, params) | (params["max_new"] <= 1),
        step=jnp.int32(1),
        n_decoded=jnp.int32(0),
    )


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _sample_loop(graphdef, spec, state, carry, stop_step):
    model = nnx.merge(graphdef, state)

    def cond(c):
        return (c["step"] < stop_step) & jnp.any(~c["done"])

    def body(c):
        active = ~c["done"]
        logits, cache = model.decode(c["cache"], c["last"], active=active)
        tok = _draw(logits, c["key"], c["step"], spec, c["params"])
        n_gen = c["n_gen"] + active
        out = c["out"].at[:, c["step"]].set(jnp.where(active, tok, -1), mode="drop")
        stop = _is_eos(tok, c["params"]) | (n_gen >= c["params"]["max_new"])
        return dict(
            c,
            cache=cache,
            last=jnp.where(active, tok, c["last"]),
            out=out,
            n_gen=n_gen,
            done=c["done"] | (active & stop),
            step=c["step"] + 1,
            n_decoded=c["n_decoded"] + jnp.sum(active),
        )

    return jax.lax.while_loop(cond, body, carry)


# ---------------------------------------------------------------------------------------------
# Beam search: num_beams cache rows per prompt (row b * K + j is beam j of prompt b).


def _beam_select(logits, beams, step, params):
    """One beam-search step from the rows' next-token logits ``[B*K, V]``.

    The 2K best continuations of a request are ranked; those that end in EOS among its first K
    become finished hypotheses, the first K others the new beams. A request is done at its
    token limit (its running beams are then finished too, as transformers' ``finalize``) or when
    it holds K finished hypotheses none of which the best running beam can still beat
    (transformers' ``early_stopping=False`` rule). Returns the new state, each new beam's parent
    row ``[B*K]`` and its token ``[B*K]``; done requests keep their beams.
    """
    B, K = beams["scores"].shape
    V = logits.shape[-1]
    norm = (step + 1).astype(jnp.float32) ** params["length_penalty"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(B, K, V)
    cand = (beams["scores"][:, :, None] + logp).reshape(B, K * V)
    vals, idx = jax.lax.top_k(cand, 2 * K)  # [B, 2K]
    parent, tok = idx // V, (idx % V).astype(jnp.int32)
    eos = _is_eos(tok, params)
    rank = jnp.arange(2 * K)
    done = beams["done"]
    seqs = jnp.take_along_axis(beams["seqs"], parent[:, :, None], axis=1)  # [B, 2K, W]
    seqs = seqs.at[:, :, step].set(tok, mode="drop")

    # Continuing beams: the first K candidates that are not EOS.
    order = jnp.argsort(jnp.where(eos, 2 * K + rank, rank), axis=1)[:, :K]
    run_scores = jnp.take_along_axis(vals, order, axis=1)
    run_parent = jnp.take_along_axis(parent, order, axis=1)
    run_tok = jnp.take_along_axis(tok, order, axis=1)
    run_seqs = jnp.take_along_axis(seqs, order[:, :, None], axis=1)

    # Finished hypotheses: EOS among the first K candidates, and at the limit every beam.
    at_max = (step + 1 >= params["max_new"]) & ~done
    new_fin = jnp.where(eos & (rank < K) & ~done[:, None], vals / norm, -jnp.inf)
    final = jnp.where(at_max[:, None], run_scores / norm, -jnp.inf)
    all_scores = jnp.concatenate([beams["fin_scores"], new_fin, final], axis=1)  # [B, 4K]
    all_seqs = jnp.concatenate([beams["fin_seqs"], seqs, run_seqs], axis=1)
    all_lens = jnp.concatenate(
        [beams["fin_lens"], jnp.full((B, 3 * K), step + 1, jnp.int32)], axis=1
    )
    fin_scores, pick = jax.lax.top_k(all_scores, K)
    settled = jnp.all(fin_scores > -jnp.inf, axis=1) & (
        fin_scores[:, K - 1] >= run_scores[:, 0] / norm
    )
    keep = done[:, None]
    new = dict(
        scores=jnp.where(keep, beams["scores"], run_scores),
        seqs=jnp.where(keep[:, :, None], beams["seqs"], run_seqs),
        fin_scores=fin_scores,
        fin_seqs=jnp.take_along_axis(all_seqs, pick[:, :, None], axis=1),
        fin_lens=jnp.take_along_axis(all_lens, pick, axis=1),
        done=done | at_max | settled,
    )
    parents = jnp.where(keep, jnp.arange(K)[None, :], run_parent) + (jnp.arange(B) * K)[:, None]
    last = jnp.where(keep, 0, run_tok)
    return new, parents.reshape(-1).astype(jnp.int32), last.reshape(-1)


def _reorder(cache, parents, spare, impl):
    """Move every beam's row to its parent's (copy-on-write of the partial last page); each row
    keeps its own not-yet-written pages past the last one, so beams never share a page they
    will write."""
    bt = cache.block_tables
    ks, vs = [], []
    for k, v in cache.layers():
        rows, lens, new_spare, (k, v) = reorder_beams(
            bt, cache.kv_lens, parents, spare, k, v, implementation=impl
        )
        ks.append(k)
        vs.append(v)
    last = (lens - 1) // cache.page_size
    rows = jnp.where(jnp.arange(bt.shape[1])[None, :] > last[:, None], bt, rows)
    cache = cache.replace(k_pages=tuple(ks), v_pages=tuple(vs), block_tables=rows, kv_lens=lens)
    return cache, new_spare


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _beam_prefill(graphdef, spec, width, state, cache, tokens, cu, params, spare):
    model = nnx.merge(graphdef, state)
    K = spec.num_beams
    B = cu.shape[0] - 1
    logits, cache = model.prefill(cache, tokens, cu, rows=jnp.arange(B, dtype=jnp.int32) * K)
    cache = cache.replace(kv_lens=jnp.repeat(cu[1:] - cu[:-1], K))
    # Only beam 0 is live at first: the first step draws K distinct tokens from the prompt.
    first = jnp.where(jnp.arange(K) == 0, 0.0, -jnp.inf).astype(jnp.float32)
    beams = dict(
        scores=jnp.broadcast_to(first, (B, K)),
        seqs=jnp.zeros((B, K, width), jnp.int32),
        fin_scores=jnp.full((B, K), -jnp.inf, jnp.float32),
        fin_seqs=jnp.zeros((B, K, width), jnp.int32),
        fin_lens=jnp.zeros((B, K), jnp.int32),
        done=jnp.zeros((B,), bool),
    )
    beams, parents, last = _beam_select(jnp.repeat(logits, K, axis=0), beams, jnp.int32(0), params)
    return dict(
        cache=cache,
        params=params,
        spare=spare,
        beams=beams,
        parents=parents,
        last=last,
        step=jnp.int32(1),
        n_decoded=jnp.int32(0),
    )


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _beam_loop(graphdef, spec, state, carry, stop_step):
    model = nnx.merge(graphdef, state)
    K = spec.num_beams

    def cond(c):
        return (c["step"] < stop_step) & jnp.any(~c["beams"]["done"])

    def body(c):
        active = jnp.repeat(~c["beams"]["done"], K)
        cache, spare = _reorder(c["cache"], c["parents"], c["spare"], spec.impl)
        logits, cache = model.decode(cache, c["last"], active=active)
        beams, parents, last = _beam_select(logits, c["beams"], c["step"], c["params"])
        return dict(
            c,
            cache=cache,
            spare=spare,
            beams=beams,
            parents=parents,
            last=last,
            step=c["step"] + 1,
            n_decoded=c["n_decoded"] + jnp.sum(active),
        )

    return jax.lax.while_loop(cond, body, carry)


# ---------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _eos_array(eos_token_id) -> np.ndarray:
    if eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, (int, np.integer)):
        ids = [int(eos_token_id)]
    else:
        ids = [int(e) for e in eos_token_id]
    out = np.full((_round_up(max(len(ids), 1), _EOS_BUCKET),), -1, np.int32)
    out[: len(ids)] = ids
    return out


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    eos_token_id: int | Sequence[int] | None = None,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    num_beams: int | None = None,
    length_penalty: float = 1.0,
    page_size: int = 16,
    seed: int = 0,
    steps_per_call: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GenerateOutput:
    """Generate continuations of a batch of prompts.

    Parameters
    ----------
    model : a decoder with ``prefill``, ``decode``, ``init_cache`` and ``config.vocab_size``
        (e.g. :class:`jax_flash.models.LlamaForCausalLM`); its ``attention_impl`` also picks the
        implementation of the sampling and page-copy ops.
    prompts : token lists (each non-empty; lengths may differ).
    max_new_tokens : int, or one per prompt. A sequence stops at this many new tokens or after
        emitting an EOS token.
    eos_token_id : int, ints, or None (no EOS stop).
    greedy : argmax decoding; else sampling with ``temperature``, ``top_k``, ``top_p``,
        ``min_p`` through :func:`jax_flash.sample` (keys from ``seed``; reproducible).
    num_beams, length_penalty : beam search with ``num_beams`` beams per prompt (None: none;
        1 is greedy search through the beam machinery). Beams are cache rows, reordered through
        :func:`jax_flash.reorder_beams` (copy-on-write of the partially filled page); a
        hypothesis scores ``sum(log p) / len ** length_penalty``; finished hypotheses keep
        their EOS token.
    page_size : tokens per cache page.
    steps_per_call : decode steps per jitted call (default: all in one); after each call
        ``progress(step, max_new_tokens)`` is called.

    Returns
    -------
    GenerateOutput

    Examples
    --------
    See :class:`jax_flash.models.LlamaForCausalLM`.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    beam = num_beams is not None
    B, K, P = len(prompts), int(num_beams or 1), int(page_size)
    vocab = model.config.vocab_size
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise ValueError(f"generate: prompt tokens must lie in [0, {vocab})")
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (B,)).astype(np.int32)
    if np.any(max_new < 0):
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if beam and (K < 1 or not greedy or 2 * K > vocab):
        raise ValueError(
            f"generate: num_beams must be None or in [1, vocab_size / 2], with greedy=True; "
            f"got {num_beams}"
        )
    if not (temperature >= 0 and top_k >= 0 and 0 < top_p <= 1 and 0 <= min_p <= 1 and P >= 1):
        raise ValueError(
            "generate: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, "
            f"page_size >= 1; got {temperature}, {top_k}, {top_p}, {min_p}, {page_size}"
        )
    steps = int(max_new.max(initial=0))
    if B == 0 or steps == 0:
        empty = [[] for _ in range(B)]
        beams = [[[] for _ in range(K)] for _ in range(B)] if beam else None
        scores = [[0.0] * K for _ in range(B)] if beam else None
        return GenerateOutput(empty, beams, scores, 0, 0, 0.0, 0.0, 0.0)

    # A lone prompt decodes beside inactive one-token rows (nn.MIN_DECODE_ROWS): their outputs
    # are dropped below.
    num_prompts = B
    if not beam and B < MIN_DECODE_ROWS:
        prompts = prompts + [[0]] * (MIN_DECODE_ROWS - B)
        max_new = np.concatenate([max_new, np.zeros(MIN_DECODE_ROWS - B, np.int32)])
        B = MIN_DECODE_ROWS

    # Admission: all the pages a request can need, now. The last new token is never fed back,
    # so a row holds at most len + max_new - 1 tokens (and at least the prompt).
    lens = [len(p) for p in prompts]
    capacity = [max(n, n + int(m) - 1) for n, m in zip(lens, max_new, strict=True)]
    if beam:  # shared full prompt pages; per beam the rest, and a spare page for copy-on-write
        per_beam = [pages_needed(c, P) - n // P + 1 for n, c in zip(lens, capacity, strict=True)]
        need = sum(n // P + K * m for n, m in zip(lens, per_beam, strict=True))
    else:
        need = sum(pages_needed(c, P) for c in capacity)
    pool = PageAllocator(_round_up(need + 1, _PAGE_BUCKET))
    rows, spare = [], []
    for n, c in zip(lens, capacity, strict=True):
        if not beam:
            rows.append(pool.allocate(pages_needed(c, P)))
            continue
        shared = pool.allocate(n // P)
        for _ in range(K):
            rows.append(shared + pool.allocate(pages_needed(c, P) - len(shared)))
            spare.append(pool.allocate(1)[0])
    columns = _round_up(max(len(r) for r in rows), _COLUMN_BUCKET)
    cache = model.init_cache(pool.num_pages, P, block_table(rows, columns))

    T = sum(lens)
    tokens = np.zeros((_round_up(T, _TOKEN_BUCKET),), np.int32)
    tokens[:T] = np.concatenate(prompts)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    params = dict(
        max_new=jnp.asarray(max_new),
        eos=jnp.asarray(_eos_array(eos_token_id)),
        temperature=jnp.float32(temperature),
        top_k=jnp.int32(top_k),
        top_p=jnp.float32(top_p),
        min_p=jnp.float32(min_p),
        length_penalty=jnp.float32(length_penalty),
    )
    spec = _Spec(bool(greedy), K, getattr(model, "attention_impl", None))
    width = _round_up(steps, _STEP_BUCKET)
    graphdef, state = nnx.split(model)
    compile_times: list[float] = []

    t0 = time.perf_counter()
    args = (state, cache, jnp.asarray(tokens), jnp.asarray(cu), params)
    if beam:
        extra, prefill, loop = jnp.asarray(spare, jnp.int32), _beam_prefill, _beam_loop
    else:
        extra, prefill, loop = jax.random.key(seed), _sample_prefill, _sample_loop
    carry = _run(prefill, (graphdef, spec, width), *args, extra, compile_times=compile_times)
    done_of = (lambda c: c["beams"]["done"]) if beam else (lambda c: c["done"])
    all_done = bool(jnp.all(done_of(carry)))  # waits for the prefill
    prefill_s = time.perf_counter() - t0 - sum(compile_times)

    n_compiles = len(compile_times)
    step, chunk = 1, int(steps_per_call or steps)
    t0 = time.perf_counter()
    while not all_done and step < steps:
        stop = jnp.int32(min(step + chunk, steps))
        carry = _run(loop, (graphdef, spec), state, carry, stop, compile_times=compile_times)
        step, all_done = int(carry["step"]), bool(jnp.all(done_of(carry)))
        if progress is not None:
            progress(step, steps)
    decode_s = time.perf_counter() - t0 - sum(compile_times[n_compiles:])

    if beam:
        st = carry["beams"]
        seqs, fl, fs = (np.asarray(st[k]) for k in ("fin_seqs", "fin_lens", "fin_scores"))
        beams = [
            [seqs[b, j, : min(fl[b, j], max_new[b])].tolist() for j in range(K)] for b in range(B)
        ]
        scores = [fs[b].tolist() for b in range(B)]
        tokens_out = [bs[0] for bs in beams]
    else:
        out, n_gen = np.asarray(carry["out"]), np.asarray(carry["n_gen"])
        tokens_out = [out[b, : min(n_gen[b], max_new[b])].tolist() for b in range(num_prompts)]
        beams = scores = None
    return GenerateOutput(
        tokens=tokens_out,
        beams=beams,
        scores=scores,
        num_prompt_tokens=sum(lens[:num_prompts]),
        num_decode_tokens=int(carry["n_decoded"]),
        compile_s=float(sum(compile_times)),
        prefill_s=prefill_s,
        decode_s=decode_s,
    )
