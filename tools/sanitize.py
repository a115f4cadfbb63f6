"""Every CUDA op of jax_flash under compute-sanitizer: memcheck, racecheck, synccheck, initcheck.

    python tools/sanitize.py                      # all four tools, every case
    python tools/sanitize.py --quick              # one case per kernel, default paged dispatch
    python tools/sanitize.py --tools memcheck,racecheck --timeout 900 --log-dir san-logs
    python tools/sanitize.py --tools initcheck --ops paged_attention --paged-kernels tensor_core

Needs a GPU, jax_flash built with its CUDA kernels, and `compute-sanitizer` (on PATH, or in
`$CUDA_HOME/bin`, or next to `nvcc`; `--sanitizer PATH` to name it). For each tool it runs this
file's driver (`--driver`: small calls of every op with implementation="cuda") in a child process
under the tool, and prints one line per tool:

    memcheck    0 errors   (41 s)  log: san-logs/memcheck.log

then exits non-zero if any tool reported an error, timed out, or the driver failed.

What the driver runs: flash_attention on its tensor-core (f16/bf16, D 64/128/256) and CUDA-core
(float32, other head dims, Dv != D) kernels with causal masks, windows, soft cap, padding lengths
and lse, and its gradients (both backward modes); flash_attention_varlen with offsets past the
rows (clamped), and its deterministic gradient; paged_attention on both
decode kernels (f16/bf16 caches and int8/e4m3 with per-head or per-token scales; one and several
query tokens; bad lengths and page ids, which give NaN) -- unless --quick, the driver runs twice per
tool, with JAX_FLASH_PAGED_MMA=0 and =1, so that every paged case meets both kernels
(`--paged-kernels` picks them); append_kv (plain, quantized, bad slots, fused RoPE with q),
append_qkv (the same cases), copy_pages and reorder_beams; apply_rope; sample and top_k_top_p_filter
(NaN / -inf rows, ties, per-row parameters). `--ops` selects some of these ops, so that a slow tool
(initcheck watches every kernel, XLA's too, and takes minutes per driver run) can be run in parts.

How it is made to see real bugs:
- XLA_PYTHON_CLIENT_ALLOCATOR=platform: each buffer is its own device allocation, so memcheck
  catches an access past a buffer (XLA's pooled allocator would hide it inside the pool).
- XLA command buffers (CUDA graphs) off: every kernel is a plain launch. XLA's autotuning off:
  its candidate kernels would run, instrumented, inside every compilation.
- racecheck and synccheck instrument only jax_flash's kernels (`--kernel-name kns=jax_flash`,
  all kernels live in namespace jax_flash): over the whole process they take too long.
  memcheck and initcheck see every kernel (initcheck must see every write, or an input
  computed by an XLA kernel would look uninitialised). `--filter-all` filters those too.
- The summary line splits errors into those in jax_flash kernels and elsewhere (XLA's own);
  `--fail-on jax_flash` fails the run on the former only.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FILTERED_BY_DEFAULT = ("racecheck", "synccheck")
KERNEL_FILTER = "kns=jax_flash"
PAGED_KERNELS = {"cuda_core": "0", "tensor_core": "1"}  # their JAX_FLASH_PAGED_MMA values
ERROR_EXIT = 86  # compute-sanitizer's exit status when it found errors (--error-exitcode)


# ---------------------------------------------------------------------------------------------
# The driver: every op on the GPU (run in the child process under the sanitizer)


OPS = ("flash_attention", "flash_attention_varlen", "paged_attention", "append_kv", "apply_rope",
       "sampling")  # fmt: skip


def _driver(quick: bool, platform: str, ops: tuple[str, ...] = OPS) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash
    from jax_flash import reference

    if platform == "gpu" and not jax_flash.has_cuda_kernels():
        print("driver: jax_flash was built without its CUDA kernels", file=sys.stderr)
        return 2
    try:
        gpu = jax.devices(platform)[0]
    except RuntimeError:
        print(f"driver: no {platform} device visible to JAX", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    calls = 0

    def put(x):
        # Inputs come from the host (copies the sanitizer tracks), not from XLA kernels.
        return jax.device_put(np.asarray(x), gpu)

    def normal(shape, dtype, scale=1.0):
        return put(np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, dtype)))

    def run(name, fn, *args, **kw):
        nonlocal calls
        out = jax.block_until_ready(jax.jit(fn, static_argnames=tuple(kw))(*args, **kw))
        calls += 1
        print(f"driver: {name}", flush=True)
        return out

    def cases(op, items, quick_count):
        """The cases of one op's section: none unless --ops selects it, the first few if quick."""
        return [] if op not in ops else items[:quick_count] if quick else items

    cuda = dict(implementation="cuda" if platform == "gpu" else "cpu")
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32

    # flash_attention: (dtype, B, Sq, Skv, Hq, Hkv, D, Dv, options)
    dense = [
        (bf16, 2, 97, 97, 6, 2, 128, 128, dict(causal=True)),  # tensor cores
        (f32, 1, 33, 50, 4, 4, 64, 64, dict(sliding_window=(7, 3))),  # CUDA cores
        # Hopper: 192-row tiles (3 consumers); 288 work items (more than SMs) from a counter
        (bf16, 2, 401, 350, 48, 8, 64, 64, dict()),
        # Hopper: 192 x 96 tiles (3 consumers) of the 64 tile (causal, max_seqlen_q >= 1536) and
        # of the 96 tile (max_seqlen_q >= 2048)
        (bf16, 1, 1536, 1500, 12, 4, 64, 64, dict(causal=True)),
        (f16, 1, 2048, 2001, 4, 1, 96, 96, dict(causal=True)),
        (f16, 2, 45, 130, 4, 1, 64, 64, dict(logits_soft_cap=20.0, causal=True)),
        (bf16, 1, 17, 17, 2, 2, 256, 256, dict(sliding_window=(4, 0))),
        (bf16, 1, 70, 90, 4, 2, 192, 128, dict(causal=True)),  # 256 tile, padded columns
        (f16, 2, 29, 61, 3, 1, 96, 96, dict()),  # a head dim without tensor-core tiles
        (bf16, 1, 40, 40, 2, 1, 64, 128, dict(causal=True)),  # Dv != D
        (f32, 3, 1, 300, 8, 2, 128, 128, dict()),
    ]
    for dtype, B, Sq, Skv, Hq, Hkv, D, Dv, opts in cases("flash_attention", dense, 5):
        q, k = normal((B, Sq, Hq, D), dtype), normal((B, Skv, Hkv, D), dtype)
        v = normal((B, Skv, Hkv, Dv), dtype)
        lens = dict(
            q_seqlens=put(rng.integers(0, Sq + 2, B).astype(np.int32)),
            kv_seqlens=put(rng.integers(0, Skv + 2, B).astype(np.int32)),
        )
        run(f"flash_attention {jnp.dtype(dtype).name} D={D}/{Dv} {opts}",
            lambda q, k, v, **kw: jax_flash.flash_attention(q, k, v, return_lse=True, **kw),
            q, k, v, **opts, **cuda)  # fmt: skip
        run(f"flash_attention padded {jnp.dtype(dtype).name} D={D}",
            lambda q, k, v, ql, kl: jax_flash.flash_attention(
                q, k, v, q_seqlens=ql, kv_seqlens=kl, return_lse=True, **cuda),
            q, k, v, lens["q_seqlens"], lens["kv_seqlens"])  # fmt: skip
        for det in (False, True):  # the backward kernels, dq with and without atomics
            run(f"flash_attention grad {jnp.dtype(dtype).name} D={D}/{Dv} det={det}",
                lambda q, k, v, ql, kl, det=det, opts=opts: jax.grad(
                    lambda q, k, v: jax_flash.flash_attention(
                        q, k, v, q_seqlens=ql, kv_seqlens=kl, deterministic=det, **opts, **cuda
                    ).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v),
                q, k, v, lens["q_seqlens"], lens["kv_seqlens"])  # fmt: skip

    # flash_attention_varlen: offsets past the packed rows and decreasing ones are clamped.
    for dtype, D in cases("flash_attention_varlen", [(bf16, 128), (f32, 64)], 1):
        q, k, v = (normal((70, 4, D), dtype) for _ in range(3))
        for cu in ([0, 5, 22, 60, 70], [3, 40, 20, 95, 1000]):
            cu = put(np.asarray(cu, np.int32))
            run(f"flash_attention_varlen {jnp.dtype(dtype).name} cu={np.asarray(cu).tolist()}",
                lambda q, k, v, cu: jax_flash.flash_attention_varlen(
                    q, k, v, cu, cu, causal=True, return_lse=True, **cuda),
                q, k, v, cu)  # fmt: skip
            run(f"flash_attention_varlen grad {jnp.dtype(dtype).name} cu={np.asarray(cu).tolist()}",
                lambda q, k, v, cu: jax.grad(
                    lambda q, k, v: jax_flash.flash_attention_varlen(
                        q, k, v, cu, cu, causal=True, deterministic=True, **cuda
                    ).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v),
                q, k, v, cu)  # fmt: skip

    # paged_attention: (q dtype, cache dtype, scales, D, page_size, Sq, options)
    paged = [
        (bf16, bf16, None, 128, 16, None, dict()),
        (f32, f32, None, 64, 16, None, dict(num_splits=4)),  # CUDA cores whatever the dispatch
        (bf16, jnp.int8, "head", 128, 16, None, dict(logits_soft_cap=30.0)),
        (f16, f16, None, 80, 16, 3, dict(causal=True, num_splits=3)),  # padded tile
        (f16, f16, None, 64, 1, 3, dict(causal=True)),
        (bf16, bf16, None, 112, 8, None, dict(sliding_window=(30, 0))),
        (bf16, jnp.float8_e4m3fn, "token", 256, 8, 2, dict(sliding_window=(20, 0))),
        (f16, jnp.int8, "token", 64, 32, 4, dict(num_splits=3)),
        (f32, jnp.float8_e4m3fn, "head", 128, 16, 2, dict()),
        (bf16, bf16, None, 128, 16, None, dict(num_splits=12)),  # splits of 16 keys
    ]
    # The CUDA-core kernel (JAX_FLASH_PAGED_MMA=0) takes D 64 / 128 / 256 only: the other head
    # dims' cases are the tensor-core kernel's.
    cuda_core_only = os.environ.get("JAX_FLASH_PAGED_MMA") == "0"
    for tq, tc, scale, D, page, Sq, opts in cases("paged_attention", paged, 4):
        if cuda_core_only and D not in (64, 128, 256):
            continue
        B, Hkv, group = 5, 2, 4
        max_pages = 12
        num_pages = B * max_pages + 3
        bt = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)
        lens = np.array([1, 37, page * max_pages, 0, 5], np.int32)
        if Sq is not None:
            lens = np.maximum(lens, Sq)
        # Bad device data: NaN for these sequences, and never a read through a bad id.
        bad_lens, bad_ids = lens.copy(), bt.copy()
        bad_lens[0], bad_lens[3] = -3, page * max_pages + 9
        bad_ids[1, 1], bad_ids[4, 0] = num_pages + 5, -7
        kf = rng.standard_normal((num_pages, page, Hkv, D)).astype(np.float32)
        vf = rng.standard_normal((num_pages, page, Hkv, D)).astype(np.float32)
        scales = {}
        if scale is None:
            kp, vp = put(np.asarray(jnp.asarray(kf, tc))), put(np.asarray(jnp.asarray(vf, tc)))
        else:
            qmax = reference.QMAX[jnp.dtype(tc).name]
            shape = (Hkv,) if scale == "head" else (num_pages, page, Hkv)
            ks, vs = (np.full(shape, 4.0 / qmax, np.float32) for _ in "kv")
            axes = (slice(None), None) if scale == "head" else (..., None)  # against [.., D]
            kp, vp = (put(np.asarray(reference.quantize(x, s[axes], tc)))
                      for x, s in ((kf, ks), (vf, vs)))  # fmt: skip
            scales = dict(k_scale=put(ks), v_scale=put(vs))
        q = normal((B, Hkv * group, D) if Sq is None else (B, Sq, Hkv * group, D), tq)
        for label, table, kv_lens in (("", bt, lens), (" bad data", bad_ids, bad_lens)):
            o = run(
                f"paged_attention {jnp.dtype(tq).name}/{jnp.dtype(tc).name} D={D} "
                f"page={page} Sq={Sq}{label} {opts}",
                lambda q, kp, vp, bt, kl, sc, **kw: jax_flash.paged_attention(
                    q, kp, vp, bt, kl, return_lse=True, **sc, **kw
                ),
                q, kp, vp, put(table), put(kv_lens), scales, **opts, **cuda,
            )  # fmt: skip
            if label:
                o = np.asarray(o[0], np.float32)
                bad = np.array([True, True, False, True, True])
                assert np.isnan(o[bad]).all() and np.isfinite(o[~bad]).all(), "bad-data rule"

    # append_kv (plain, quantized, bad slots), with and without the fused RoPE, and append_qkv
    P, page, Hkv, D = 9, 16, 2, 128
    slots = np.array([0, 17, -1, 5, P * page, 2**31 - 1, 100, 143, -50], np.int32)
    T = slots.shape[0]
    caches = [(bf16, None), (jnp.int8, "token"), (jnp.float8_e4m3fn, "head"), (f32, None)]
    for tc, scale in cases("append_kv", caches, 2):
        dtype = f32 if tc == f32 else bf16
        kp, vp = (put(np.zeros((P, page, Hkv, D), tc)) for _ in "kv")
        scales = {}
        if scale == "head":
            scales = dict(k_scale=put(np.full((Hkv,), 0.02, np.float32)),
                          v_scale=put(np.full((Hkv,), 0.03, np.float32)))  # fmt: skip
        elif scale == "token":
            scales = {n: put(np.zeros((P, page, Hkv), np.float32)) for n in ("k_scale", "v_scale")}
        kn, vn = normal((T, Hkv, D), dtype), normal((T, Hkv, D), dtype)
        pos = put(rng.integers(0, 5000, T).astype(np.int32))
        q = normal((T, 3 * Hkv, D), dtype)
        name = jnp.dtype(tc).name
        run(f"append_kv {name}",
            lambda kp, vp, kn, vn, s, sc: jax_flash.append_kv(kp, vp, kn, vn, s, **sc, **cuda),
            kp, vp, kn, vn, put(slots), scales)  # fmt: skip
        run(f"append_kv rope {name}",
            lambda kp, vp, kn, vn, s, pos, q, sc: jax_flash.append_kv(
                kp, vp, kn, vn, s, positions=pos, rope={"rotary_dim": 64, "style": "gptj"},
                q=q, **sc, **cuda),
            kp, vp, kn, vn, put(slots), pos, q, scales)  # fmt: skip
        qkv = normal((T, Hkv, 3 + 2, D), dtype)  # packed rows: 3 queries per kv head
        run(f"append_qkv {name}",
            lambda kp, vp, qkv, s, pos, sc: jax_flash.append_qkv(
                kp, vp, qkv, s, pos, rope={"rotary_dim": 64}, **sc, **cuda),
            kp, vp, qkv, put(slots), pos, scales)  # fmt: skip
        run(f"copy_pages {name}",
            lambda kp, vp, src, dst, sc: jax_flash.copy_pages(kp, vp, src, dst, **sc, **cuda),
            kp, vp, put(np.array([0, 3, -1, 2, 40], np.int32)),
            put(np.array([5, 6, 7, P, 8], np.int32)), scales)  # fmt: skip
        bt = put(np.array([[0, 1], [2, 3], [4, 5]], np.int32))
        run(f"reorder_beams {name}",
            lambda bt, kl, ids, sp, kp, vp, sc: jax_flash.reorder_beams(
                bt, kl, ids, sp, kp, vp, **sc, **cuda),
            bt, put(np.array([20, 20, 20], np.int32)), put(np.array([2, 0, 2], np.int32)),
            put(np.array([6, 7, 8], np.int32)), kp, vp, scales)  # fmt: skip

    # apply_rope
    ropes = [(bf16, 128, None, "neox"), (f32, 80, 32, "gptj"), (f16, 10, 6, "neox")]
    for dtype, D, rd, style in cases("apply_rope", ropes, 1):
        x = normal((2, 37, 3, D), dtype)
        pos = put(rng.integers(-10, 70000, (2, 37)).astype(np.int32))
        run(f"apply_rope {jnp.dtype(dtype).name} D={D} rotary_dim={rd} {style}",
            lambda x, pos, **kw: jax_flash.apply_rope(x, pos, theta=500000.0, **kw),
            x, pos, rotary_dim=rd, style=style, **cuda)  # fmt: skip

    # sampling: NaN and -inf rows, ties, per-row parameters
    for dtype, V in cases("sampling", [(bf16, 50001), (f32, 7), (f16, 4096)], 1):
        x = rng.standard_normal((6, V)).astype(np.float32) * 3
        x[1] = np.nan
        x[2] = -np.inf
        x[3] = np.round(x[3])
        logits = put(np.asarray(jnp.asarray(x, dtype)))
        per_row = dict(
            temperature=put(np.array([0.0, 1.0, 0.7, 1.3, 0.5, 2.0], np.float32)),
            top_k=put(np.array([0, 5, 0, 50, 1, 0], np.int32)),
            top_p=put(np.array([1.0, 0.9, 0.5, 0.95, 1.0, 1e-6], np.float32)),
            min_p=put(np.array([0.0, 0.0, 0.1, 0.02, 0.0, 0.0], np.float32)),
        )
        key = jax.random.key(1)
        run(f"sample {jnp.dtype(dtype).name} V={V}",
            lambda logits, key, p: jax_flash.sample(logits, key, **p, **cuda),
            logits, key, per_row)  # fmt: skip
        run(f"top_k_top_p_filter {jnp.dtype(dtype).name} V={V}",
            lambda logits, p: jax_flash.top_k_top_p_filter(logits, **p, **cuda),
            logits, per_row)  # fmt: skip
    print(f"driver: OK, {calls} calls", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The runner: the driver under each tool


def _find_sanitizer(given: str | None) -> str:
    candidates = [given] if given else []
    candidates.append(shutil.which("compute-sanitizer"))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", "compute-sanitizer"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(nvcc), "compute-sanitizer"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("sanitize: compute-sanitizer not found (PATH, $CUDA_HOME/bin, next to nvcc); "
             "pass --sanitizer PATH")  # fmt: skip


def _error_sites(log: str) -> tuple[int, int]:
    """(errors in jax_flash kernels, errors elsewhere) from the sanitizer's reports: each report
    is a '========= <what>' line followed by its '=========     at <function>' lines."""
    ours = other = 0
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"=+ (Invalid|Uninitiali[sz]ed|Race|Error|Barrier|Misaligned|Out-of-"
                        r"range|Malformed|Warp|Illegal|Unused|Program hit|Memory access)",
                        line):  # fmt: skip
            continue
        where = next((ln for ln in lines[i + 1 : i + 8] if re.search(r"\bat\b", ln)), "")
        if "jax_flash" in where:
            ours += 1
        else:
            other += 1
    return ours, other


def _summary(log: str, tool: str) -> tuple[int | None, str]:
    """(error count or None when the tool printed no summary, extra words)."""
    counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?", log)]
    extra = ""
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) "
                      r"warnings?\)", log)  # fmt: skip
    if race:
        counts += [int(e) for _, e, _ in race]
        extra = f", {sum(int(w) for *_, w in race)} race warnings"
    if not counts:
        return None, extra
    return max(counts), extra


def _run_tool(args, sanitizer: str, tool: str, log_path: pathlib.Path) -> bool:
    """Runs the driver under one tool (twice without --quick: both paged kernels); prints the
    summary line; returns whether the tool found nothing and the driver finished."""
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXIT)]
    if tool in FILTERED_BY_DEFAULT or args.filter_all:
        cmd += ["--kernel-name", args.kernel_filter]
    cmd += [sys.executable, os.path.abspath(__file__), "--driver", "--ops", ",".join(args.ops)]
    cmd += ["--quick"] * args.quick
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # No command buffers (plain launches), and no autotuning: XLA would time candidate kernels
    # during compilation, each of them instrumented too (initcheck spent minutes there).
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
    ).strip()
    modes = [None] if args.quick else [PAGED_KERNELS[k] for k in args.paged_kernels]
    t0 = time.monotonic()
    ok, errors, extras, logs = True, 0, "", []
    for mode in modes:
        if mode is not None:
            env["JAX_FLASH_PAGED_MMA"] = mode
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            logs.append(f"# JAX_FLASH_PAGED_MMA={mode}\n{out}")
            log_path.write_text("\n".join(logs))
            print(f"{tool:10s} TIMEOUT after {args.timeout:.0f} s  log: {log_path}", flush=True)
            return False
        logs.append(f"# JAX_FLASH_PAGED_MMA={mode}: {' '.join(cmd)}\n{out}")
        count, extra = _summary(out, tool)
        extras = extra or extras
        finished = "driver: OK" in out
        if count is None or not finished:
            ok = False
            why = "no sanitizer summary" if count is None else "the driver failed"
            log_path.write_text("\n".join(logs))
            print(f"{tool:10s} FAILED ({why}, exit {proc.returncode})  log: {log_path}",
                  flush=True)  # fmt: skip
            return False
        errors += count
    log_path.write_text("\n".join(logs))
    ours, other = _error_sites("\n".join(logs))
    where = f" (jax_flash kernels {ours}, elsewhere {other})" if errors else ""
    print(f"{tool:10s} {errors} errors{where}{extras}  ({time.monotonic() - t0:.0f} s)  "
          f"log: {log_path}", flush=True)  # fmt: skip
    return ok and (ours if args.fail_on == "jax_flash" else errors) == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help=f"comma-separated subset of {','.join(TOOLS)} (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer cases, one driver run per tool (default paged dispatch)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        help="seconds per tool (both driver runs together); default 1200",
    )
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma-separated subset of the ops the driver calls: {','.join(OPS)} (default: all)",
    )
    parser.add_argument(
        "--paged-kernels",
        default="cuda_core,tensor_core",
        help="without --quick, the paged decode kernels the driver runs once each (default both)",
    )
    parser.add_argument("--log-dir", help="where the full logs go (default: a new temp dir)")
    parser.add_argument("--sanitizer", help="path of compute-sanitizer")
    parser.add_argument(
        "--kernel-filter",
        default=KERNEL_FILTER,
        help=f"compute-sanitizer --kernel-name value (default {KERNEL_FILTER})",
    )
    parser.add_argument(
        "--filter-all",
        action="store_true",
        help="apply the kernel filter to memcheck and initcheck too",
    )
    parser.add_argument(
        "--driver",
        action="store_true",
        help="run the ops once, without a sanitizer (what each tool runs)",
    )
    choices = [  # (flag, its values with the default first, help)
        ("--fail-on", ("any", "jax_flash"), "which errors fail the run: any, or only those "
         "reported in jax_flash's kernels (the summary line always shows both)"),
        ("--driver-platform", ("gpu", "cpu"), "where --driver runs the ops (cpu: to check the "
         "driver itself)"),
    ]  # fmt: skip
    for flag, values, text in choices:
        parser.add_argument(flag, choices=values, default=values[0], help=text)
    args = parser.parse_args(argv)  # fmt: skip
    args.ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    if set(args.ops) - set(OPS) or not args.ops:
        parser.error(
            f"--ops: unknown {sorted(set(args.ops) - set(OPS))}; choose from {','.join(OPS)}"
        )
    args.paged_kernels = [k.strip() for k in args.paged_kernels.split(",") if k.strip()]
    if set(args.paged_kernels) - set(PAGED_KERNELS) or not args.paged_kernels:
        parser.error(f"--paged-kernels: choose from {','.join(PAGED_KERNELS)}")
    if args.driver:
        return _driver(args.quick, args.driver_platform, args.ops)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown or not tools:
        parser.error(f"--tools: unknown {unknown}; choose from {','.join(TOOLS)}")
    sanitizer = _find_sanitizer(args.sanitizer)
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="jax_flash-sanitize-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = [_run_tool(args, sanitizer, t, log_dir / f"{t}.log") for t in tools]
    print("sanitize: " + ("OK, no errors" if all(results) else "ERRORS (see the logs)"))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
