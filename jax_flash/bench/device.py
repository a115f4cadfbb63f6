"""What the device is: versions and host, the memory this process may allocate, and the measured
rooflines (matmul rate, copy and read bandwidth) that rows are compared with."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import timing


def info(device) -> dict:
    """Device, versions, host and date of a run (the `info` of its JSON)."""
    out = {
        "device": str(device.device_kind),
        "platform": device.platform,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "jax_flash": jax_flash.__version__,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "timing": timing.METHOD,
    }
    if device.platform == "gpu":
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            out["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def mem_limit(device) -> float:
    """Bytes this process may allocate on the device (16 GiB where the device does not say)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = {}
    return float(stats.get("bytes_limit", 16 << 30))


def rooflines(device_kind: str) -> dict:
    """Measured bf16 matmul rate, device-memory copy and read bandwidth of this device (each
    timed inside a loop like the rows); {} on CPU."""
    if device_kind != "gpu":
        return {}
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    t, _ = timing.loop_time(jnp.matmul, (a, b), n=20, chain=(0,))
    del a, b
    x = jax.random.normal(jax.random.key(3), (1 << 30,), jnp.bfloat16)  # 2 GiB
    tc = timing.scaled_loop_time(lambda x, c: x * c.astype(x.dtype), x, 20)
    del x
    x = jax.random.normal(jax.random.key(5), (1 << 31,), jnp.bfloat16)  # 4 GiB
    tr = timing.scaled_loop_time(
        lambda x, c: jnp.sum(x * c.astype(x.dtype), dtype=jnp.float32), x, 20
    )
    del x
    return {
        "bf16_matmul_tflops": 2 * n**3 / t / 1e12,
        "hbm_copy_read_plus_write_gbps": 2 * (1 << 30) * 2 / tc / 1e9,
        "hbm_read_gbps": (1 << 31) * 2 / tr / 1e9,
    }


def start(grid: str):
    """(device, "gpu" | "cpu", info, rooflines) of a run on the default device, printed."""
    device = jax.devices()[0]
    kind = "gpu" if device.platform == "gpu" else "cpu"
    run_info = info(device)
    run_info["grid"] = grid
    print(f"# device: {run_info['device']} ({kind}), jax {run_info['jax']}", flush=True)
    roof = rooflines(kind)
    if roof:
        print(
            f"# rooflines: bf16 matmul {roof['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {roof['hbm_copy_read_plus_write_gbps']:.0f} GB/s (read+write), "
            f"read {roof['hbm_read_gbps']:.0f} GB/s (jnp.sum of 4 GiB)",
            flush=True,
        )
    return device, kind, run_info, roof
