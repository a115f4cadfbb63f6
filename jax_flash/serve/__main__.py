"""Serve a Hugging Face-format checkpoint over HTTP (OpenAI-style ``/v1/completions``).

    python -m jax_flash.serve --checkpoint DIR [--port 8000] [--num-pages 1024] ...

Needs the ``serve`` extra (aiohttp). Prints ``serving MODEL on http://HOST:PORT`` once
listening (``--port 0`` picks a free port); stops on Ctrl-C. ``--tensor-parallel N`` places the
model tensor-parallel (`jax_flash.models.shard_model`) over the first N visible devices.
"""

from __future__ import annotations

import argparse
import asyncio
import os


def tensor_parallel_mesh(n: int):
    """A one-axis ("tensor") mesh over the first ``n`` visible devices; ValueError naming
    ``--tensor-parallel`` when ``n`` is not in ``[1, device count]``."""
    import jax

    visible = jax.device_count()
    if not 1 <= n <= visible:
        raise ValueError(
            f"--tensor-parallel {n}: must be in [1, {visible}], the devices visible "
            f"({jax.devices()[0].platform})"
        )
    return jax.make_mesh((n,), ("tensor",), devices=jax.devices()[:n])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="config.json + *.safetensors dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default=None, help="default: the checkpoint's")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-prefill-rows", type=int, default=1)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument(
        "--reserve-tokens",
        type=int,
        default=None,
        metavar="N",
        help="admit a request only while the pool can also hold the next N tokens of every "
        "running request (default: the Engine's)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        metavar="K",
        help="decode steps one device call may run where no prompt chunk is fed (tokens then "
        "stream in bursts of up to K; default: the Engine's)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split heads and MLP columns over the first N devices (N must divide the KV "
        "heads and the MLP width)",
    )
    args = parser.parse_args(argv)

    try:
        from aiohttp import web
    except ImportError as e:
        raise SystemExit(
            f"python -m jax_flash.serve needs aiohttp ({e}): pip install 'jax_flash[serve]'"
        ) from e

    from ..models import load_hf_checkpoint, load_tokenizer, shard_model
    from .engine import Engine
    from .http import make_app
    from .scheduler import DECODE_STEPS, RESERVE_TOKENS

    try:  # before the weights load: a wrong device count fails at once
        mesh = tensor_parallel_mesh(args.tensor_parallel)
    except ValueError as e:
        parser.error(str(e))
    model, _ = load_hf_checkpoint(args.checkpoint, dtype=args.dtype)
    if args.tensor_parallel > 1:  # the Engine serves a sharded model over its mesh
        try:
            model = shard_model(model, mesh)
        except ValueError as e:
            parser.error(f"--tensor-parallel {args.tensor_parallel}: {e}")
    engine = Engine(
        model,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_batch=args.max_batch,
        max_prefill_rows=args.max_prefill_rows,
        prefill_chunk=args.prefill_chunk,
        max_seq_len=args.max_seq_len,
        reserve_tokens=RESERVE_TOKENS if args.reserve_tokens is None else args.reserve_tokens,
        decode_steps=DECODE_STEPS if args.decode_steps is None else args.decode_steps,
    )
    name = os.path.basename(os.path.normpath(args.checkpoint))
    app = make_app(engine, tokenizer=load_tokenizer(args.checkpoint), model_name=name)

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"serving {name} on http://{host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
