"""Serve a Hugging Face-format checkpoint over HTTP (OpenAI-style ``/v1/completions``).

    python -m jax_flash.serve --checkpoint DIR [--port 8000] [--num-pages 1024] ...

Needs the ``serve`` extra (aiohttp). Prints ``serving MODEL on http://HOST:PORT`` once
listening (``--port 0`` picks a free port); stops on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os


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
    args = parser.parse_args(argv)

    try:
        from aiohttp import web
    except ImportError as e:
        raise SystemExit(
            f"python -m jax_flash.serve needs aiohttp ({e}): pip install 'jax_flash[serve]'"
        ) from e

    from ..models import load_hf_checkpoint, load_tokenizer
    from .engine import Engine
    from .http import make_app

    model, _ = load_hf_checkpoint(args.checkpoint, dtype=args.dtype)
    engine = Engine(
        model,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_batch=args.max_batch,
        max_prefill_rows=args.max_prefill_rows,
        prefill_chunk=args.prefill_chunk,
        max_seq_len=args.max_seq_len,
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
