"""An OpenAI-style completions endpoint over an `Engine`, on aiohttp.

aiohttp is one well-kept library that is both the asyncio HTTP server (with streamed responses
for server-sent events) and the client the tests use, so the ``serve`` extra adds one package.

The engine is not thread-safe: it runs in one background thread (`EngineThread`) that owns it,
takes new requests and aborts from a queue, steps while there is work and hands each request's
tokens to its sink. A handler's sink detokenises them there (`Detokenizer`, while the device
runs the next step), so a request whose text reaches a stop string is ended (`Engine.stop`)
before the engine plans another step, then posts tokens and text to the handler's event loop.
Routes:

- ``POST /v1/completions``: ``prompt`` (a string, with a tokenizer, or a list of token ids),
  ``max_tokens`` (16), ``temperature`` (1.0; 0 is greedy), ``top_p``, ``top_k``, ``min_p``,
  ``seed``, ``stop`` (a string or a list of up to 4; needs a tokenizer), ``stop_token_ids``,
  ``ignore_eos`` (else the model's EOS ids stop it), ``stream``. Each choice carries ``text``
  (the prompt's continuation, ending before the first stop string reached, which ends the
  choice with ``finish_reason`` "stop") and, beyond the OpenAI fields, ``token_ids`` (up to
  the one that completed the stop string). With ``stream`` the response is
  ``text/event-stream``: one ``data: {...}`` chunk per step's tokens, the last with
  ``finish_reason``, then ``data: [DONE]``; text that could begin a stop string is held back
  until it cannot (or the choice ends), so what was sent is never taken back.
- ``GET /v1/models``, ``GET /health``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import queue
import threading
import time
import traceback
from collections.abc import Callable

from aiohttp import web

from .detokenize import Detokenizer
from .engine import Engine
from .request import SamplingParams

# sink(tokens, finish_reason) -> whether the request is done (its text reached a stop string)
Sink = Callable[[list[int], "str | None"], bool]
MAX_STOP_STRINGS = 4  # OpenAI's limit


class EngineThread:
    """Owns ``engine`` in a daemon thread; :meth:`submit` and :meth:`abort` are thread-safe."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[int, Sink] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jax_flash-engine", daemon=True)
        self._thread.start()

    def submit(self, sink: Sink, **request) -> concurrent.futures.Future:
        """Queue ``request`` (:meth:`Engine.add_request` arguments); the future gives its id,
        or the engine's ValueError. ``sink(tokens, finish_reason)`` is called in the engine
        thread after every step that produced tokens for it, and once finished; when it
        returns True the request is stopped there (`Engine.stop`) and its sink not called
        again."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", future, sink, request))
        return future

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join()

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, future, sink, request = command
            try:
                rid = self.engine.add_request(**request)
            except (ValueError, TypeError) as e:
                future.set_exception(e)
                return
            self._sinks[rid] = sink
            future.set_result(rid)
        elif command[0] == "abort":
            self.engine.abort(command[1])
            self.engine.forget(command[1])
            self._sinks.pop(command[1], None)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            busy = self.engine.has_unfinished()
            try:  # block only while idle
                command = self._commands.get(block=not busy)
                self._apply(command)
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                out = self.engine.step()
            except Exception:  # end every open request instead of leaving its client waiting
                traceback.print_exc()
                for sink in self._sinks.values():
                    sink([], "error")
                self._sinks.clear()
                raise
            for rid in set(out.tokens) | set(out.finished):
                sink = self._sinks.get(rid)
                if sink is None:
                    continue
                reason = out.finished.get(rid)
                done = sink(out.tokens.get(rid, []), reason)
                if reason is None and done:  # before the next step: it gets no further row
                    self.engine.stop(rid)
                if reason is not None or done:
                    del self._sinks[rid]
                    self.engine.forget(rid)


class _BadRequest(ValueError):
    pass


def _field(body, name, kind, default):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _BadRequest(f"'{name}' must be {kind.__name__}, got {value!r}")
    return value


def make_app(engine: Engine, *, tokenizer=None, model_name: str = "jax_flash") -> web.Application:
    """The aiohttp application serving ``engine`` (``tokenizer``: a ``tokenizers.Tokenizer``,
    or None to take and return token ids only)."""
    app = web.Application()
    ids = itertools.count()
    eos = engine.model.config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    async def start(app_):
        app_["engine"] = EngineThread(engine)

    async def stop(app_):
        app_["engine"].stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)

    def parse(body) -> tuple[dict, list[str], bool]:
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if tokenizer is None:
                raise _BadRequest("this server has no tokenizer: 'prompt' must be token ids")
            prompt = tokenizer.encode(prompt).ids
        elif not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise _BadRequest("'prompt' must be a string or a list of token ids")
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            raise _BadRequest("'n' and 'best_of' other than 1 are not supported")
        stop_strings = parse_stop(body.get("stop"))
        if stop_strings and tokenizer is None:
            raise _BadRequest("this server has no tokenizer: 'stop' strings need one")
        stop = _field(body, "stop_token_ids", list, [])
        if not all(type(t) is int for t in stop):
            raise _BadRequest("'stop_token_ids' must be a list of ints")
        if not _field(body, "ignore_eos", bool, False):
            stop = stop + eos
        sampling = SamplingParams(
            temperature=_field(body, "temperature", float, 1.0),
            top_k=_field(body, "top_k", int, 0),
            top_p=_field(body, "top_p", float, 1.0),
            min_p=_field(body, "min_p", float, 0.0),
            seed=_field(body, "seed", int, 0),
        )
        request = dict(
            prompt_tokens=prompt,
            max_new_tokens=_field(body, "max_tokens", int, 16),
            sampling=sampling,
            stop_tokens=stop,
        )
        return request, stop_strings, _field(body, "stream", bool, False)

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            spec, stop_strings, stream = parse(await request.json())
        except (ValueError, json.JSONDecodeError) as e:  # SamplingParams raises ValueError
            return _error(str(e))
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        detok = None
        if tokenizer is not None:
            detok = Detokenizer(tokenizer, spec["prompt_tokens"], stop_strings)

        def sink(tokens, reason) -> bool:  # in the engine thread
            text, stopped = "", False
            try:
                if detok is not None:
                    for i, token in enumerate(tokens):
                        text += detok.add(token)
                        if detok.stopped:  # later tokens are not part of the output
                            tokens, reason, stopped = tokens[: i + 1], "stop", True
                            break
                    if reason is not None and not stopped:
                        text += detok.finish()  # its last characters may complete one
                        reason = "stop" if detok.stopped else reason
            except Exception:  # a tokenizer failure ends this request, not the engine thread
                traceback.print_exc()
                reason, stopped = "error", True
            loop.call_soon_threadsafe(updates.put_nowait, (tokens, text, reason))
            return stopped

        thread: EngineThread = request.app["engine"]
        try:
            rid = await asyncio.wrap_future(thread.submit(sink, **spec))
        except (ValueError, TypeError) as e:
            return _error(str(e))
        head = dict(
            id=f"cmpl-{next(ids)}",
            object="text_completion",
            created=int(time.time()),
            model=model_name,
        )
        tokens, reason, text = [], None, ""
        response = None
        try:
            if stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            while reason is None:
                new, delta, reason = await updates.get()
                tokens += new
                text += delta
                if not stream:
                    continue
                choice = dict(index=0, text=delta, token_ids=new, finish_reason=reason)
                await response.write(_event(dict(head, choices=[choice])))
        except (asyncio.CancelledError, ConnectionResetError):
            thread.abort(rid)
            raise
        if stream:
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        n = len(spec["prompt_tokens"])
        choice = dict(index=0, text=text, token_ids=tokens, finish_reason=reason)
        usage = dict(prompt_tokens=n, completion_tokens=len(tokens), total_tokens=n + len(tokens))
        return web.json_response(dict(head, choices=[choice], usage=usage))

    async def models(request):
        return web.json_response(
            dict(object="list", data=[dict(id=model_name, object="model", owned_by="jax_flash")])
        )

    async def health(request):
        return web.json_response(dict(status="ok"))

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def parse_stop(stop) -> list[str]:
    """OpenAI's ``stop``: None, a string, or a list of up to 4 strings, none empty."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise _BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if not all(stops):
        raise _BadRequest(f"'stop' strings must not be empty, got {stop!r}")
    return stops


def _event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _error(message: str) -> web.Response:
    return web.json_response(
        dict(error=dict(message=message, type="invalid_request_error")), status=400
    )
