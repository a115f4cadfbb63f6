"""Generate with a Llama-style decoder whose attention runs on jax_flash's kernels.

    python examples/generate.py                      # small random-weight model, checked
    python examples/generate.py --checkpoint DIR --prompt "The capital of France is"

With no checkpoint it builds a small random-weight Llama-style model (GQA, Llama 3 RoPE
scaling), generates greedily for a batch of prompts of different lengths on the default device
(packed prefill through `flash_attention_varlen`, then a `lax.while_loop` of decode steps
through `paged_attention` with the paged cache donated), prints tokens/s for prefill and decode,
and checks that the tokens equal those of the same model run with the pure-XLA reference path
of the same ops (`attention_impl="xla"`). With `--checkpoint DIR` (a Hugging Face Llama,
Mistral or Qwen2 directory: config.json, *.safetensors, tokenizer.json) it loads the model and
prints the decoded text.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_flash
from jax_flash.models import (
    LlamaConfig,
    LlamaForCausalLM,
    generate,
    load_hf_checkpoint,
    load_tokenizer,
)

DEMO_CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def progress_bar(label):
    tty = sys.stdout.isatty()

    def show(step, total):
        done = int(30 * step / total)
        line = f"  {label} decode [{'#' * done}{'.' * (30 - done)}] {step}/{total} steps"
        print(
            "\r" + line if tty else line, end="\n" if step >= total or not tty else "", flush=True
        )

    return show


def run(model, prompts, args, label, **kw):
    """Generate twice: the first call compiles (and runs once), the second is timed."""
    kw.update(num_beams=args.num_beams, page_size=args.page_size)
    first = generate(model, prompts, args.max_new_tokens, **kw)
    print(f"  {label}: compiled in {first.compile_s:.2f} s")
    out = generate(
        model,
        prompts,
        args.max_new_tokens,
        steps_per_call=args.steps_per_call,
        progress=progress_bar(label),
        **kw,
    )
    assert out.tokens == first.tokens
    print(
        f"  {label}: prefill {out.num_prompt_tokens} tokens in {out.prefill_s * 1e3:.1f} ms = "
        f"{out.prefill_tokens_per_s:.1f} tokens/s | decode {out.num_decode_tokens} tokens in "
        f"{out.decode_s * 1e3:.1f} ms = {out.decode_tokens_per_s:.1f} tokens/s"
    )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="Hugging Face checkpoint directory")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps-per-call", type=int, default=8, help="decode steps per jit call")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32/bfloat16 (default: demo float32, checkpoint: its own)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also check a checkpoint's tokens "
        "against the pure-XLA path (always done for the random model)",
    )
    args = parser.parse_args()

    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
        f"jax_flash {jax_flash.__version__} (CUDA kernels built: {jax_flash.has_cuda_kernels()})"
    )
    tokenizer = None
    if args.checkpoint:
        t0 = time.perf_counter()
        model, config = load_hf_checkpoint(args.checkpoint, dtype=args.dtype)
        tokenizer = load_tokenizer(args.checkpoint)
        if tokenizer is None:
            sys.exit(f"{args.checkpoint} has no tokenizer.json")
        texts = args.prompt or ["The capital of France is", "def fibonacci(n):"]
        prompts = [tokenizer.encode(t).ids for t in texts]
        eos = config.eos_token_id
        print(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f} s")
    else:
        config = DEMO_CONFIG
        model = LlamaForCausalLM.random(config, seed=0, dtype=args.dtype or jnp.float32)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (37, 120, 9, 64)]
        eos = None
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, heads "
        f"{config.num_attention_heads}/{config.num_key_value_heads} (q/kv), head dim "
        f"{config.head_dim}, vocab {config.vocab_size}, {n_params / 1e6:.1f}M parameters, "
        f"{jnp.dtype(model.dtype).name}"
    )
    print(
        f"prompts: {len(prompts)} of lengths {[len(p) for p in prompts]}, "
        f"{args.max_new_tokens} new tokens each, page size {args.page_size}"
    )

    out = run(model, prompts, args, "jax_flash", eos_token_id=eos)
    for i, toks in enumerate(out.tokens):
        shown = repr(tokenizer.decode(prompts[i] + toks)) if tokenizer else toks
        print(f"  [{i}] {shown}")
    if args.checkpoint and not args.check:
        return
    ref = run(model.with_attention_impl("xla"), prompts, args, "pure XLA", eos_token_id=eos)
    if ref.tokens != out.tokens:
        bad = [i for i, (a, b) in enumerate(zip(out.tokens, ref.tokens, strict=True)) if a != b]
        sys.exit(f"MISMATCH: prompts {bad} differ from the pure-XLA path")
    print("tokens equal the pure-XLA reference path: OK")


if __name__ == "__main__":
    main()
