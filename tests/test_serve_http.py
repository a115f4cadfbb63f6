"""The HTTP endpoint: ``python -m jax_flash.serve`` on a checkpoint, driven by a real HTTP
client (aiohttp) over loopback; streamed tokens equal `generate`'s for the same request.

Stop strings: the incremental `Detokenizer` against decoding whole sequences (a byte-level
tokenizer whose characters' bytes are split across tokens), and the endpoint (served in this
process, so the engine can be inspected) against `generate`'s tokens decoded whole: a stop
string inside a token, across tokens, at the start, several; streamed and whole responses equal;
a stopped request's pages released and no further steps run for it; bad ``stop`` values.
"""

import asyncio
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
tokenizers = pytest.importorskip("tokenizers")
from aiohttp import web  # noqa: E402

from jax_flash.models import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    generate,
    hf_state_dict,
    load_hf_checkpoint,
)
from jax_flash.serve import Detokenizer, Engine  # noqa: E402
from jax_flash.serve.http import make_app  # noqa: E402

WORDS = "<unk> <s> </s> the a cat dog sat on mat ran to house garden and with big small".split()
CONFIG = LlamaConfig(
    vocab_size=len(WORDS) + 3,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=2,
)


def write_checkpoint(path):
    model = LlamaForCausalLM.random(CONFIG, seed=3)
    safetensors_numpy.save_file(hf_state_dict(model), str(path / "model.safetensors"))
    c = CONFIG
    hf = dict(
        model_type="llama",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=128,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        eos_token_id=2,
        torch_dtype="float32",
    )
    (path / "config.json").write_text(json.dumps(hf))
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    write_checkpoint(path)
    cmd = [
        sys.executable,
        "-m",
        "jax_flash.serve",
        "--checkpoint",
        str(path),
        "--port",
        "0",
        "--num-pages",
        "64",
        "--page-size",
        "4",
        "--max-batch",
        "2",
        "--prefill-chunk",
        "8",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen = []
    try:
        while True:
            line = lines.get(timeout=180)
            seen.append(line)
            if line.startswith("serving "):
                url = line.split(" on ")[-1].strip()
                break
            assert proc.poll() is None, "".join(seen)
        yield url, path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def stream(session, url, body):
    """POST a streamed completion; returns (token ids, text, finish reason, number of events)."""
    tokens, text, reason, events = [], "", None, 0
    async with session.post(f"{url}/v1/completions", json=dict(body, stream=True)) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        done = False
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice["token_ids"]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            events += 1
        assert done, "the stream did not end with [DONE]"
    return tokens, text, reason, events


def test_streams_tokens_to_a_client(server):
    url, path = server
    model, _ = load_hf_checkpoint(str(path))
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt_a = "the cat sat on the mat and the dog ran to the house"
    ids_a = tok.encode(prompt_a).ids
    ids_b = [3, 5, 7, 9, 11]
    sampled = dict(temperature=0.8, top_k=10, seed=5)

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 200
            a = dict(prompt=prompt_a, max_tokens=9, temperature=0, ignore_eos=True)
            b = dict(prompt=ids_b, max_tokens=7, ignore_eos=True, **sampled)
            got = await asyncio.gather(stream(session, url, a), stream(session, url, b))
            async with session.post(f"{url}/v1/completions", json=dict(a, stream=False)) as resp:
                whole = await resp.json()
            async with session.post(
                f"{url}/v1/completions", json=dict(prompt=[1], max_tokens=0)
            ) as r:
                bad = (r.status, await r.json())
            return got, whole, bad

    (a, b), whole, bad = asyncio.run(main())
    ref_a = generate(model, [ids_a], 9, page_size=4).tokens[0]
    ref_b = generate(model, [ids_b], 7, greedy=False, page_size=4, **sampled).tokens[0]
    assert a[0] == ref_a and a[2] == "length" and a[3] >= 2  # streamed in several events
    assert a[1].split() == tok.decode(ref_a).split()
    assert b[0] == ref_b
    choice = whole["choices"][0]
    assert choice["token_ids"] == ref_a and whole["usage"]["completion_tokens"] == 9
    assert bad[0] == 400 and "max_new_tokens" in bad[1]["error"]["message"]


def test_stop_string_over_the_command_line_server(server):
    """``python -m jax_flash.serve`` with the checkpoint's tokenizer: a text prompt, a stop
    word, streamed and whole responses end before it."""
    url, path = server
    model, _ = load_hf_checkpoint(str(path))
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = "the dog sat on a big mat"
    ids = tok.encode(prompt).ids
    ref = generate(model, [ids], 12, page_size=4).tokens[0]
    full = tok.decode(ids + ref)[len(tok.decode(ids)) :]  # " w1 w2 ...": words joined by spaces
    word = full.split()[3]
    body = dict(prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[word])

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                complete(session, url, body), stream_pieces(session, url, body)
            )

    (whole, _), (pieces, tokens, reason) = asyncio.run(main())
    cut = full.find(word)
    assert whole["text"] == "".join(pieces) == full[:cut] and len(full[:cut].split()) <= 3
    assert whole["finish_reason"] == reason == "stop"
    assert whole["token_ids"] == tokens == ref[: len(tokens)] and len(tokens) <= 4


# -- stop strings ----------------------------------------------------------------------------


def byte_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable character for each byte (GPT-2's table)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Words, and the bytes of é (2), € (3) and 😀 (4) split over tokens in several ways (one token
# with an ASCII letter before a lead byte): a character's bytes often come in separate tokens.
PIECES = [
    *(w.encode() for w in (" the", " cat", " sat", " on", " mat", "ing", "s", " a", "b", "c")),
    *(b"\xc3", b"\xa9", b"\xc3\xa9", b"x\xc3"),
    *(b"\xe2", b"\xe2\x82", b"\xac", b"\x82\xac"),
    *(b"\xf0\x9f", b"\x98", b"\x80", b"\xf0\x9f\x98"),
]
ID = {p: i for i, p in enumerate(PIECES)}
# The word model's shape over these pieces; no EOS id (a piece may end a reply anywhere).
BYTE_CONFIG = dataclasses.replace(CONFIG, vocab_size=len(PIECES), eos_token_id=None)


@pytest.fixture(scope="module")
def byte_tokenizer():
    table = byte_chars()
    vocab = {"".join(table[b] for b in p): i for i, p in enumerate(PIECES)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    tok.decoder = tokenizers.decoders.ByteLevel()
    assert tok.decode([ID[b"\xc3"], ID[b"\xa9"]]) == "é"
    return tok


def continuation(tok, prompt, tokens) -> str:
    """The text ``tokens`` add to ``prompt``'s, decoded whole."""
    return tok.decode(prompt + tokens)[len(tok.decode(prompt)) :]


def test_detokenizer_waits_for_whole_characters(byte_tokenizer):
    d = Detokenizer(byte_tokenizer, [ID[b" the"]])
    out = [d.add(ID[p]) for p in (b"\xc3", b"\xa9", b"\xe2", b"\x82\xac", b"x\xc3", b"\xa9")]
    assert out == ["", "é", "", "€", "x", "é"]  # "x" is whole: sent before the é it starts
    out = [d.add(ID[p]) for p in (b" cat", b"\xa9", b" on", b"\xf0\x9f", b"\x98")]
    assert out == [" cat", "", "\ufffd on", "", ""]  # a stray byte shows once it cannot complete
    assert d.finish() == "\ufffd" and d.text == "é€xé cat\ufffd on\ufffd"


def test_detokenizer_matches_whole_decoding(byte_tokenizer):
    """Random outputs and stop strings: every piece sent equals what decoding the whole tokens
    so far allows (whole characters, less the longest suffix that may begin a stop string);
    the output ends at the first token whose text holds a stop string, cut before it."""
    tok, rng = byte_tokenizer, np.random.default_rng(0)
    prompt = [ID[b" the"], ID[b" cat"]]
    for trial in range(300):
        tokens = rng.integers(0, len(PIECES), rng.integers(1, 25)).tolist()
        full = continuation(tok, prompt, tokens)
        stops = []
        for _ in range(rng.integers(0, 5)):
            if full and rng.random() < 0.8:  # a piece of the text, else a stranger
                at = int(rng.integers(0, len(full)))
                stops.append(full[at : at + int(rng.integers(1, 5))])
            else:
                stops.append("".join(rng.choice(list("abc q€é"), rng.integers(1, 4))))
        d = Detokenizer(tok, prompt, stops)
        for k in range(1, len(tokens) + 1):
            piece = d.add(tokens[k - 1])
            known = continuation(tok, prompt, tokens[:k]).rstrip("\ufffd")
            hits = [known.find(s) for s in stops if s in known]
            if hits:
                assert d.stopped and d.text == known[: min(hits)], (trial, stops, tokens[:k])
                assert d.num_tokens == k
                break
            assert not d.stopped
            # Release everything but text from where a stop string could still begin.
            may_begin = [
                p
                for p in range(len(known))
                if any(len(s) > len(known) - p and s.startswith(known[p:]) for s in stops)
            ]
            assert d.text == known[: min(may_begin, default=len(known))], (trial, stops, k)
            assert d.text.endswith(piece)
        else:
            d.finish()  # the last characters are whole now (or never will be)
            hits = [full.find(s) for s in stops if s in full]
            assert d.text == full[: min(hits, default=len(full))], (trial, stops, tokens)
            assert d.stopped == bool(hits)


@pytest.fixture(scope="module")
def byte_engine():
    model = LlamaForCausalLM.random(BYTE_CONFIG, seed=4)
    return Engine(model, num_pages=64, page_size=4, max_batch=2, prefill_chunk=8)


def serve_in_process(engine, tokenizer, client):
    """Serve ``make_app(engine)`` on a loopback port and run ``await client(session, url)``;
    returns its result once the engine is idle and the server closed."""

    async def main():
        runner = web.AppRunner(make_app(engine, tokenizer=tokenizer))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            async with aiohttp.ClientSession() as session:
                result = await client(session, f"http://{host}:{port}")
            while engine.has_unfinished():  # the step in flight when a request stopped
                await asyncio.sleep(0.01)
            return result
        finally:
            await runner.cleanup()

    return asyncio.run(main())


async def complete(session, url, body):
    """POST a whole (not streamed) completion; returns its choice and usage."""
    async with session.post(f"{url}/v1/completions", json=dict(body, stream=False)) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    return out["choices"][0], out["usage"]


async def stream_pieces(session, url, body):
    """POST a streamed completion; returns (text pieces, token ids, finish reason)."""
    pieces, tokens, reason = [], [], None
    async with session.post(f"{url}/v1/completions", json=dict(body, stream=True)) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"])
                tokens += choice["token_ids"]
                reason = choice["finish_reason"] or reason
    return pieces, tokens, reason


def test_stop_strings(byte_engine, byte_tokenizer):
    tok, engine = byte_tokenizer, byte_engine
    prompt = [ID[b" the"], ID[b" cat"], ID[b" sat"]]
    ref = generate(engine.model, [prompt], 24, page_size=4).tokens[0]
    full = continuation(tok, prompt, ref)

    def pick(k):  # a stop string inside token k, one across its end (None: none fits)
        if len(PIECES[ref[k]]) < 3:
            return None
        start = len(continuation(tok, prompt, ref[:k]))  # where token k's text starts
        end = start + len(PIECES[ref[k]])
        assert full[start:end] == PIECES[ref[k]].decode()
        inside, across = full[start + 1 : end - 1], full[end - 2 : end + 1]
        if full.find(inside) == start + 1 and full.find(across) == end - 2:
            return inside, across  # their first places: where the text stops
        return None

    inside, across = next(filter(None, map(pick, range(2, len(ref) - 1))))
    cases = [
        [inside],
        [across],
        full[:2],  # a string, at the very start
        ["\u2603 none", across, inside, "zzz"],  # the first one in the text wins
        [full[-1] + "\u2603"],  # begins with the last character: held, then sent at the end
    ]

    async def client(session, url):
        base = dict(prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
        out = []
        for stop in cases:
            body = dict(base, stop=stop)
            out.append(
                await asyncio.gather(
                    complete(session, url, body), stream_pieces(session, url, body)
                )
            )
        return out

    results = serve_in_process(engine, tok, client)
    for stop, ((whole, usage), (pieces, streamed, reason)) in zip(cases, results, strict=True):
        stops = [stop] if isinstance(stop, str) else stop
        hits = [full.find(s) for s in stops if s in full]
        cut = min(hits, default=len(full))
        assert whole["text"] == "".join(pieces) == full[:cut], stop
        assert whole["finish_reason"] == reason == ("stop" if hits else "length"), stop
        n = len(whole["token_ids"])
        assert whole["token_ids"] == streamed == ref[:n] and usage["completion_tokens"] == n
        if hits:  # the last token taken is the one that completed the stop string
            last = [continuation(tok, prompt, ref[:m]).rstrip("\ufffd") for m in (n - 1, n)]
            assert not any(s in last[0] for s in stops) and any(s in last[1] for s in stops)
        else:
            assert n == 24 and len("".join(pieces[:-1])) < len(full)  # held to the end
    assert results[2][0][0]["text"] == ""


def test_stop_string_releases_the_request(byte_engine, byte_tokenizer):
    """A request stopped by a stop string takes no more steps and gives its pages back."""
    tok, engine = byte_tokenizer, byte_engine
    prompt = [ID[b" on"], ID[b" the"], ID[b" mat"]]
    ref = generate(engine.model, [prompt], 40, page_size=4).tokens[0]
    known = [continuation(tok, prompt, ref[:k]).rstrip("\ufffd") for k in range(41)]
    k = next(k for k in range(3, 41) if len(known[k]) >= 2)
    stop = known[k][-2:]  # the text reaches it by token k
    rows = engine.stats.decode_tokens
    body = dict(prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
    choice, _ = serve_in_process(engine, tok, lambda s, url: complete(s, url, body))
    n = len(choice["token_ids"])
    assert choice["finish_reason"] == "stop" and n <= k < 20
    # The first token comes from the prompt's step; the burst that drew the stop may have drawn
    # up to K - 1 tokens past it, and one more dispatch of up to K was already in flight.
    K = engine.scheduler.decode_steps
    assert engine.stats.decode_tokens - rows <= n + 2 * K - 2
    assert not engine.has_unfinished() and engine.pool.num_used == 0


def test_bad_stop_values(byte_engine, byte_tokenizer):
    bad = [5, "", [""], ["a", ""], ["a", "b", "c", "d", "e"], ["a", 3], {"a": 1}]

    async def client(session, url):
        out = []
        for stop in bad:
            body = dict(prompt=[1, 2], max_tokens=4, stop=stop)
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                out.append((resp.status, (await resp.json())["error"]["message"]))
        return out

    results = serve_in_process(byte_engine, byte_tokenizer, client)
    for stop, (status, message) in zip(bad, results, strict=True):
        assert status == 400 and "'stop'" in message, (stop, message)

    async def no_tokenizer(session, url):
        body = dict(prompt=[1, 2], max_tokens=4, stop="a")
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            return resp.status, (await resp.json())["error"]["message"]

    status, message = serve_in_process(byte_engine, None, no_tokenizer)
    assert status == 400 and "'stop'" in message and "tokenizer" in message
