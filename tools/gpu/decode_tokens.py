"""`generate`'s decode tokens/s of the random 1.24B Llama-shaped model (benchmarks/e2e_bench.py's
LLAMA_1B, bf16; --tiny: its small test model), for A/B runs of two builds on one card in
alternating processes, with the greedy tokens' checksums to show that both decode the same:

    for i in 1 2; do
      python tools/gpu/use_build.py /tmp/base tools/gpu/decode_tokens.py --tag base
      python tools/gpu/decode_tokens.py --tag new
    done

Each case (--cases, BATCHxPROMPT, default 1x2048,1x512,8x2048) runs one compiling call, then
--runs timed calls of --new-tokens tokens; the line printed per case is the median, the runs,
and the sum of each row's tokens: the measurement of the batch-1 A/B runs in docs/serving.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from e2e_bench import LLAMA_1B, TINY  # noqa: E402

from jax_flash.models import LlamaForCausalLM, generate  # noqa: E402


def parse_cases(text: str) -> list[tuple[int, int]]:
    """ "1x2048,8x512" -> [(1, 2048), (8, 512)]."""
    out = []
    for item in text.split(","):
        b, _, p = item.strip().partition("x")
        if not (b.isdigit() and p.isdigit() and int(b) > 0 and int(p) > 0):
            raise SystemExit(f"--cases: expected BATCHxPROMPT items, got {item!r}")
        out.append((int(b), int(p)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="run", help="the label printed on each line")
    ap.add_argument("--cases", default="1x2048,1x512,8x2048")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()

    config = TINY if args.tiny else LLAMA_1B
    model = LlamaForCausalLM.random(config, seed=0)
    for batch, prompt in parse_cases(args.cases):
        prompts = [
            np.random.default_rng(b).integers(0, config.vocab_size, prompt).tolist()
            for b in range(batch)
        ]
        first = generate(model, prompts, args.new_tokens)
        runs = [
            generate(model, prompts, args.new_tokens).decode_tokens_per_s for _ in range(args.runs)
        ]
        print(
            f"{args.tag} B{batch} prompt {prompt}: {np.median(runs):.0f} tokens/s "
            f"{[round(r) for r in runs]} token sums {[sum(t) for t in first.tokens]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
