"""The serving engine over a tensor-parallel model (`shard_model` on 2 and 4 devices): the
tokens, the page pool after every step and the scheduler's counts equal the one-device engine's
on a trace with arrivals, prefix sharing (copy-on-write of a partial page), preemption, greedy
and sampled requests; the pools stay split by KV heads through the donated steps, and the
compiled step gathers no pool (its only collectives are tensor parallelism's own).

The checks need 4 devices: on a plain CPU run `test_on_host_devices` runs them in a child
process with 4 CPU host devices. A tiny float32 model (GQA 8:4), a short trace.
"""

import re

import jax
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jax_flash.models import LlamaConfig, LlamaForCausalLM, shard_model  # noqa: E402
from jax_flash.serve import Engine, SamplingParams  # noqa: E402
from jax_flash.serve.device_step import copy_cache_pages, run_step  # noqa: E402
from jax_flash.serve.scheduler import StepPlan  # noqa: E402

from _util import run_on_host_devices  # noqa: E402

DEVICES = 4
needs_devices = pytest.mark.skipif(
    jax.device_count() < DEVICES, reason=f"needs {DEVICES} devices (run in a child process)"
)
# 4 KV heads split 2 and 4 ways; vocab divisible by 4 (vocab-parallel embedding and head).
CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=128,
)
PAGE = 4
# 15 pages of 4 tokens: every request fits alone, the trace's together do not (preemption).
# No admission reserve: the trace must preempt (the engine's default reserve avoids it). Two
# decode steps a dispatch where no prompt chunk is fed: the multi-step loop on split pools too.
ENGINE = dict(
    num_pages=16, page_size=PAGE, max_batch=3, decode_buckets=[3], max_prefill_rows=1,
    prefill_chunk=8, reserve_tokens=0, decode_steps=2,
)  # fmt: skip
COLLECTIVE = r"= (\(.*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="the checks run in this process")
def test_on_host_devices():
    run_on_host_devices(__file__, DEVICES, "sharded")


def _trace():
    """Arrivals per step: prompts on a 10-token prefix (two full pages and a partial one,
    copied on write), greedy and sampled, outputs long enough to run the pool dry."""
    rng = np.random.default_rng(5)
    tokens = lambda n: rng.integers(0, CONFIG.vocab_size, n).tolist()  # noqa: E731
    prefix = tokens(2 * PAGE + 2)
    sampled = lambda seed: SamplingParams(temperature=0.8, top_p=0.9, seed=seed)  # noqa: E731
    return [
        [dict(prompt_tokens=prefix + tokens(5), max_new_tokens=12)],
        [dict(prompt_tokens=tokens(7), max_new_tokens=14, sampling=sampled(3))],
        [],
        [dict(prompt_tokens=prefix + tokens(3), max_new_tokens=10, sampling=sampled(8))],
        [dict(prompt_tokens=prefix + tokens(1), max_new_tokens=9, stop_tokens=[7, 11])],
        [],
        [dict(prompt_tokens=tokens(12), max_new_tokens=6)],
    ]


def _serve(model):
    """The trace through an engine over ``model``: each request's tokens, the pool's
    (used, available) pages after every step, the scheduler's counts, the pages copied.
    Checks that the step compiles once per step shape (the layouts it returns are those it
    takes)."""
    engine = Engine(model, **ENGINE)
    copies, shapes = [], set()
    schedule, shape_of = engine.scheduler.schedule, engine._shape

    def counting(rows):
        plan = schedule(rows)
        copies.extend(plan.copies if plan is not None else ())
        return plan

    def recording(*args):
        shape = shape_of(*args)
        shapes.add(shape)
        return shape

    engine.scheduler.schedule, engine._shape = counting, recording
    compiled = run_step._cache_size()
    arrivals, ids, pages, k = _trace(), [], [], 0
    while k < len(arrivals) or engine.has_unfinished():
        ids += [engine.add_request(**spec) for spec in (arrivals[k] if k < len(arrivals) else ())]
        engine.step()
        engine.scheduler.check()
        pages.append((engine.pool.num_used, engine.pool.num_available))
        k += 1
        assert k < 300, "the engine does not finish"
    assert run_step._cache_size() - compiled <= len(shapes)
    tokens = [engine.request(i).output for i in ids]
    return engine, tokens, pages, engine.stats, len(copies)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.random(CONFIG, seed=2)


@pytest.fixture(scope="module")
def one_device(model):
    return _serve(model)


def _mesh(n):
    return jax.make_mesh((n,), ("tensor",), devices=jax.devices()[:n])


@needs_devices
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_engine_equals_one_device(model, one_device, n):
    _, want, want_pages, want_stats, want_copies = one_device
    assert want_stats.preemptions > 0 and want_stats.prefix_hit_tokens > 0 and want_copies > 0
    engine, got, pages, stats, copies = _serve(shard_model(model, _mesh(n)))
    assert engine.parallel is not None and engine.parallel.size == n
    assert got == want
    assert pages == want_pages  # the same pages held and freed after every step
    assert pages[-1] == (0, ENGINE["num_pages"] - 1)
    assert (stats, copies) == (want_stats, want_copies)
    split = engine.parallel.sharding(4, 2)  # [pages, page, KV heads, head dim]
    for pool in jax.tree.leaves(engine._kv):
        assert pool.sharding.is_equivalent_to(split, 4)
        assert {s.data.shape[2] for s in pool.addressable_shards} == {4 // n}
    assert engine._previous.sharding.is_fully_replicated


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result array) of every collective in compiled HLO, sorted."""
    got = []
    for result, op in re.findall(COLLECTIVE + r"(?:-start)?\(", hlo):
        arrays = re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", result)
        if op == "all-gather" and len(arrays) > 1:  # async start: (operands, results)
            arrays = arrays[len(arrays) // 2 :]
        got += [(op, a) for a in arrays]
    return sorted(got)


@needs_devices
@pytest.mark.parametrize("greedy", [True, False])
def test_sharded_step_gathers_no_pool(model, greedy):
    """The compiled step (a decode bucket and a chunk row) holds only tensor parallelism's
    collectives: an all-reduce of the hidden states after the embedding and after every
    o_proj and down_proj, an all-gather of the step's logits; the page copy holds none. Both
    keep the pools split, and a step consumes (donates) the pools it was given."""
    engine = Engine(shard_model(model, _mesh(DEVICES)), **ENGINE)
    shape = engine._shape(3, 1, greedy)
    args = engine._step_args(shape, StepPlan([], [], []))
    compiled = run_step.lower(*args).compile()
    c = CONFIG
    needed = [("all-reduce", f"f32[{shape.tokens},{c.hidden_size}]")] * (
        1 + 2 * c.num_hidden_layers
    )
    needed.append(("all-gather", f"f32[{shape.rows},{c.vocab_size}]"))
    assert _collectives(compiled.as_text()) == sorted(needed)
    out_sharding, pool_shardings = compiled.output_shardings
    assert out_sharding.is_fully_replicated
    assert all(s.spec[2] == "tensor" for s in jax.tree.leaves(pool_shardings))

    ids = engine._to_device(np.array([1, -1, -1], np.int32))
    copy = copy_cache_pages.lower(None, engine.parallel, engine._kv, ids, ids + 1).compile()
    assert _collectives(copy.as_text()) == []
    assert all(s.spec[2] == "tensor" for s in jax.tree.leaves(copy.output_shardings))

    before = jax.tree.leaves(engine._kv)
    engine.run([dict(prompt_tokens=[1, 2, 3], max_new_tokens=2)])
    assert all(x.is_deleted() for x in before)


@needs_devices
def test_sharded_cli_errors(tmp_path, capsys):
    """``--tensor-parallel N``: N past the visible devices fails before the weights load; N
    not dividing the KV heads fails naming both."""
    pytest.importorskip("aiohttp")
    from test_serve_http import write_checkpoint  # 2 KV heads

    from jax_flash.serve.__main__ import main

    write_checkpoint(tmp_path)
    visible = jax.device_count()
    too_many = (visible + 1, rf"must be in \[1, {visible}\]")
    for n, message in (too_many, (4, "num_key_value_heads 2")):
        with pytest.raises(SystemExit):
            main(["--checkpoint", str(tmp_path), "--tensor-parallel", str(n)])
        assert re.search(rf"--tensor-parallel {n}: .*{message}", capsys.readouterr().err)
