"""The test suite split over several pytest processes that share one machine (and its GPU).

    python tools/parallel_tests.py                       # the whole suite, one process per 2 cores
    python tools/parallel_tests.py -n 6 -k cuda          # only the tests whose id names cuda
    python tools/parallel_tests.py --timeout 500 --log-dir test-logs tests/test_grad.py

A GPU test spends most of its time compiling on the host, so on a lent GPU machine (16 cores)
six processes finish the GPU suite several times faster than one. Each process gets the
`XLA_PYTHON_CLIENT_PREALLOCATE=false` environment, so that they share the GPU's memory instead of
each reserving most of it (tests/conftest.py turns XLA's GEMM autotuning off in every
process). The collected test ids are dealt out round-robin (neighbouring ids of
a file go to different processes, so slow parametrisations spread out). Each process writes its
log to --log-dir; the summary prints each one's last line and the failures, and the exit status
is non-zero if any process failed or ran past --timeout (all those still running are interrupted
with SIGINT together, so pytest still prints what ran, and killed 30 s later). A SIGTERM (an
outer `timeout`) kills every process before exiting.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time


def collect(paths: list[str], keyword: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cmd += (["-k", keyword] if keyword else []) + paths
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and " " not in line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests"])
    ap.add_argument("-n", "--processes", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per process")
    ap.add_argument("--log-dir", default="test-logs")
    args = ap.parse_args(argv)

    ids = collect(args.paths, args.keyword)
    if not ids:
        print("parallel_tests: no tests collected")
        return 1
    n = max(1, min(args.processes, len(ids)))
    shards = [ids[i::n] for i in range(n)]
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    print(f"parallel_tests: {len(ids)} tests in {n} processes, logs in {log_dir}/", flush=True)

    start = time.monotonic()
    procs = []
    for i, shard in enumerate(shards):
        log = open(log_dir / f"shard{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *shard]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))

    # Terminated from outside (an outer `timeout`): the shards go too, so that none is left
    # running on the machine (on a GPU, a shard left behind slows whatever runs next).
    def terminate(signum, frame):
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    timed_out = set()
    for p, _ in procs:
        left = args.timeout - (time.monotonic() - start)
        try:
            p.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            break
    # Past --timeout: every shard still running is interrupted at once (pytest then prints what
    # ran), given one shared grace period (a shard inside an XLA compile reacts only when the
    # compile returns), then killed.
    running = [i for i, (p, _) in enumerate(procs) if p.poll() is None]
    for i in running:
        timed_out.add(i)
        procs[i][0].send_signal(signal.SIGINT)
    grace_end = time.monotonic() + 30
    for i in running:
        p = procs[i][0]
        try:
            p.wait(timeout=max(grace_end - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for _, log in procs:
        log.close()

    failed = False
    for i, (p, _) in enumerate(procs):
        lines = (log_dir / f"shard{i}.log").read_text(errors="replace").splitlines()
        last = next((ln for ln in reversed(lines) if ln.strip()), "(no output)")
        status = "timed out" if i in timed_out else f"exit {p.returncode}"
        print(f"shard {i}: {status}: {last}")
        for ln in lines:
            if ln.startswith(("FAILED ", "ERROR ")):
                print(f"    {ln}")
        # pytest exits 5 when a shard's tests were all deselected; 0 otherwise on success.
        failed |= i in timed_out or p.returncode not in (0, 5)
    print(f"parallel_tests: {'FAILED' if failed else 'passed'} in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
