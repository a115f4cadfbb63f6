"""Train a small Llama-style model with optax, attention forward and backward on jax_flash.

    python examples/train.py                          # about 30 s on 2 CPU cores
    python examples/train.py --size small --steps 1000   # a larger model, e.g. on a GPU

The text is the project's own: its README, docs and Python sources, read as bytes (a vocabulary
of 256, nothing to download); ``--text FILE`` trains on any local file instead. The text is cut
into paragraphs, a few of them held out. Each step packs paragraphs into ``--batch-tokens`` rows
(``cu_seqlens``, each paragraph from position 0) and runs the model's cache-free forward, the
next-token loss and its gradient through ``flash_attention_varlen`` (``--layout padded``: one
paragraph per ``[B, S]`` row through ``flash_attention``), then an AdamW step. It prints the
loss and tokens/s (real tokens, padding not counted) on a progress bar, the held-out loss
before and after, and a few greedy bytes from the trained model.
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash
from jax_flash.models import (
    LlamaConfig,
    LlamaForCausalLM,
    generate,
    next_token_loss,
    pack_sequences,
)

ROOT = Path(__file__).resolve().parents[1]

# Byte-level models (vocabulary 256) with GQA; "tiny" trains in about 30 s on 2 CPU cores.
SIZES = {
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    ),
    "small": LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    ),
}


def project_text() -> str:
    """The README, docs and Python sources of the project, one file after another."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "jax_flash").rglob("*.py"))
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.exists())


def paragraphs(text: str, max_len: int) -> list[list[int]]:
    """The text's paragraphs (split at blank lines) as byte sequences, cut to ``max_len``."""
    out = []
    for part in text.split("\n\n"):
        data = list(part.strip("\n").encode("utf-8"))
        out.extend(data[i : i + max_len] for i in range(0, len(data), max_len) if len(data) > 1)
    return out


def padded_batches(sequences, rows: int, seq_len: int):
    """``(tokens [rows, seq_len], lengths [rows])`` batches, one sequence per row."""
    for i in range(0, len(sequences) - rows + 1, rows):
        tokens = np.zeros((rows, seq_len), np.int32)
        lengths = np.zeros(rows, np.int32)
        for r, seq in enumerate(sequences[i : i + rows]):
            tokens[r, : len(seq)] = seq
            lengths[r] = len(seq)
        yield tokens, lengths


def batches(sequences, args, rng):
    """Endless training batches, ``(tokens, cu_seqlens or lengths)``, reshuffled every epoch."""
    while True:
        order = [sequences[i] for i in rng.permutation(len(sequences))]
        if args.layout == "packed":
            yield from pack_sequences(order, args.batch_tokens, args.batch_tokens // 16)
        else:
            yield from padded_batches(order, args.batch_tokens // args.seq_len, args.seq_len)


def loss_fn(model, tokens, lengths_or_cu, layout):
    if layout == "packed":
        logits = model(tokens, cu_seqlens=lengths_or_cu)
        return next_token_loss(logits, tokens, cu_seqlens=lengths_or_cu)
    logits = model(tokens, lengths=lengths_or_cu)
    return next_token_loss(logits, tokens, lengths=lengths_or_cu)


class ProgressBar:
    """A training progress bar with the latest loss and tokens/s: redrawn in place on a
    terminal, one line per update elsewhere."""

    def __init__(self, total, stream=None):
        self.total = total
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()

    def __call__(self, step, loss, tokens_per_s):
        done = int(30 * step / self.total)
        line = (
            f"  step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}]"
            f" loss {loss:.3f} | {tokens_per_s:,.0f} tokens/s"
        )
        if self.tty:
            end = "\n" if step == self.total else ""
            print("\r" + line, end=end, file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    parser.add_argument(
        "--batch-tokens", type=int, default=1024, help="token rows per step (packed or padded)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=256, help="longest sequence; longer paragraphs are cut"
    )
    parser.add_argument(
        "--layout",
        choices=["packed", "padded"],
        default="packed",
        help="packed sequences (flash_attention_varlen) or padded [B, S] rows (flash_attention)",
    )
    parser.add_argument(
        "--attention",
        choices=["jax_flash", "xla"],
        default="jax_flash",
        help="jax_flash's kernels, or the pure-XLA reference path of the same ops",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype (parameters and optimizer state stay float32)",
    )
    parser.add_argument("--log-every", type=int, default=10, help="steps between bar updates")
    parser.add_argument("--sample", type=int, default=64, help="greedy bytes generated at the end")
    parser.add_argument("--text", type=Path, help="train on this text file instead")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling seed")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_tokens", "seq_len", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len > args.batch_tokens:
        parser.error("--seq-len must not exceed --batch-tokens")
    return args


def main(argv=None):
    """Train; returns the held-out losses before and after and the bar's training losses."""
    args = parse_args(argv)
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
        f"jax_flash {jax_flash.__version__}; attention: {args.attention}, {args.layout}"
    )
    text = args.text.read_text(encoding="utf-8") if args.text else project_text()
    sequences = paragraphs(text, args.seq_len)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(sequences))
    held = max(1, len(sequences) // 20)
    held_out = [sequences[i] for i in order[:held]]
    train = [sequences[i] for i in order[held:]]
    print(
        f"text: {len(text.encode('utf-8')):,} bytes, {len(train):,} training paragraphs, "
        f"{len(held_out):,} held out"
    )

    config = dataclasses.replace(
        SIZES[args.size], max_position_embeddings=args.seq_len, dtype=args.dtype
    )
    impl = "xla" if args.attention == "xla" else None
    model = LlamaForCausalLM.random(
        config, seed=args.seed, attention_impl=impl, param_dtype=jnp.float32
    )
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, heads "
        f"{config.num_attention_heads}/{config.num_key_value_heads} (q/kv), "
        f"{n_params / 1e6:.2f}M parameters, {args.dtype}"
    )

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10 + 1), args.steps, args.lr / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1)
    )
    opt_state = optimizer.init(params)

    def loss_of(params, tokens, extra):
        return loss_fn(nnx.merge(graphdef, params), tokens, extra, args.layout)

    @jax.jit
    def evaluate(params, tokens, extra):
        return loss_of(params, tokens, extra)

    @jax.jit
    def train_step(params, opt_state, tokens, extra):
        loss, grads = jax.value_and_grad(loss_of)(params, tokens, extra)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_batches = list(
        pack_sequences(held_out, args.batch_tokens, args.batch_tokens // 16)
        if args.layout == "packed"
        else padded_batches(held_out, args.batch_tokens // args.seq_len, args.seq_len)
    )[:4]

    def held_out_loss(params):
        return float(np.mean([evaluate(params, *b) for b in eval_batches]))

    before = held_out_loss(params)
    print(f"held-out loss before training: {before:.3f} (uniform over bytes: {np.log(256):.3f})")

    bar = ProgressBar(args.steps)
    losses = []
    stream = batches(train, args, rng)
    t0, tokens_seen, timed_tokens, timed_from = time.perf_counter(), 0, 0, None
    for step in range(1, args.steps + 1):
        tokens, extra = next(stream)
        real = int(extra[-1]) if args.layout == "packed" else int(extra.sum())
        params, opt_state, loss = train_step(params, opt_state, tokens, extra)
        if step == 1:  # the first step compiles: time the steps after it
            loss.block_until_ready()
            print(f"  compiled the training step in {time.perf_counter() - t0:.1f} s")
            timed_from = time.perf_counter()
        else:
            timed_tokens += real
        tokens_seen += real
        if step % args.log_every == 0 or step == args.steps:
            losses.append(float(loss))
            elapsed = time.perf_counter() - timed_from
            bar(step, losses[-1], timed_tokens / elapsed if elapsed > 0 else 0.0)
    after = held_out_loss(params)
    print(
        f"trained on {tokens_seen:,} tokens; held-out loss {before:.3f} -> {after:.3f}"
        f"{'' if after < before else ' (not lower!)'}"
    )

    if args.sample:
        model = nnx.merge(graphdef, params)
        prompt = list(b"def ")
        out = generate(model, [prompt], args.sample, page_size=16)
        shown = bytes(prompt + out.tokens[0]).decode("utf-8", "replace")
        print(f"greedy sample: {shown!r}")
    return before, after, losses


if __name__ == "__main__":
    main()
