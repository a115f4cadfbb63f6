"""Serving benchmark: `jax_flash.serve.Engine` (continuous batching) against static batching
with `jax_flash.models.generate`, on the same model and cache memory, over a request trace; and
the batch-1 decode step of the engine measured against reading the weights.

    python benchmarks/serve_bench.py            # 1.24B Llama-shaped bf16 model (e2e_bench.py)
    python benchmarks/serve_bench.py --tiny     # a small model and trace, runs on CPU
    python benchmarks/serve_bench.py --trace longtail   # long-tailed lengths (below)

Trace: ``--requests`` requests with Poisson arrivals (``--rate`` per second), random tokens,
greedy, no stop token; the shared-prefix variant puts one ``--shared-prefix``-token prefix
before every prompt. Lengths (``--trace``; the JSON records which ran, with its parameters and
token counts):

- ``uniform`` (the default): prompt and output lengths uniform in ``--prompt-len`` /
  ``--output-len`` (64-1024 and 16-512).
- ``longtail``: log-normal lengths, the shape of public chat-serving traces (ShareGPT,
  LMSYS-Chat-1M, Azure's LLM-inference traces: most outputs a few hundred tokens or fewer, a
  tail into the thousands). Outputs: median ``--output-median`` (128), log-sd 1.2, capped at
  ``--max-output`` (2048): mean ~250, 90th percentile ~600, ~1% at the cap. Prompts: median
  the geometric mean of ``--prompt-len`` (256), log-sd 1.0, clipped to that range: mean ~360.
  The mean output is about the uniform trace's (~250 against ~264), so what differs is the
  tail, which is what static batching pays for: each batch decodes until its longest output
  ends while the rows of its shorter requests idle, and continuous batching refills those
  rows at once. (``--tiny``: median 8, cap 48.)

The engine admits a request only while the pool can also hold the next ``--reserve-tokens``
tokens of every running request (default: `Engine`'s; 0 admits on the known tokens alone), and
runs up to ``--decode-steps`` decode steps in one dispatch where no prompt chunk is fed
(default: `Engine`'s ``decode_steps``, 4).

- engine: requests are added as the wall clock reaches their arrival times, and the engine
  steps (compiled beforehand by ``Engine.warmup``). Time to first token (TTFT) = the host
  reading a request's first token - its arrival; time between tokens (TBT) = between its
  consecutive tokens (zero inside a burst read together, ``--decode-steps`` > 1); time per
  output token (TPOT) = per request, its last token's time - its first's over the tokens
  between.
- static: requests in arrival order form batches of up to ``--max-batch`` whose prompts and
  outputs fit the engine's page pool at once (`generate` reserves every page a request can
  need); a batch starts when its last request has arrived and the previous batch is done, and
  runs `generate` to its longest output. Its compile time is excluded; TTFT = batch start +
  prefill - arrival, TBT = TPOT = decode time / decode steps (all rows step together).
- throughput = generated tokens / (last token - first arrival).

Decode (``--decode-context`` tokens of prompt, then ``--decode-tokens`` greedy tokens, one
request): tokens/s from the engine's mean TBT after the first token; the same compiled step
(its first decode-only dispatch, per token drawn) replayed alone on the device (no host
planning, same inputs); that step drawing with the sampling kernel (temperature
1, a variant compiled here) instead of argmax; one read of every weight (a jitted sum over the
parameters); and the bandwidth limit: weights + the request's KV at the HBM read bandwidth (a
sum over 1 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_bench import LLAMA_1B, TINY  # noqa: E402

from jax_flash import bench  # noqa: E402
from jax_flash.bench import device as bench_device  # noqa: E402
from jax_flash.models import LlamaForCausalLM, generate  # noqa: E402
from jax_flash.nn import MIN_DECODE_ROWS, pages_needed  # noqa: E402
from jax_flash.serve import Engine  # noqa: E402
from jax_flash.serve.device_step import run_decode_steps, run_step, unpack_inputs  # noqa: E402
from jax_flash.serve.scheduler import DECODE_STEPS, RESERVE_TOKENS  # noqa: E402


def random_model(config, seed=0):
    """A random-weight model drawn on the device (as `LlamaForCausalLM.random`'s
    distribution: kernels N(0, 1/fan_in), embeddings N(0, 1), norm weights 1), quicker than
    drawing a billion numbers on the host."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.iter_graph(model)):
        if not isinstance(var, nnx.Param):
            continue
        if path[-1] in ("kernel", "embedding"):
            scale = 1.0 / np.sqrt(var.shape[0]) if path[-1] == "kernel" else 1.0
            value = jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype) * scale
        else:
            value = jnp.full(var.shape, 1.0 if path[-1] == "weight" else 0.0, var.dtype)
        var.set_value(value.astype(var.dtype))
    return model


@dataclasses.dataclass(frozen=True)
class UniformLengths:
    """``--trace uniform``: prompt and output lengths uniform in ``prompt`` / ``output``
    (inclusive ranges)."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def prompt_len(self, rng) -> int:
        return int(rng.integers(*self.prompt, endpoint=True))

    def output_len(self, rng) -> int:
        return int(rng.integers(*self.output, endpoint=True))


@dataclasses.dataclass(frozen=True)
class LongTailLengths:
    """``--trace longtail``: log-normal lengths, rounded. Prompts: median the geometric mean
    of ``prompt`` (256 for 64-1024), log-sd ``prompt_sigma``, clipped to ``prompt``. Outputs:
    median ``output_median``, log-sd ``output_sigma``, clipped to ``[1, max_output]``."""

    prompt: tuple[int, int]
    output_median: float
    max_output: int
    prompt_sigma: float = 1.0
    output_sigma: float = 1.2

    def prompt_len(self, rng) -> int:
        lo, hi = self.prompt
        n = rng.lognormal(np.log(np.sqrt(lo * hi)), self.prompt_sigma)
        return int(np.clip(round(n), lo, hi))

    def output_len(self, rng) -> int:
        n = rng.lognormal(np.log(self.output_median), self.output_sigma)
        return int(np.clip(round(n), 1, self.max_output))


def make_trace(rng, n, rate, lengths, vocab, prefix=0):
    """``n`` requests: Poisson arrivals at ``rate`` per second (0: all at once), random prompt
    tokens (after one shared ``prefix``-token prefix), lengths drawn by ``lengths``
    (`UniformLengths` or `LongTailLengths`), request by request."""
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    arrivals -= arrivals[0]
    shared = rng.integers(0, vocab, prefix).tolist()
    return [
        dict(
            arrival=float(a),
            prompt=shared + rng.integers(0, vocab, lengths.prompt_len(rng)).tolist(),
            max_new=lengths.output_len(rng),
        )
        for a in arrivals
    ]


def trace_lengths(args):
    """The length distribution of ``--trace`` from the parsed arguments."""
    if args.trace == "uniform":
        return UniformLengths(tuple(args.prompt_len), tuple(args.output_len))
    return LongTailLengths(tuple(args.prompt_len), args.output_median, args.max_output)


class Progress:
    def __init__(self, label, total):
        self.label, self.total, self.done = label, total, 0
        self.t0 = time.perf_counter()

    def update(self, n=1):
        self.done += n
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        print(
            f"\r  {self.label:<22}[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}"
            f"  {time.perf_counter() - self.t0:6.1f} s",
            end="\n" if self.done >= self.total else "",
            file=sys.stderr,
            flush=True,
        )


def summarize(ttft, tbt, tpot, tokens, span):
    """``tbt``: every gap between consecutive tokens of a request (zero inside a burst of
    tokens read together, `Engine`'s ``decode_steps``); ``tpot``: per request, its decode time
    per token after the first (the gaps' mean), which bursts do not distort."""
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else None  # noqa: E731
    return dict(
        generated_tokens=int(tokens),
        span_s=span,
        throughput_tokens_per_s=tokens / span,
        ttft_p50_ms=pct(ttft, 50) * 1e3,
        ttft_p90_ms=pct(ttft, 90) * 1e3,
        tbt_p50_ms=pct(tbt, 50) * 1e3 if tbt else None,
        tbt_p90_ms=pct(tbt, 90) * 1e3 if tbt else None,
        tpot_p50_ms=pct(tpot, 50) * 1e3 if tpot else None,
        tpot_p90_ms=pct(tpot, 90) * 1e3 if tpot else None,
    )


def run_engine(engine, trace, label):
    """Replay ``trace`` in real time; returns the summary, the engine's counters and tokens."""
    progress = Progress(label, len(trace))
    before = dict(vars(engine.stats))
    t0 = time.perf_counter()
    ids, nxt = [], 0
    while nxt < len(trace) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(trace) and trace[nxt]["arrival"] <= now:
            r = trace[nxt]
            ids.append(engine.add_request(r["prompt"], r["max_new"]))
            engine.request(ids[-1]).arrival_s = t0 + r["arrival"]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, trace[nxt]["arrival"] - (time.perf_counter() - t0)))
            continue
        out = engine.step()
        if out.finished:
            progress.update(len(out.finished))
    reqs = [engine.request(i) for i in ids]
    ttft = [r.token_times_s[0] - r.arrival_s for r in reqs]
    tbt = [
        b - a for r in reqs for a, b in zip(r.token_times_s[:-1], r.token_times_s[1:], strict=True)
    ]
    tpot = [
        (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
        for r in reqs
        if len(r.token_times_s) > 1
    ]
    tokens = sum(len(r.output) for r in reqs)
    span = max(r.token_times_s[-1] for r in reqs) - t0
    stats = {k: v - before[k] for k, v in vars(engine.stats).items()}  # this run's
    stats["prompt_tokens"] = sum(len(r["prompt"]) for r in trace)
    return summarize(ttft, tbt, tpot, tokens, span), stats, [r.output for r in reqs]


def static_batches(trace, num_pages, page_size, max_batch):
    batches, cur, used = [], [], 0
    for i, r in enumerate(trace):
        need = pages_needed(len(r["prompt"]) + r["max_new"] - 1, page_size)
        if cur and (len(cur) == max_batch or used + need > num_pages - 1):
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    return batches + [cur] if cur else batches


def run_static(model, trace, num_pages, page_size, max_batch):
    batches = static_batches(trace, num_pages, page_size, max_batch)
    progress = Progress("static (generate)", len(trace))
    clock, ttft, tbt, tpot, tokens, outputs = 0.0, [], [], [], 0, [None] * len(trace)
    compile_s = 0.0  # excluded from the clock; recorded to estimate a run's wall time
    for batch in batches:
        out = generate(
            model,
            [trace[i]["prompt"] for i in batch],
            [trace[i]["max_new"] for i in batch],
            page_size=page_size,
        )
        start = max(clock, max(trace[i]["arrival"] for i in batch))
        steps = max(trace[i]["max_new"] for i in batch)
        per_step = out.decode_s / max(steps - 1, 1)
        for i, toks in zip(batch, out.tokens, strict=True):
            ttft.append(start + out.prefill_s - trace[i]["arrival"])
            tbt += [per_step] * (len(toks) - 1)
            tpot += [per_step] if len(toks) > 1 else []
            tokens += len(toks)
            outputs[i] = toks
        clock = start + out.prefill_s + out.decode_s
        compile_s += out.compile_s
        progress.update(len(batch))
    result = summarize(ttft, tbt, tpot, tokens, clock)
    result.update(batches=len(batches), compile_s=compile_s)
    return result, outputs


def measure_decode(model, engine, args):
    """Batch-1 decode at ``--decode-context``: the engine's tokens/s, its step alone on the
    device (greedy and sampling), and one read of the weights."""
    captured = {}
    pack = engine._pack

    def capture(shape, plan):  # keep the inputs of the first decode-only dispatch, to replay
        ints, floats = pack(shape, plan)
        if shape.num_chunks == 0 and not captured:  # the lone request's row (smallest bucket)
            captured.update(shape=shape, ints=ints, floats=floats)
        return ints, floats

    engine._pack = capture
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, args.decode_context).tolist()
    rid = engine.add_request(prompt, args.decode_tokens)
    while engine.has_unfinished():
        engine.step()
    del engine._pack  # the class's again
    times = engine.request(rid).token_times_s
    # From the 2nd token (decode steps only), the mean: with decode_steps > 1 the tokens come
    # in bursts, whose gaps' median says nothing.
    tbt = (times[-1] - times[1]) / (len(times) - 2)
    row = dict(
        context=args.decode_context,
        tokens=args.decode_tokens,
        engine_tbt_ms=tbt * 1e3,
        engine_tokens_per_s=1.0 / tbt,
    )

    shape, ints, floats = captured["shape"], captured["ints"], captured["floats"]
    R = shape.rows
    # A dispatch of several decode steps draws its row's count of tokens.
    step, per_dispatch = run_step, 1
    if shape.steps > 1:
        step, per_dispatch = run_decode_steps, int(unpack_inputs(shape, ints, floats)["counts"][0])
    for label, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        shape = dataclasses.replace(shape, greedy=temperature == 0)
        f = floats.copy()
        f[:R] = temperature
        f = jnp.asarray(f)
        x = jnp.asarray(ints)
        kv, prev = engine._kv, engine._previous
        for n in (2, args.replay_steps):  # the first round warms up
            t0 = time.perf_counter()
            for _ in range(n):
                prev, *_, kv = step(engine._model_static, shape, engine._params, kv, prev, x, f)
            jax.block_until_ready(prev)
            dt = (time.perf_counter() - t0) / n / per_dispatch
        engine._kv, engine._previous = kv, prev
        row[f"device_step_{label}_ms"] = dt * 1e3
        row[f"device_step_{label}_tokens_per_s"] = 1.0 / dt

    params = nnx.state(model, nnx.Param)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    read = jax.jit(lambda p: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p)))
    read(params).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(args.replay_steps // 4 or 1):
        s = read(params)
    s.block_until_ready()
    dt = (time.perf_counter() - t0) / (args.replay_steps // 4 or 1)
    c = model.config
    kv_bytes = (
        2
        * c.num_hidden_layers
        * args.decode_context
        * c.num_key_value_heads
        * c.head_dim
        * jnp.dtype(model.dtype).itemsize
    )
    # HBM read bandwidth: one sum over a 1 GiB array (the weights are many smaller arrays).
    x = jax.random.normal(jax.random.key(5), (1 << 29,), model.dtype)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    total(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        s = total(x)
    s.block_until_ready()
    bandwidth = x.size * x.dtype.itemsize / ((time.perf_counter() - t0) / 10)
    del x
    row.update(
        weight_bytes=int(weight_bytes),
        kv_bytes=int(kv_bytes),
        weight_read_ms=dt * 1e3,
        weight_read_gb_per_s=weight_bytes / dt / 1e9,
        hbm_read_gb_per_s=bandwidth / 1e9,
        bandwidth_limit_tokens_per_s=bandwidth / (weight_bytes + kv_bytes),
    )
    row["engine_fraction_of_limit"] = (
        row["engine_tokens_per_s"] / row["bandwidth_limit_tokens_per_s"]
    )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model and trace (CPU)")
    parser.add_argument(
        "--trace",
        default="uniform",
        choices=["uniform", "longtail"],
        help="length distribution of the trace (see the docstring)",
    )
    parser.add_argument("--requests", type=int)
    parser.add_argument("--rate", type=float, help="arrivals per second (0: all at once)")
    parser.add_argument("--prompt-len", type=int, nargs=2)
    parser.add_argument("--output-len", type=int, nargs=2, help="uniform trace's range")
    parser.add_argument("--output-median", type=float, help="longtail trace's median output")
    parser.add_argument("--max-output", type=int, help="longtail trace's longest output")
    parser.add_argument("--shared-prefix", type=int, help="prefix length of the shared variant")
    parser.add_argument("--num-pages", type=int)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--prefill-chunk", type=int)
    parser.add_argument("--reserve-tokens", type=int, default=RESERVE_TOKENS)
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS)
    parser.add_argument("--decode-context", type=int)
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument("--replay-steps", type=int, default=200)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["decode", "trace", "static", "prefix"],
        help="phases not to run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=bench.DEFAULT_OUT)
    args = parser.parse_args()
    tiny = args.tiny
    d = lambda v, small, big: v if v is not None else (small if tiny else big)  # noqa: E731
    args.requests = d(args.requests, 12, 48)
    args.rate = d(args.rate, 40.0, 100.0)
    args.prompt_len = d(args.prompt_len, (4, 40), (64, 1024))
    args.output_len = d(args.output_len, (2, 24), (16, 512))
    args.output_median = d(args.output_median, 8.0, 128.0)
    args.max_output = d(args.max_output, 48, 2048)
    args.shared_prefix = d(args.shared_prefix, 32, 512)
    args.num_pages = d(args.num_pages, 48, 1024)
    args.max_batch = d(args.max_batch, 4, 16)
    args.prefill_chunk = d(args.prefill_chunk, 16, 512)
    args.decode_context = d(args.decode_context, 64, 2048)
    args.decode_tokens = d(args.decode_tokens, 16, 128)
    if tiny:
        args.replay_steps = min(args.replay_steps, 20)

    device = jax.devices()[0]
    config = TINY if tiny else LLAMA_1B
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
    t0 = time.perf_counter()
    model = random_model(config, args.seed)
    n_params = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    print(
        f"model: {n_params / 1e6:.1f}M parameters, {config.dtype}, built in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    engine_kw = dict(
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        reserve_tokens=args.reserve_tokens,
        decode_steps=args.decode_steps,
        max_seq_len=max(
            args.prompt_len[1]
            + args.shared_prefix
            + (args.output_len[1] if args.trace == "uniform" else args.max_output),
            args.decode_context + args.decode_tokens,
        ),
    )
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    kind = device.device_kind.replace(" ", "_")
    variant = ("_tiny" if tiny else "") + ("" if args.trace == "uniform" else f"_{args.trace}")
    path = os.path.join(args.out, f"serve{variant}_{kind}_{stamp}.json")
    lengths = trace_lengths(args)
    record = dict(
        benchmark="serve",
        trace=dict(name=args.trace, lengths=dataclasses.asdict(lengths)),
        info=bench_device.info(device),
        config={k: str(v) for k, v in vars(config).items()},
        parameters=n_params,
        args={k: v for k, v in vars(args).items() if k != "out"},  # no machine paths
        results={},
    )

    def save():
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    res = record["results"]
    # One engine for every phase (decode rows padded to MIN_DECODE_ROWS or max_batch: fewer
    # compilations).
    engine = Engine(model, decode_buckets=[min(MIN_DECODE_ROWS, args.max_batch)], **engine_kw)
    res["engine_compile_s"] = engine.warmup(sampling=False)
    print(f"engine compiled in {res['engine_compile_s']:.1f} s")
    if "decode" not in args.skip:
        res["decode_batch1"] = row = measure_decode(model, engine, args)
        save()
        print(
            f"batch-1 decode at {row['context']} context: engine {row['engine_tokens_per_s']:.0f}"
            f" tok/s; step alone {row['device_step_greedy_tokens_per_s']:.0f} (greedy), "
            f"{row['device_step_sampling_tokens_per_s']:.0f} (sampling); bandwidth limit "
            f"{row['bandwidth_limit_tokens_per_s']:.0f} tok/s (HBM read "
            f"{row['hbm_read_gb_per_s']:.0f} GB/s; the weights' sum reads "
            f"{row['weight_read_gb_per_s']:.0f} GB/s)"
        )

    rng = np.random.default_rng(args.seed)
    trace = make_trace(rng, args.requests, args.rate, lengths, config.vocab_size)
    record["trace"].update(
        prompt_tokens=sum(len(r["prompt"]) for r in trace),
        output_tokens=sum(r["max_new"] for r in trace),
        longest_output=max(r["max_new"] for r in trace),
    )
    t = record["trace"]
    print(
        f"trace {args.trace}: {len(trace)} requests, {t['prompt_tokens']} prompt and "
        f"{t['output_tokens']} output tokens, longest output {t['longest_output']}"
    )
    if "trace" not in args.skip:
        summary, stats, outs = run_engine(engine, trace, "engine")
        res["trace_engine"] = dict(summary, counters=stats)
        save()
        if "static" not in args.skip:
            static, static_outs = run_static(
                model, trace, args.num_pages, args.page_size, args.max_batch
            )
            same = sum(a == b for a, b in zip(outs, static_outs, strict=True))
            res["trace_static"] = dict(static, requests_with_equal_tokens=same)
            print(f"requests whose tokens equal static batching's: {same} of {len(trace)}")
            res["throughput_ratio"] = (
                summary["throughput_tokens_per_s"] / static["throughput_tokens_per_s"]
            )
            save()
    if "prefix" not in args.skip:
        rng = np.random.default_rng(args.seed + 1)
        shared = make_trace(
            rng, args.requests, args.rate, lengths, config.vocab_size, prefix=args.shared_prefix
        )
        summary, stats, _ = run_engine(engine, shared, "engine, shared prefix")
        res["trace_shared_prefix_engine"] = dict(summary, counters=stats)
        save()

    lone = res.get("decode_batch1", {}).get("engine_tbt_ms")
    print(
        f"\n{'system':<28}{'tok/s':>9}{'TTFT p50 ms':>13}{'TBT p50 ms':>12}{'TBT p90 ms':>12}"
        f"{'TPOT p50 ms':>13}"
    )
    for name in ("trace_engine", "trace_static", "trace_shared_prefix_engine"):
        if name in res:
            r = res[name]
            print(
                f"{name:<28}{r['throughput_tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>13.1f}"
                f"{r['tbt_p50_ms']:>12.2f}{r['tbt_p90_ms']:>12.2f}{r['tpot_p50_ms']:>13.2f}"
            )
    if "throughput_ratio" in res:
        print(f"engine / static throughput: {res['throughput_ratio']:.2f}x")
    if lone and "trace_engine" in res:
        res["tbt_p50_over_lone"] = res["trace_engine"]["tbt_p50_ms"] / lone
        res["tpot_p50_over_lone"] = res["trace_engine"]["tpot_p50_ms"] / lone
        bursts = " (tokens in bursts: TPOT is the figure)" if args.decode_steps > 1 else ""
        print(
            f"engine TBT p50 / lone request's: {res['tbt_p50_over_lone']:.2f}; "
            f"TPOT p50 / lone request's: {res['tpot_p50_over_lone']:.2f}{bursts}"
        )
    if "trace_shared_prefix_engine" in res:
        c = res["trace_shared_prefix_engine"]["counters"]
        print(
            f"shared prefix: {c['prompt_tokens_computed']} of {c['prompt_tokens']} prompt "
            f"tokens computed, {c['prefix_hit_tokens']} found in shared pages"
        )
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
