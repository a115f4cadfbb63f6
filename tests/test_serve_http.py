"""The HTTP endpoint: ``python -m jax_flash.serve`` on a checkpoint, driven by a real HTTP
client (aiohttp) over loopback; streamed tokens equal `generate`'s for the same request."""

import asyncio
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

from jax_flash.models import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    generate,
    hf_parameters,
    load_hf_checkpoint,
)

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
    tensors = {}
    for name, (var, transpose) in hf_parameters(model).items():
        array = np.asarray(var[...], np.float32)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
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
