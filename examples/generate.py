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
    head_dim=64,  # the CUDA kernels of prefill and paged decode take it in every dtype
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


class ProgressBar:
    """A decode progress bar: redrawn in place on a terminal, one line per update elsewhere.
    `close()` ends its line, also when generation stops early (every sequence hit EOS)."""

    def __init__(self, label, stream=None):
        self.label = label
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.open = False  # a drawn line waits for its newline

    def __call__(self, step, total):
        done = int(30 * step / total)
        line = f"  {self.label} decode [{'#' * done}{'.' * (30 - done)}] {step}/{total} steps"
        if self.tty:
            print("\r" + line, end="", file=self.stream, flush=True)
            self.open = True
        else:
            print(line, file=self.stream, flush=True)

    def close(self):
        if self.open:
            print(file=self.stream, flush=True)
            self.open = False


def run(model, prompts, args, label, **kw):
    """Generate twice: the first call compiles (and runs once), the second is timed."""
    kw.update(num_beams=args.num_beams, page_size=args.page_size)
    first = generate(model, prompts, args.max_new_tokens, **kw)
    print(f"  {label}: compiled in {first.compile_s:.2f} s")
    bar = ProgressBar(label)
    try:
        out = generate(
            model,
            prompts,
            args.max_new_tokens,
            steps_per_call=args.steps_per_call,
            progress=bar,
            **kw,
        )
    finally:
        bar.close()
    assert out.tokens == first.tokens
    print(
        f"  {label}: prefill {out.num_prompt_tokens} tokens in {out.prefill_s * 1e3:.1f} ms = "
        f"{out.prefill_tokens_per_s:.1f} tokens/s | decode {out.num_decode_tokens} tokens in "
        f"{out.decode_s * 1e3:.1f} ms = {out.decode_tokens_per_s:.1f} tokens/s"
    )
    return out


DTYPES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16",
}  # fmt: skip


def dtype_arg(value):
    try:
        return DTYPES[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {value!r}; choose from {', '.join(DTYPES)}"
        ) from None


def positive_int(value):
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json); "
        "default: a small random-weight model",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        help="prompt text, repeatable (needs --checkpoint: the random model has no tokenizer)",
    )
    counts = [
        ("--max-new-tokens", 32, "tokens to generate per prompt"),
        ("--num-beams", None, "beam search with this many beams per prompt (default: greedy)"),
        ("--page-size", 16, "tokens per KV-cache page"),
        ("--steps-per-call", 8, "decode steps per jit call (the progress bar moves after each)"),
    ]
    for flag, default, text in counts:
        parser.add_argument(flag, type=positive_int, default=default, help=text)
    parser.add_argument(
        "--dtype",
        type=dtype_arg,
        default=None,
        help="compute and parameter dtype: float32 (fp32), bfloat16 (bf16) or float16 (fp16); "
        "default: float32 for the random model, the checkpoint's own otherwise",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also check a checkpoint's tokens "
        "against the pure-XLA path (always done for the random model)",
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt and not args.checkpoint:
        parser.error("--prompt needs --checkpoint (the random-weight model has no tokenizer)")
    return args


def main():
    args = parse_args()

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

    kernels = model.attention_kernels(args.page_size)
    print(f"attention kernels: prefill {kernels['prefill']}, decode {kernels['decode']}")
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
