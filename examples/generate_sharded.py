"""Tensor-parallel generation of a random-weight Llama on every visible device, against one device.

    python examples/generate_sharded.py                      # all GPUs: 1B-class model, bf16
    python examples/generate_sharded.py --devices 2 --out tp_2gpu.json
    python examples/generate_sharded.py --cpu-devices 4      # 4 CPU host devices, tiny model

The model (`--size 1b`: hidden 2048, 16 layers, 32/8 query/KV heads of 64, SwiGLU 8192, vocab
32000, bfloat16; `--size tiny`, the default on CPUs: a small float32 one) is placed
tensor-parallel on a mesh of the devices with `jax_flash.models.shard_model` (q/k/v and MLP
gate/up split by columns, o_proj and down_proj by rows, embeddings and LM head by vocabulary,
the paged KV cache by KV head) and generates greedily with `jax_flash.models.generate`, exactly
as on one device. The same prompts run on one device; the script prints prefill and decode
tokens/s of each (every run compiled first, then the median of --repeats timed runs) and checks
that sharded and single-device runs give the same tokens: exactly in float32 (a bfloat16 model
is checked through its float32 twin; in bfloat16 the row-parallel sums round differently and
greedy paths drift apart as they do between bfloat16 and float32; the agreement is printed).
Exits 1 when the float32 tokens differ. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from generate import positive_int  # examples/generate.py, beside this file

SHAPES = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=32,
    ),
    # Llama 3.2 1B-shaped, with a 32000-token vocabulary and an untied LM head.
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-devices",
        type=positive_int,
        help="run on this many CPU host devices (--xla_force_host_platform_device_count)",
    )
    parser.add_argument(
        "--devices", type=positive_int, help="use the first N visible devices (default: all)"
    )
    parser.add_argument(
        "--size", choices=tuple(SHAPES), help="model shape (default: 1b on GPUs, tiny elsewhere)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="default: bfloat16 for 1b, float32 for tiny",
    )
    counts = [
        ("--batch", 8, "prompts"),
        ("--prompt-len", None, "longest prompt (default: 512 for 1b, 48 for tiny)"),
        ("--new-tokens", None, "tokens generated per prompt (default: 128 for 1b, 24 for tiny)"),
        ("--page-size", 16, "tokens per KV-cache page"),
        ("--repeats", 3, "timed runs per system (median reported)"),
    ]
    for flag, default, text in counts:
        parser.add_argument(flag, type=positive_int, default=default, help=text)
    parser.add_argument("--out", help="write the results as JSON to this file")
    return parser.parse_args(argv)


def agree(a, b) -> float:
    """Mean number of leading tokens on which two generations (lists of lists) agree."""
    same = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same.append(n)
    return sum(same) / max(len(same), 1)


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices:  # must be set before jax starts
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        )
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import numpy as np
    from flax import nnx

    from jax_flash import bench
    from jax_flash.bench.device import info
    from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate, shard_model

    devices = jax.devices()
    if args.devices is not None:
        if args.devices > len(devices):
            sys.exit(f"--devices {args.devices}: only {len(devices)} devices visible")
        devices = devices[: args.devices]
    n = len(devices)
    on_gpu = devices[0].platform == "gpu"
    size = args.size or ("1b" if on_gpu else "tiny")
    dtype = args.dtype or ("bfloat16" if size == "1b" else "float32")
    prompt_len = args.prompt_len or (512 if size == "1b" else 48)
    new_tokens = args.new_tokens or (128 if size == "1b" else 24)
    if dtype == "float32":  # as the float32 check below: full float32 matmuls (not TF32)
        jax.config.update("jax_default_matmul_precision", "highest")
    mesh = jax.make_mesh((n,), ("tensor",), devices=devices)

    def build(dtype):
        config = LlamaConfig(**SHAPES[size], rms_norm_eps=1e-5, rope_theta=500000.0, dtype=dtype)
        # Built on the default device, devices[0]; the weights of every dtype are the same
        # float32 draws, rounded.
        model = LlamaForCausalLM.random(config, seed=0)
        return config, model, shard_model(model, mesh)

    print(
        f"devices: {n} x {devices[0].device_kind} ({devices[0].platform}); jax {jax.__version__}",
        flush=True,
    )
    t0 = time.perf_counter()
    config, model, sharded = build(dtype)
    n_params = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    print(
        f"model: {size}, {n_params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, "
        f"hidden {config.hidden_size}, heads {config.num_attention_heads}/"
        f"{config.num_key_value_heads}x{config.head_dim}, MLP {config.intermediate_size}, "
        f"vocab {config.vocab_size}, {dtype}; built and sharded over {n} devices in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    rng = np.random.default_rng(0)
    lens = rng.integers(max(prompt_len // 2, 1), prompt_len + 1, args.batch)
    prompts = [rng.integers(0, config.vocab_size, int(m)).tolist() for m in lens]
    print(
        f"{args.batch} prompts of {int(lens.min())}-{int(lens.max())} tokens, {new_tokens} new "
        f"tokens each (greedy), page size {args.page_size}\n",
        flush=True,
    )

    def run(m):
        return generate(m, prompts, new_tokens, page_size=args.page_size)

    def timed(label, m, devices):
        def once():
            out = run(m)
            return out, out.prefill_s, out.decode_s

        print(f"  {label}: compiling and timing {args.repeats} runs ...", flush=True)
        t = time.perf_counter()
        out, prefill_s, decode_s = bench.median_of_runs(once, args.repeats)
        print(f"  {label}: done in {time.perf_counter() - t:.1f} s", flush=True)
        return out, dict(
            devices=devices,
            dtype=dtype,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prefill_tokens_per_s=out.num_prompt_tokens / prefill_s,
            decode_tokens_per_s=out.num_decode_tokens / decode_s,
            # The prefill gives the first token, the decode loop the other new_tokens - 1.
            decode_ms_per_step=decode_s / max(new_tokens - 1, 1) * 1e3,
        )

    ref, one = timed(f"1 device, {dtype}", model, 1)
    out, tp = timed(f"{n} devices, {dtype}", sharded, n)
    agreement = {f"{dtype}: {n} devices vs 1": agree(out.tokens, ref.tokens)}

    # The exact check runs in float32 (matmuls in full float32, not TF32): the row-parallel
    # projections sum per-device partial products, another order than one device's matmul,
    # and in bfloat16 a last-bit difference grows through the layers until a close greedy
    # choice flips (as it does between bfloat16 and float32 on one device).
    with jax.default_matmul_precision("highest"):
        if dtype == "float32":
            ref32, out32 = ref, out
        else:
            print("  float32 check: 1 device and sharded ...", flush=True)
            _, model32, sharded32 = build("float32")
            ref32, out32 = run(model32), run(sharded32)
            agreement[f"1 device: {dtype} vs float32"] = agree(ref.tokens, ref32.tokens)
    same = out32.tokens == ref32.tokens
    agreement[f"float32: {n} devices vs 1"] = agree(out32.tokens, ref32.tokens)

    print(f"\n{'devices':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/step':>10}{'speedup':>9}")
    for row in (one, tp):
        print(
            f"{row['devices']:>8}{row['prefill_tokens_per_s']:>15.1f}"
            f"{row['decode_tokens_per_s']:>14.1f}{row['decode_ms_per_step']:>10.2f}"
            f"{row['decode_tokens_per_s'] / one['decode_tokens_per_s']:>8.2f}x"
        )
    print(f"\nleading tokens that agree (mean of {args.batch} prompts, of {new_tokens}):")
    for name, value in agreement.items():
        print(f"  {name}: {value:.1f}")
    print(
        f"float32 tokens {'equal' if same else 'DIFFER'}: {n} devices vs 1 device "
        f"{'(OK)' if same else '(MISMATCH)'}"
    )
    if args.out:
        record = dict(
            example="generate_sharded",
            info=info(devices[0]),
            num_devices=n,
            size=size,
            config={k: v for k, v in vars(config).items()},
            parameters=n_params,
            batch=args.batch,
            prompt_lens=[int(m) for m in lens],
            new_tokens=new_tokens,
            page_size=args.page_size,
            repeats=args.repeats,
            float32_tokens_equal=same,
            leading_tokens_agree=agreement,
            rows=[one, tp],
        )
        folder = os.path.dirname(args.out)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"wrote {args.out}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
