"""The Hopper attention backward's CTA schedule modelled on a CPU: how the launch order of its
key-block CTAs over the SMs, and the deterministic mode's dQ turns, stretch a call past its work.

    python tools/bwd_schedule_sim.py
    python tools/bwd_schedule_sim.py --sms 132 --shapes 4x4096 1x16384

Model (no device): a CTA owns one key block of 128 keys of one (sequence, kv head) and visits,
for each of the kv head's query heads (`--group`), every query tile of 64 rows that sees one of
its keys (causal: tiles m >= 2n for key block n), in the kernel's order (query tiles
descending, heads interleaved); a visit takes one time unit. CTAs start in launch order
whenever one of `--sms` SMs is free (one CTA an SM, as the kernel's shared memory allows).
Deterministic mode: key block n adds its dQ share of a (head, query tile) after key block
n - 1 of the same sequence and kv head has, which passes its turn half a visit into its next
visit; a visit reaches its wait half way through (`flash_bwd_kernel.cuh`). With
`--read-latency L` the waiting thread's read of the turn counter (an acquire load, a round trip
to L2) costs L visits at the wait, or, from the pass on, L after the pass; with `--read-ahead`
the counter is read at the visit's start and a turn passed by then costs nothing at the wait.
(L = 0.15 gives 14-17% deterministic costs at B4 S4k against the fast mode, near the measured
16-20% on an H200; without it the chain of turns alone costs a few percent.) The makespan is
compared with the work per SM (the bound of a perfect schedule). A coarse model: every visit
costs the same and nothing of memory is modelled; it put the n-major order's gain at 12% (fast,
B4 S4k causal) where an H200 measured 1.9%, and a gain in deterministic mode where the order
measured 4-9% slower (NOTES-hopper-bwd.md).

Launch orders: `current` is the kernel's grid (x: the key blocks of every sequence in order, y:
kv heads; blocks start in linear order, x fastest); `n-major` starts every sequence's and kv
head's key block 0 first, then all key blocks 1, ... (longest first in causal calls, and every
turn-order predecessor still starts before its successor, so the deterministic mode's waits
cannot deadlock).
"""

from __future__ import annotations

import argparse
import heapq


def schedule(
    batch,
    seqlen,
    kv_heads,
    group,
    causal,
    deterministic,
    order,
    sms,
    read_latency=0.0,
    read_ahead=False,
):
    """(makespan, work per SM, share of SM time spent waiting for dQ turns)."""
    blocks, tiles = seqlen // 128, seqlen // 64
    ctas = [(h, b, n) for h in range(kv_heads) for b in range(batch) for n in range(blocks)]
    if order == "n-major":
        ctas = [(h, b, n) for n in range(blocks) for h in range(kv_heads) for b in range(batch)]
    free = [0.0] * sms
    passed, end, waited, work = {}, 0.0, 0.0, 0
    for h, b, n in ctas:
        t = heapq.heappop(free)
        visits = [
            (q, m) for m in reversed(range(2 * n if causal else 0, tiles)) for q in range(group)
        ]
        ends = []
        for x in visits:
            if deterministic:
                turn = passed.get((h, b, n - 1, x), 0.0)  # when the turn was passed
                at_wait = t + 0.5
                seen = at_wait if read_ahead and turn <= t else max(at_wait, turn) + read_latency
                waited += seen - at_wait
                t = seen + 0.5
            else:
                t += 1.0
            ends.append((x, t))
        for i, (x, e) in enumerate(ends):  # passed half a visit into the next one
            passed[(h, b, n, x)] = e + 0.5 if i + 1 < len(ends) else e
        work += len(visits)
        end = max(end, t)
        heapq.heappush(free, t)
    return end, work / sms, waited / (end * sms)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head")
    parser.add_argument("--shapes", nargs="+", default=["4x4096", "1x16384"], help="BxS")
    parser.add_argument(
        "--read-latency", type=float, default=0.0, help="visits a read of a turn counter takes"
    )
    parser.add_argument(
        "--read-ahead", action="store_true", help="turn counters read at each visit's start"
    )
    args = parser.parse_args(argv)
    print("| shape | mask | mode | work / SM | current | n-major | n-major / current |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        batch, seqlen = (int(v) for v in shape.split("x"))
        for causal in (True, False):
            for det in (False, True):
                runs = {
                    order: schedule(
                        batch,
                        seqlen,
                        args.kv_heads,
                        args.group,
                        causal,
                        det,
                        order,
                        args.sms,
                        args.read_latency,
                        args.read_ahead,
                    )
                    for order in ("current", "n-major")
                }
                (cur, bound, _), (nm, _, _) = runs["current"], runs["n-major"]
                print(
                    f"| {shape} | {'causal' if causal else 'full'} | "
                    f"{'deterministic' if det else 'fast'} | {bound:.0f} | {cur:.0f} "
                    f"({cur / bound:.3f}) | {nm:.0f} ({nm / bound:.3f}) | {nm / cur:.3f} |"
                )


if __name__ == "__main__":
    main()
