"""The files of a run: JSON (device, versions, rooflines, rows) rewritten after every row, so a
run cut short keeps what it measured, and a PNG plot at the end (where matplotlib is installed).
The command line saves to DEFAULT_OUT unless --out names another folder."""

from __future__ import annotations

import datetime
import json
import os

from jax_flash.bench import plot

DEFAULT_OUT = "bench-results"  # relative to the working directory; git-ignored in this repo


def out_path(name: str, info: dict, out_dir: str) -> str:
    """Path (without extension) of a run's JSON and PNG: benchmark, device and start time."""
    dev = info["device"].replace(" ", "_")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    return os.path.join(out_dir, f"{name}_{dev}_{stamp}")


def save_partial(path: str, name: str, info: dict, roof: dict, rows: list):
    """The rows measured so far, rewritten after each row."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = {"benchmark": name, "info": info, "rooflines": roof, "rows": rows, "partial": True}
    with open(path + ".json", "w") as f:
        json.dump(partial, f, indent=1)


def save(result: dict, path: str):
    """JSON of the whole result, and a PNG plot (if matplotlib is installed); prints both
    paths."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {path}.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig = plot.PLOTS[result["benchmark"]](plt, result)
    fig.savefig(path + ".png", dpi=110)
    plt.close(fig)
    print(f"saved {path}.png")
