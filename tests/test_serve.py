"""The serving engine (`jax_flash.serve`): every request's tokens equal those of `generate` run
on it alone (greedy, and sampling with the same seed) under staggered arrivals, stop tokens,
preemption from a tiny page pool (with and without admission's reserve for the running
requests' growth) and prefix sharing; the page pool's invariants after every step; the reserve
cuts preemptions; a shared prefix is prefilled once; steps of a warm engine do not recompile.

A tiny float32 model (GQA 4:2, odd vocabulary) on the CPU kernels.
"""

import os
import re

import jax
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate  # noqa: E402
from jax_flash.serve import Engine, PagePool, SamplingParams, Status  # noqa: E402
from jax_flash.serve.device_step import run_decode_steps, run_step  # noqa: E402

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


def pool_of_14(model, reserve_tokens, decode_steps=1):
    """An engine of 14 pages (13 for requests), 4 rows, two 8-token chunks a step: small enough
    that a few requests fill it."""
    return Engine(
        model,
        num_pages=14,
        page_size=PAGE,
        max_batch=4,
        max_prefill_rows=2,
        prefill_chunk=8,
        reserve_tokens=reserve_tokens,
        decode_steps=decode_steps,
    )


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


@pytest.mark.parametrize(
    "seed, lengths, max_new, reserve",
    [
        # 13 pages of 4 tokens: each request alone fits (at most 9 pages), all four do not.
        # Admission on the known tokens alone (no reserve): all four start, the pool runs dry.
        (1, (11, 6, 14, 3), (20, 18, 9, 22), 0),
        # A reserve of 8 tokens (2 pages each) lets all three in, but their outputs grow past
        # it (8 pages each, 13 in the pool): preemption still frees pages.
        (5, (3, 4, 2), (30, 29, 31), 8),
    ],
    ids=["no_reserve", "past_the_reserve"],
)
def test_preemption_recomputes_and_matches(model, seed, lengths, max_new, reserve):
    """A pool too small for the requests' outputs together: later requests are preempted
    (pages freed, recomputed on readmission) and every request's tokens, greedy and sampled,
    still match."""
    ps = prompts(np.random.default_rng(seed), lengths)
    samplings = [SAMPLED if i == 1 else None for i in range(len(ps))]
    arrivals = [
        [
            dict(prompt_tokens=p, max_new_tokens=m, sampling=s)
            for p, m, s in zip(ps, max_new, samplings, strict=True)
        ]
    ]
    engine = pool_of_14(model, reserve)
    results = drive(engine, arrivals)
    assert engine.stats.preemptions > 0
    assert any(engine.request(r).num_preemptions for r in results)
    check_against_generate(model, results)


def test_reserve_cuts_preemptions(model):
    """Six requests of 8 prompt tokens (2 pages) growing to 15 tokens (4 pages), 13 pages.
    Admitting on the known tokens, four start (8 pages) and their growth (16) preempts; with a
    reserve of 8 tokens each counts its 4 pages, three start (12) and none is preempted; a
    larger reserve changes nothing here (a reserve stops at the request's last token)."""
    rng = np.random.default_rng(6)
    ps = prompts(rng, (8,) * 6)
    specs = [
        dict(prompt_tokens=p, max_new_tokens=8, sampling=SAMPLED if i % 3 == 1 else None)
        for i, p in enumerate(ps)
    ]
    preemptions, running = {}, {}
    for reserve in (0, 8, 10**6):
        engine = pool_of_14(model, reserve)
        schedule, most = engine.scheduler.schedule, [0]

        def counting(rows, schedule=schedule, most=most, engine=engine):
            plan = schedule(rows)
            most[0] = max(most[0], len(engine.scheduler.running))
            return plan

        engine.scheduler.schedule = counting
        check_against_generate(model, drive(engine, [specs]))
        preemptions[reserve], running[reserve] = engine.stats.preemptions, most[0]
    assert preemptions[0] > 0 and running[0] == 4
    assert preemptions[8] == 0 and running[8] == 3
    assert preemptions[10**6] == 0 and running[10**6] == 3


def test_reserve_never_blocks_a_lone_request(model):
    """A request whose prompt and output need the whole pool (13 pages of 4 tokens) is admitted
    with any reserve once it runs alone, and the request queued behind it runs after it."""
    rng = np.random.default_rng(7)
    ps = prompts(rng, (3, 5))
    specs = [
        dict(prompt_tokens=ps[0], max_new_tokens=50),
        dict(prompt_tokens=ps[1], max_new_tokens=4),
    ]
    engine = pool_of_14(model, 10**6)
    results = drive(engine, [specs])
    check_against_generate(model, results)
    first, second = (engine.request(rid) for rid in results)
    assert second.token_times_s[0] > first.token_times_s[-1]  # one at a time
    assert engine.stats.preemptions == 0


def test_cached_prompt_filling_the_pool_runs(model):
    """A prompt of 12 whole pages, run again once its pages are cached, with an output that
    fills the pool (13 pages): its last prompt page, copied rather than shared (its last token
    must be fed), would be held beside the copy, one page more than the pool has; the request
    feeds that page's tokens instead of waiting forever (default reserve)."""
    prompt = prompts(np.random.default_rng(8), (12 * PAGE,))[0]
    engine = Engine(
        model, num_pages=14, page_size=PAGE, max_batch=4, max_prefill_rows=2, prefill_chunk=8
    )
    for _ in range(2):
        check_against_generate(
            model, drive(engine, [[dict(prompt_tokens=prompt, max_new_tokens=5)]])
        )
    assert engine.stats.prefix_hit_tokens == 11 * PAGE


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
    compiled = run_step._cache_size(), run_decode_steps._cache_size()
    trace = [[dict(prompt_tokens=p, max_new_tokens=5)] for p in prompts(rng, (7, 2, 10))]
    check_against_generate(model, drive(engine, trace))
    assert (run_step._cache_size(), run_decode_steps._cache_size()) == compiled


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
    with pytest.raises(ValueError, match="reserve_tokens"):
        Engine(model, reserve_tokens=-1)
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(model, decode_steps=0)


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


@pytest.mark.parametrize(
    "reserve, decode_steps", [(0, 1), (8, 1), (0, 3), (8, 3)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("SERVE_SEEDS", "0").split()])
def test_mixed_trace_with_shared_prefixes_and_preemption(model, seed, reserve, decode_steps):
    """Everything at once: random arrivals, prompts built from two shared prefixes of odd
    lengths, greedy and sampled requests with stop tokens, and a pool small enough to preempt
    (seed 0: 5 preemptions with no reserve, 1 with a reserve of 8 tokens); with decode_steps
    3, dispatches of several decode steps among them. SERVE_SEEDS="0 1 2 ..." runs more traces
    (33 more passed)."""
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
    engine = pool_of_14(model, reserve, decode_steps)
    schedule, most_steps = engine.scheduler.schedule, [1]

    def recording(rows):
        plan = schedule(rows)
        most_steps[0] = max(most_steps[0], plan.steps if plan else 1)
        return plan

    engine.scheduler.schedule = recording
    check_against_generate(model, drive(engine, arrivals))
    assert engine.stats.prefix_hit_tokens > 0
    assert most_steps[0] == decode_steps


def test_decode_loop_has_a_static_trip_count(model):
    """The decode loop runs its K steps as a trip count XLA knows when compiling: a count the
    device computes makes the GPU loop copy its condition to the host every step, which blocks
    the dispatch until the loop ends (docs/serving.md, "Several decode steps a dispatch")."""
    from jax_flash.serve.scheduler import StepPlan

    engine = Engine(model, num_pages=32, page_size=PAGE, max_batch=2, prefill_chunk=8,
                    decode_steps=3)  # fmt: skip
    shape = engine._shape(2, 0, True, 3)
    hlo = run_decode_steps.lower(*engine._step_args(shape, StepPlan([], [], []))).compile()
    loops = re.findall(r"\bwhile\(.*", hlo.as_text())
    assert loops and all('"known_trip_count":{"n":"3"}' in loop for loop in loops), loops


def test_decode_steps_take_pages_ahead_or_fall_back_to_one():
    """The scheduler alone (no model): decode rows of a step without prompt chunks draw up to
    `decode_steps` tokens, no more than their requests may still draw, with the pages for the
    tokens they cache taken before the step; when the pool cannot hold those pages, every row
    takes one step (no row preempts another for tokens ahead)."""
    from jax_flash.serve.request import Request
    from jax_flash.serve.scheduler import Scheduler

    def running(pool_pages, max_new):
        pool = PagePool(pool_pages)
        s = Scheduler(pool, 4, max_batch=4, max_prefill_rows=1, prefill_chunk=8,
                      reserve_tokens=0, decode_steps=4)  # fmt: skip
        reqs = [
            Request(i, [1, 2, 3], m, frozenset(), SamplingParams(), 0.0)
            for i, m in enumerate(max_new)
        ]
        for r in reqs:
            s.add(r)
        plan = s.schedule({})  # the prompts: one chunk step each
        while plan.chunks:
            for r in plan.draws:  # the host reads each prompt's first token
                if r is not None:
                    r.pending -= 1
                    r.output.append(7)
            plan = s.schedule({})
        return s, pool, reqs, plan

    # Pages of 4 tokens. The prompts ran one chunk a step, the decode rows beside them one
    # step each; now rows 0 and 1 decode alone (request 2 drew its only token).
    s, pool, reqs, plan = running(64, (10, 5, 1))
    assert [r.id for r, _ in plan.decode] == [0, 1]
    left = [r.max_new_tokens - len(r.output) for r in reqs[:2]]
    assert plan.steps == 4 and plan.counts == [min(4, n) for n in left]
    for r, n in zip(reqs[:2], plan.counts, strict=True):
        assert r.pending == n
        assert len(r.pages) == -(-r.num_cached // 4)  # pages for every position it feeds
    s.check()

    # A pool of just the pages the requests hold (page 0 is the null page): one step.
    s, pool, reqs, plan = running(1 + 3 * 2, (10, 10, 10))
    assert plan.decode and not plan.chunks
    assert plan.steps == 1 and plan.counts == []
    assert [r.pending for r in reqs] == [1, 1, 1]
    s.check()
