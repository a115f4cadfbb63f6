"""The frame every benchmark's run shares: the device and its rooflines, a progress line per
shape, the rows measured so far (saved after each row when there is an output folder) and the
result at the end."""

from __future__ import annotations

import time

from jax_flash.bench import device, report, save, timing


class Run:
    def __init__(self, name: str, grid: str, out_dir: str | None):
        self.name = name
        self.device, self.kind, self.info, self.roof = device.start(grid)
        self.mem = device.mem_limit(self.device)
        self.out_path = save.out_path(name, self.info, out_dir) if out_dir else None
        self.rows = []
        self._t0 = time.perf_counter()

    def shapes(self, shapes):
        """(i, shape) for each shape, after its progress line."""
        for i, s in enumerate(shapes):
            report.progress(i, len(shapes), self._t0, s.label())
            yield i, s

    def harness_us(self, args, chain) -> float:
        """Microseconds per iteration of the timing loop with a trivial body on these args."""
        return 1e6 * timing.harness_time(args, chain, 500 if self.kind == "gpu" else 5)

    def add(self, row: dict):
        print(f"    (loop harness {row['harness_us']:.1f} us/iteration)", flush=True)
        self.rows.append(row)
        if self.out_path:
            save.save_partial(self.out_path, self.name, self.info, self.roof, self.rows)

    def finish(self, **extra) -> dict:
        """Prints the run's length; returns the result (benchmark, info, rooflines, `extra`,
        rows), saved with its plot when there is an output folder."""
        elapsed = time.perf_counter() - self._t0
        print(f"({len(self.rows)} rows in {elapsed:.0f} s)")
        self.info["elapsed_s"] = elapsed
        result = {"benchmark": self.name, "info": self.info, "rooflines": self.roof}
        result.update(extra)
        result["rows"] = self.rows
        if self.out_path:
            save.save(result, self.out_path)
        return result
