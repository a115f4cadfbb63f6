"""End-to-end generation benchmark: a Llama-style decoder on jax_flash against the same model
with `jax.nn.dot_product_attention` over a dense KV cache.

    python benchmarks/e2e_bench.py [--batch 1 32] [--prompt-len 2048] [--new-tokens 256]
                                   [--baselines cudnn xla] [--out bench-results]
    python benchmarks/e2e_bench.py --tiny          # a small model and sizes, runs on CPU

The model is a random-weight ~1.2B-parameter Llama 3.2 1B-shaped decoder (16 layers, hidden
2048, 32/8 query/KV heads of 64, SwiGLU 8192, vocab 128256, tied embeddings) in bfloat16.
jax_flash runs `jax_flash.models.generate`: packed prefill through `flash_attention_varlen`,
then a `lax.while_loop` of decode steps through `paged_attention` with the paged cache donated.
Each baseline runs the same model and weights (`jax_flash.nn.Dense` steps): a padded prefill and
a `lax.while_loop` of decode steps over a dense `[B, prompt + new, Hkv, D]` cache donated and
written in place, attention by `jax.nn.dot_product_attention(implementation=...)`. Both decode
greedily with `jax_flash.sample` and never stop early (no EOS), so they do the same work.

Every system is compiled and run once, then timed over --repeats runs (median; each run times its
own prefill and decode phases: `jax_flash.bench.median_of_runs`). Reported:
prefill tokens/s (B * prompt / prefill time), decode tokens/s (B * (new - 1) / decode-loop
time) and end-to-end tokens/s (B * new / total), and how many leading tokens agree with
jax_flash's. The table is printed and JSON goes to --out with the device, versions and config.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

import jax_flash
from jax_flash import bench
from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate
from jax_flash.nn import Dense
from jax_flash.ops.sampling import sample

LLAMA_1B = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    dtype="bfloat16",
)
TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    dtype="bfloat16",
)


# ---------------------------------------------------------------------------------------------
# Baseline: the same model over a dense cache with jax.nn.dot_product_attention.


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _dense_prefill(graphdef, impl, state, kv, tokens, lens):
    model = nnx.merge(graphdef, state)
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    h, kv = model.forward(tokens, positions, kv, Dense(jnp.zeros_like(lens), lens, impl))
    logits = model.logits(h[jnp.arange(B), lens - 1])
    return kv, sample(logits, jax.random.key(0), temperature=0.0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _dense_decode(graphdef, impl, steps, state, kv, first, lens):
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    out = jnp.zeros((B, steps + 1), jnp.int32).at[:, 0].set(first)
    ones = jnp.ones((B,), jnp.int32)

    def body(i, carry):
        kv, tok, lens, out = carry
        h, kv = model.forward(tok[:, None], lens[:, None], kv, Dense(lens, ones, impl))
        tok = sample(model.logits(h[:, -1]), jax.random.key(0), temperature=0.0)
        return kv, tok, lens + 1, out.at[:, i + 1].set(tok)

    kv, _, _, out = jax.lax.fori_loop(0, steps, body, (kv, first, lens, out))
    return kv, out


def run_dense(model, prompts, new_tokens, impl):
    """Greedy generation over a dense cache; returns (tokens [B, new], prefill_s, decode_s)."""
    c = model.config
    B, S = prompts.shape
    shape = (B, S + new_tokens, c.num_key_value_heads, c.head_dim)
    kv = tuple((jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype)) for _ in model.layers)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(prompts)
    lens = jnp.full((B,), S, jnp.int32)
    t0 = time.perf_counter()
    kv, first = _dense_prefill(graphdef, impl, state, kv, tokens, lens)
    first.block_until_ready()
    t1 = time.perf_counter()
    kv, out = _dense_decode(graphdef, impl, new_tokens - 1, state, kv, first, lens)
    out = np.asarray(out)
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1


def run_flash(model, prompts, new_tokens, page_size):
    out = generate(model, prompts.tolist(), new_tokens, page_size=page_size)
    return np.asarray(out.tokens), out.prefill_s, out.decode_s


# ---------------------------------------------------------------------------------------------


def agree(a, b) -> float:
    """Mean number of leading tokens on which two [B, N] generations agree."""
    same = np.cumprod(a == b, axis=1)
    return float(same.sum(axis=1).mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model and sizes (CPU)")
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--baselines", nargs="*", help="dot_product_attention implementations")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out",
        default=bench.DEFAULT_OUT,
        help=f"folder for the JSON (default: {bench.DEFAULT_OUT})",
    )
    args = parser.parse_args()

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    config = TINY if args.tiny else LLAMA_1B
    batches = args.batch or ([1, 4] if args.tiny else [1, 32])
    prompt_len = args.prompt_len or (64 if args.tiny else 2048)
    new_tokens = args.new_tokens or (16 if args.tiny else 256)
    baselines = (
        args.baselines if args.baselines is not None else (["cudnn", "xla"] if on_gpu else ["xla"])
    )

    print(
        f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
        f"jax_flash {jax_flash.__version__}; python {platform.python_version()}"
    )
    t0 = time.perf_counter()
    model = LlamaForCausalLM.random(config, seed=0)
    n_params = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    print(
        f"model: {n_params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}"
        f"x{config.head_dim}, {config.dtype}; built in {time.perf_counter() - t0:.1f} s"
    )
    print(f"prompt {prompt_len} tokens, {new_tokens} new tokens, greedy, batches {batches}\n")

    rows = []
    header = (
        f"{'system':<24}{'B':>4}{'prefill tok/s':>15}{'decode tok/s':>14}{'e2e tok/s':>12}"
        f"{'prefill ms':>12}{'decode ms':>11}{'agree':>7}"
    )
    print(header)
    for B in batches:
        rng = np.random.default_rng(B)
        prompts = rng.integers(0, config.vocab_size, (B, prompt_len)).astype(np.int32)
        systems = [
            (
                "jax_flash (paged)",
                functools.partial(run_flash, model, prompts, new_tokens, args.page_size),
            )
        ]
        systems += [
            (f"dense {impl}", functools.partial(run_dense, model, prompts, new_tokens, impl))
            for impl in baselines
        ]
        reference_tokens = None
        for name, fn in systems:
            row = dict(system=name, batch=B, prompt_len=prompt_len, new_tokens=new_tokens)
            try:
                tokens, prefill_s, decode_s = bench.median_of_runs(fn, args.repeats)
            except Exception as e:  # a baseline the device does not support: record, go on
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc(limit=2, file=sys.stderr)
                print(f"{name:<24}{B:>4}  failed: {row['error'][:80]}")
                rows.append(row)
                continue
            if reference_tokens is None:
                reference_tokens = tokens
            row.update(
                prefill_s=prefill_s,
                decode_s=decode_s,
                prefill_tokens_per_s=B * prompt_len / prefill_s,
                decode_tokens_per_s=B * (new_tokens - 1) / decode_s,
                e2e_tokens_per_s=B * new_tokens / (prefill_s + decode_s),
                tokens_agreeing_with_jax_flash=agree(tokens, reference_tokens),
            )
            rows.append(row)
            print(
                f"{name:<24}{B:>4}{row['prefill_tokens_per_s']:>15.1f}"
                f"{row['decode_tokens_per_s']:>14.1f}{row['e2e_tokens_per_s']:>12.1f}"
                f"{prefill_s * 1e3:>12.1f}{decode_s * 1e3:>11.1f}"
                f"{row['tokens_agreeing_with_jax_flash']:>7.1f}"
            )

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    kind = device.device_kind.replace(" ", "_")
    path = os.path.join(args.out, f"e2e{'_tiny' if args.tiny else ''}_{kind}_{stamp}.json")
    record = dict(
        benchmark="e2e",
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        jax_flash=jax_flash.__version__,
        python=platform.python_version(),
        config={k: v for k, v in vars(config).items()},
        parameters=n_params,
        page_size=args.page_size,
        repeats=args.repeats,
        rows=rows,
    )
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
