"""Tensor-parallel generation (`jax_flash.models.shard_model`) against the single-device run.

The checks need several devices. Where fewer are visible (a plain CPU run), one test runs this
file again in a subprocess with 4 CPU host devices (``--xla_force_host_platform_device_count``,
which must be set before jax starts), so the rest of the suite keeps its single device; on a
machine with several GPUs the checks run on them directly. Tiny float32 models.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate, shard_model  # noqa: E402
from jax_flash.nn import block_table  # noqa: E402

HOST_DEVICES = 4
_CHILD = "JAX_FLASH_TP_CHILD"

# GQA 8:4 (4 KV heads: splits over 2 or 4 devices), vocab divisible by 4 (vocab-parallel
# embedding and LM head), MLP 88 = 4 * 22.
LLAMA = LlamaConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
# Biases everywhere, tied embeddings over an odd vocabulary (replicated, not split), a sliding
# window on layer 1, GQA 6:2.
BIASED = LlamaConfig(
    vocab_size=97,
    hidden_size=40,
    intermediate_size=66,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
    o_proj_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    sliding_window=6,
    sliding_window_layers=(False, True),
)

multi = pytest.mark.skipif(
    jax.device_count() < 2, reason="needs several devices (run in a subprocess below)"
)


def _mesh(n):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} visible")
    return jax.make_mesh((n,), ("tensor",), devices=jax.devices()[:n])


def _random_model(config, seed):
    model = LlamaForCausalLM.random(config, seed=seed)
    # Random biases: the default 0 would not show a bias added on every device (n times).
    rng = np.random.default_rng(seed + 1)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] == "bias":
            var.set_value(jnp.asarray(rng.standard_normal(var.shape, np.float32) * 0.5))
    return model


def _prompts(rng, vocab, lens):
    return [rng.integers(0, vocab, n).tolist() for n in lens]


@pytest.mark.skipif(
    jax.device_count() >= 2 or os.environ.get(_CHILD) == "1",
    reason="several devices visible: the checks run here directly",
)
def test_on_host_devices():
    """Run this file's checks on 4 CPU host devices in a fresh process."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={HOST_DEVICES}".strip(),
        JAX_PLATFORMS="cpu",
        **{_CHILD: "1"},
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="run once, by the parent process")
def test_example_runs(tmp_path):
    """examples/generate_sharded.py on 2 CPU host devices (its own process): the float32
    tokens equal, the JSON holds a row per device count."""
    out = tmp_path / "tp.json"
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate_sharded.py"
    args = "--cpu-devices 2 --batch 3 --prompt-len 13 --new-tokens 5 --repeats 1"
    cmd = [sys.executable, str(example), *args.split(), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["float32_tokens_equal"] is True
    assert [r["devices"] for r in record["rows"]] == [1, 2]
    assert all(r["decode_tokens_per_s"] > 0 for r in record["rows"])


@multi
@pytest.mark.parametrize("n", [2, 4])
def test_greedy_equals_one_device(n, rng):
    mesh = _mesh(n)
    model = _random_model(LLAMA, seed=int(rng.integers(1 << 16)))
    sharded = shard_model(model, mesh)

    # q/k/v [hidden, Hkv, G + 2, D] split on KV heads; gate/up [hidden, 2, inner] on inner.
    qkv = sharded.layers[0].self_attn.qkv_proj.kernel[...]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None, None)
    assert {s.data.shape for s in qkv.addressable_shards} == {(48, 4 // n, 4, 16)}
    gate_up = sharded.layers[1].mlp.gate_up_proj.kernel[...]
    assert {s.data.shape for s in gate_up.addressable_shards} == {(48, 2, 88 // n)}
    down = sharded.layers[1].mlp.down_proj.kernel[...]
    assert {s.data.shape for s in down.addressable_shards} == {(88 // n, 48)}
    emb = sharded.embed_tokens.embedding[...]
    assert {s.data.shape for s in emb.addressable_shards} == {(96 // n, 48)}
    assert model.layers[0].self_attn.qkv_proj.kernel[...].sharding.num_devices == 1  # untouched

    cache = sharded.init_cache(9, 4, block_table([[1, 2], [3]]))
    assert cache.k_pages[0].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert {s.data.shape for s in cache.v_pages[1].addressable_shards} == {(9, 4, 4 // n, 16)}

    # Prefill logits of packed prompts of odd lengths.
    lens = [5, 19, 1, 33]
    prompts = _prompts(rng, LLAMA.vocab_size, lens)
    tokens = jnp.asarray(np.concatenate(prompts), jnp.int32)
    cu = jnp.asarray(np.cumsum([0, *lens]), jnp.int32)
    rows = [list(range(1 + 3 * b, 4 + 3 * b)) for b in range(len(lens))]

    def prefill(m):
        c = m.init_cache(16, 16, block_table(rows))
        return jax.jit(lambda s, c: nnx.merge(gd, s).prefill(c, tokens, cu))(nnx.state(m), c)[0]

    gd = nnx.graphdef(model)
    want = prefill(model)
    gd = nnx.graphdef(sharded)
    got = prefill(sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    max_new = [7, 13, 3, 10]
    ref = generate(model, prompts, max_new, page_size=4)
    out = generate(sharded, prompts, max_new, page_size=4, steps_per_call=5)
    assert out.tokens == ref.tokens
    assert [len(t) for t in out.tokens] == max_new


@multi
def test_sampling_beams_and_biases_equal_one_device(rng):
    """Biases (column-split q/k/v and gate/up, added once after the row-parallel sums), tied
    embeddings over a vocabulary the mesh does not divide (replicated), a sliding window;
    sampling with the same key, and beam search (cache rows reordered on the split pages)."""
    mesh = _mesh(2)
    model = _random_model(BIASED, seed=int(rng.integers(1 << 16)))
    sharded = shard_model(model, mesh)
    emb = sharded.embed_tokens.embedding[...]
    assert emb.sharding.is_fully_replicated
    prompts = _prompts(rng, BIASED.vocab_size, [11, 3, 26])
    kw = dict(greedy=False, temperature=0.9, top_k=40, top_p=0.95, seed=int(rng.integers(99)))
    ref = generate(model, prompts, 9, page_size=4, **kw)
    out = generate(sharded, prompts, 9, page_size=4, **kw)
    assert out.tokens == ref.tokens
    ref = generate(model, prompts, 6, page_size=4, num_beams=3)
    out = generate(sharded, prompts, 6, page_size=4, num_beams=3)
    assert out.beams == ref.beams
    # A score is a sum of log-probabilities; each one's float32 error is absolute (eps times the
    # logits' scale, ~1e-6 here), so a confident beam's score near 0 needs an absolute bound.
    np.testing.assert_allclose(out.scores, ref.scores, rtol=1e-5, atol=1e-5)


@multi
def test_rejects_layouts_that_do_not_divide():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4])
    model = LlamaForCausalLM.random(BIASED)  # 2 KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 .* size 4 of mesh axis 'tensor'"):
        shard_model(model, mesh)
    odd_mlp = LlamaForCausalLM.random(LlamaConfig(**{**vars(LLAMA), "intermediate_size": 90}))
    with pytest.raises(ValueError, match=r"intermediate_size 90 .* size 4"):
        shard_model(odd_mlp, mesh)
    two_d = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"other than 'tensor' must have size 1"):
        shard_model(LlamaForCausalLM.random(LLAMA), two_d)
    with pytest.raises(ValueError, match=r"no axis 'model'"):
        shard_model(LlamaForCausalLM.random(LLAMA), mesh, axis="model")


def _collectives(model, step):
    """The collectives of one compiled step, ``step`` "decode" (3 rows) or "prefill" (3 packed
    prompts in 24 rows), sorted (op, result shape) pairs, and what tensor parallelism needs:
    an all-reduce of the hidden states after the embedding lookup (vocab-parallel) and after
    every o_proj and down_proj, and an all-gather of the vocab-parallel logits."""
    c = model.config
    cache = model.init_cache(7, 8, block_table([[1, 2], [3, 4], [5, 6]]))
    gd = nnx.graphdef(model)
    if step == "decode":
        cache = cache.replace(kv_lens=jnp.asarray([5, 9, 1], jnp.int32))
        fn = jax.jit(lambda s, c, t: nnx.merge(gd, s).decode(c, t))
        tokens, hidden = jnp.zeros((3,), jnp.int32), f"f32[3,1,{c.hidden_size}]"
    else:
        cu = jnp.asarray([0, 5, 14, 17], jnp.int32)
        fn = jax.jit(lambda s, c, t: nnx.merge(gd, s).prefill(c, t, cu))
        tokens, hidden = jnp.zeros((24,), jnp.int32), f"f32[24,{c.hidden_size}]"
    hlo = fn.lower(nnx.state(model), cache, tokens).compile().as_text()
    got = []
    # One entry per array a collective produces: XLA may combine collectives into one op with
    # a tuple result, and an async all-gather-start returns (operands, results).
    pattern = (
        r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    )
    for result, op, start in re.findall(pattern + r"(-start)?\(", hlo):
        arrays = re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", result)
        if op == "all-gather" and start and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]
        got += [(op, _squeezed(a)) for a in arrays]
    got.sort()
    needed = [("all-reduce", _squeezed(hidden))] * (1 + 2 * c.num_hidden_layers)
    needed.append(("all-gather", f"f32[3,{c.vocab_size}]"))
    return got, needed


def _squeezed(shape: str) -> str:
    """An HLO array type without its size-1 dimensions ("f32[3,1,48]" -> "f32[3,48]"): XLA on
    a GPU drops the decode step's unit axis before its all-reduces, on a CPU it keeps it; the
    data moved is the same."""
    dtype, dims = shape[:-1].split("[")
    return f"{dtype}[{','.join(d for d in dims.split(',') if d != '1')}]"


@multi
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_collectives_of_the_model_layout(step):
    """With the pure-XLA path of the attention ops (no custom calls), a step compiles to
    exactly the collectives tensor parallelism needs: the model's own layout gathers nothing.
    (The reference attention also reduces one flag over the heads per layer: its check for
    non-finite values in v.)"""
    model = shard_model(LlamaForCausalLM.random(LLAMA, attention_impl="xla"), _mesh(2))
    got, needed = _collectives(model, step)
    assert got == sorted(needed + [("all-reduce", "pred[]")] * LLAMA.num_hidden_layers)


@multi
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_collectives_with_kernels(step):
    """The same with jax_flash's kernels: no all-gather of the KV cache or of q/k/v around the
    attention and cache-write custom calls."""
    model = shard_model(LlamaForCausalLM.random(LLAMA), _mesh(2))
    got, needed = _collectives(model, step)
    assert got == sorted(needed)
