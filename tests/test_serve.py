"""The serving engine (`jax_flash.serve`): every request's tokens equal those of `generate` run
on it alone (greedy, and sampling with the same seed) under staggered arrivals, stop tokens,
preemption from a tiny page pool and prefix sharing; the page pool's invariants after every
step; a shared prefix is prefilled once; steps of a warm engine do not recompile.

A tiny float32 model (GQA 4:2, odd vocabulary) on the CPU kernels.
"""

import os

import jax
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate  # noqa: E402
from jax_flash.serve import Engine, PagePool, SamplingParams, Status  # noqa: E402
from jax_flash.serve.engine import _device_step  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PAGE = 4
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.random(CONFIG, seed=1)


_REFERENCE = {}


def reference(model, prompt, max_new, sampling=None, stop=()):
    """`generate` on this request alone."""
    s = sampling or SamplingParams()
    key = (tuple(prompt), max_new, s, tuple(stop))
    if key not in _REFERENCE:
        kw = dict(greedy=True)
        if not s.greedy:
            kw = dict(
                greedy=False,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                min_p=s.min_p,
                seed=s.seed,
            )
        out = generate(
            model, [prompt], max_new, eos_token_id=list(stop) or None, page_size=PAGE, **kw
        )
        _REFERENCE[key] = out.tokens[0]
    return _REFERENCE[key]


def drive(engine, arrivals):
    """Step ``engine``, adding ``arrivals[k]`` (add_request kwargs) before step k; check the
    pool after every step and collect the streamed tokens. Returns {id: (kwargs, tokens)}."""
    streamed, specs, k = {}, {}, 0
    while k < len(arrivals) or engine.has_unfinished():
        for spec in arrivals[k] if k < len(arrivals) else ():
            specs[engine.add_request(**spec)] = spec
        out = engine.step()
        engine.scheduler.check()
        for rid, toks in out.tokens.items():
            streamed.setdefault(rid, []).extend(toks)
        for rid in out.finished:
            assert engine.request(rid).status is Status.FINISHED
        k += 1
        assert k < 500, "the engine does not finish"
    assert engine.pool.num_used == 0, "finished requests left pages behind"
    for rid in specs:
        assert streamed.get(rid, []) == engine.request(rid).output
    return {rid: (spec, streamed[rid]) for rid, spec in specs.items()}


def check_against_generate(model, results):
    for rid, (spec, tokens) in results.items():
        ref = reference(
            model,
            spec["prompt_tokens"],
            spec["max_new_tokens"],
            spec.get("sampling"),
            spec.get("stop_tokens", ()),
        )
        assert tokens == ref, f"request {rid}: {tokens} != generate's {ref}"


def prompts(rng, lengths):
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def test_staggered_arrivals_match_generate(model):
    rng = np.random.default_rng(0)
    ps = prompts(rng, (5, 17, 1, 30, 9, 13, 2))
    stop_at = reference(model, ps[4], 12)[3]  # a token it draws: the request stops there
    arrivals = [
        [dict(prompt_tokens=ps[0], max_new_tokens=6), dict(prompt_tokens=ps[1], max_new_tokens=3)],
        [],
        [dict(prompt_tokens=ps[2], max_new_tokens=9, sampling=SAMPLED)],
        [dict(prompt_tokens=ps[3], max_new_tokens=5)],
        [dict(prompt_tokens=ps[4], max_new_tokens=12, stop_tokens=[stop_at])],
        [],
        [],
        [
            dict(
                prompt_tokens=ps[5],
                max_new_tokens=7,
                sampling=SamplingParams(temperature=1.3, seed=3),
            )
        ],
        [dict(prompt_tokens=ps[6], max_new_tokens=1)],
    ]
    engine = Engine(
        model, num_pages=48, page_size=PAGE, max_batch=4, max_prefill_rows=2, prefill_chunk=8
    )
    results = drive(engine, arrivals)
    check_against_generate(model, results)
    stopped = next(r for r, (s, _) in results.items() if s.get("stop_tokens"))
    assert engine.request(stopped).finish_reason == "stop"
    assert results[stopped][1][-1] == stop_at and len(results[stopped][1]) < 12


def test_preemption_recomputes_and_matches(model):
    """A pool too small for the requests' outputs together: later requests are preempted
    (pages freed, recomputed on readmission) and every request's tokens still match."""
    rng = np.random.default_rng(1)
    ps = prompts(rng, (11, 6, 14, 3))
    arrivals = [
        [
            dict(prompt_tokens=p, max_new_tokens=m, sampling=s)
            for p, m, s in zip(ps, (20, 18, 9, 22), (None, SAMPLED, None, None), strict=True)
        ]
    ]
    # 13 pages of 4 tokens: each request alone fits (at most 9 pages), all four do not.
    engine = Engine(
        model, num_pages=14, page_size=PAGE, max_batch=4, max_prefill_rows=2, prefill_chunk=8
    )
    results = drive(engine, arrivals)
    assert engine.stats.preemptions > 0
    assert any(engine.request(r).num_preemptions for r in results)
    check_against_generate(model, results)


def test_prefix_is_prefilled_once(model):
    """A 10-token prefix over pages of 4: two full pages shared by reference, the third, where
    the prompts part, copied (copy-on-write) with the prefix's two tokens in it."""
    rng = np.random.default_rng(2)
    prefix = prompts(rng, (2 * PAGE + 2,))[0]
    suffixes = prompts(rng, (5, 1, 7, 2))
    ps = [prefix + s for s in suffixes]
    arrivals = [
        [dict(prompt_tokens=ps[0], max_new_tokens=4)],
        [dict(prompt_tokens=ps[1], max_new_tokens=6, sampling=SAMPLED)],  # while 0 prefills
        [],
        [],
        [],
        [dict(prompt_tokens=ps[2], max_new_tokens=3), dict(prompt_tokens=ps[3], max_new_tokens=5)],
    ]
    engine = Engine(
        model, num_pages=48, page_size=PAGE, max_batch=4, max_prefill_rows=2, prefill_chunk=6
    )
    results = drive(engine, arrivals)
    check_against_generate(model, results)
    stats = engine.stats
    assert stats.prompt_tokens_computed == len(prefix) + sum(map(len, suffixes))
    assert stats.prefix_hit_tokens == 3 * len(prefix)
    # Released full prefix pages stay cached (a partial page is indexed only while held): a
    # request after all others finished still shares the two full pages.
    late = drive(engine, [[dict(prompt_tokens=prefix + [5, 6], max_new_tokens=2)]])
    check_against_generate(model, late)
    assert engine.stats.prefix_hit_tokens == 3 * len(prefix) + 2 * PAGE


def test_prompt_ending_inside_a_shared_page(model):
    """A prompt that is a prefix of a running one, ending inside its page: it copies the page
    and computes only its last token (whose logits draw its first output token)."""
    rng = np.random.default_rng(4)
    long = prompts(rng, (3 * PAGE + 1,))[0]
    short = long[: 2 * PAGE + 3]
    engine = Engine(
        model, num_pages=48, page_size=PAGE, max_batch=4, max_prefill_rows=1, prefill_chunk=16
    )
    results = drive(
        engine,
        [
            [dict(prompt_tokens=long, max_new_tokens=5)],
            [],
            [dict(prompt_tokens=short, max_new_tokens=4)],
        ],
    )
    check_against_generate(model, results)
    assert engine.stats.prompt_tokens_computed == len(long) + 1
    assert engine.stats.prefix_hit_tokens == len(short) - 1


def test_warm_steps_do_not_recompile(model):
    rng = np.random.default_rng(3)
    engine = Engine(
        model, num_pages=48, page_size=PAGE, max_batch=2, max_prefill_rows=1, prefill_chunk=8
    )
    trace = [[dict(prompt_tokens=p, max_new_tokens=4)] for p in prompts(rng, (9, 3, 12))]
    drive(engine, trace)
    compiled = _device_step._cache_size()
    trace = [[dict(prompt_tokens=p, max_new_tokens=5)] for p in prompts(rng, (7, 2, 10))]
    check_against_generate(model, drive(engine, trace))
    assert _device_step._cache_size() == compiled


def test_abort_releases_pages(model):
    engine = Engine(model, num_pages=32, page_size=PAGE, max_batch=2, prefill_chunk=8)
    a = engine.add_request([1, 2, 3, 4, 5], 20)
    b = engine.add_request([6, 7], 3)
    engine.step()
    engine.step()
    engine.abort(a)
    engine.scheduler.check()
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check()
    assert engine.request(a).finish_reason == "abort"
    assert engine.request(b).output == reference(model, [6, 7], 3)
    assert engine.pool.num_used == 0


def test_stop_releases_pages_at_once(model):
    """`Engine.stop` (a stop condition the engine does not see, such as a stop string): the
    request's pages go back to the pool at once, and it draws no token after the step in flight."""
    engine = Engine(model, num_pages=32, page_size=PAGE, max_batch=2, prefill_chunk=8)
    a = engine.add_request([1, 2, 3, 4, 5], 20)
    b = engine.add_request([6, 7, 8, 9, 10, 11, 12], 12)
    for _ in range(4):
        engine.step()
    held = len(engine.request(a).pages)
    assert held and engine.pool.num_used == held + len(engine.request(b).pages)
    output = list(engine.request(a).output)
    engine.stop(a)
    engine.scheduler.check()
    assert engine.pool.num_used == len(engine.request(b).pages)  # a's pages are free now
    rows, b_read = engine.stats.decode_tokens, len(engine.request(b).output)
    while engine.has_unfinished():
        out = engine.step()
        assert a not in out.tokens and a not in out.finished
        engine.scheduler.check()
    r = engine.request(a)
    assert r.finish_reason == "stop" and r.output == output and r.pending == 0
    assert engine.stats.decode_tokens - rows <= 12 - b_read  # b's rows only
    assert engine.request(b).output == reference(model, [6, 7, 8, 9, 10, 11, 12], 12)
    assert engine.pool.num_used == 0
    engine.stop(a)  # finished ids are ignored


def test_page_pool():
    pool = PagePool(8)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_available == 4
    pool.register(a[0], 100)
    pool.register(a[1], 101)
    pool.mark_written(a[0])  # a[1] is registered but its step is not dispatched yet
    assert pool.lookup([100, 101, 102]) == a[:2] and not pool.is_written(a[1])
    pool.share(a[:1])
    assert pool.refs(a[0]) == 2
    pool.check([a, a[:1]])
    pool.release(a)
    # a[0] still shared; a[1] unwritten: forgotten and free; a[2] free.
    assert pool.lookup([100, 101]) == a[:1] and pool.num_available == 6
    pool.release(a[:1])
    pool.check([])
    assert pool.num_available == 7 and pool.lookup([100]) == a[:1]  # cached, still findable
    assert pool.allocate(8) is None
    got = pool.allocate(7)  # free pages first, then the cached one (evicted)
    assert got[-1] == a[0] and pool.lookup([100]) == []
    pool.check([got])
    pool.release(got)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(got[:1])


def test_bad_requests(model):
    engine = Engine(model, num_pages=8, page_size=PAGE, max_batch=2)
    with pytest.raises(ValueError, match="prompt_tokens must hold"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match=r"prompt_tokens must lie in \[0, 97\)"):
        engine.add_request([1, 97], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        engine.add_request([1], 0)
    with pytest.raises(ValueError, match="exceed max_seq_len 28"):
        engine.add_request([1] * 20, 10)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0)


def test_sampling_seed_is_jax_key(model):
    """The engine draws with jax.random.key(seed) folded with the token index, as generate."""
    spec = dict(
        prompt_tokens=[3, 1, 4, 1, 5],
        max_new_tokens=6,
        sampling=SamplingParams(temperature=1.0, seed=2**31 - 1),
    )
    engine = Engine(model, num_pages=16, page_size=PAGE, max_batch=1, prefill_chunk=8)
    check_against_generate(model, drive(engine, [[spec]]))
    assert jax.random.key_data(jax.random.key(2**31 - 1)).tolist()[1] == 2**31 - 1


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("SERVE_SEEDS", "0").split()])
def test_mixed_trace_with_shared_prefixes_and_preemption(model, seed):
    """Everything at once: random arrivals, prompts built from two shared prefixes of odd
    lengths, greedy and sampled requests with stop tokens, and a pool small enough to preempt
    (seed 0: 5 preemptions). SERVE_SEEDS="0 1 2 ..." runs more traces (33 more passed)."""
    rng = np.random.default_rng(100 + seed)
    heads = prompts(rng, (7, 13))
    arrivals = [[] for _ in range(12)]
    for _ in range(9):
        head = heads[int(rng.integers(0, 3)) - 1] if rng.random() < 0.8 else []
        prompt = head + prompts(rng, (int(rng.integers(1, 8)),))[0]
        spec = dict(prompt_tokens=prompt, max_new_tokens=int(rng.integers(1, 16)))
        if rng.random() < 0.4:
            spec["sampling"] = SamplingParams(
                temperature=0.7, top_p=0.9, seed=int(rng.integers(99))
            )
        if rng.random() < 0.3:
            spec["stop_tokens"] = [int(t) for t in rng.integers(0, CONFIG.vocab_size, 8)]
        arrivals[int(rng.integers(0, len(arrivals)))].append(spec)
    engine = Engine(
        model, num_pages=14, page_size=PAGE, max_batch=4, max_prefill_rows=2, prefill_chunk=8
    )
    check_against_generate(model, drive(engine, arrivals))
    assert engine.stats.prefix_hit_tokens > 0
