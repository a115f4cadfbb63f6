"""Training the Llama-family decoder: the cache-free forward (padded ``[B, S]`` rows through
flash_attention, packed sequences through flash_attention_varlen), its loss and gradients
w.r.t. every parameter against the same model on the pure-XLA attention path, the next-token
loss and the packing helper, and examples/train.py run briefly.

Tiny float32 models; every option of the model (GQA/MQA, sliding windows on some layers,
Llama 3 and linear RoPE scaling, biases, tied embeddings) is in one of the configs.
"""

import importlib.util
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jax_flash.models import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    next_token_loss,
    next_token_targets,
    pack_sequences,
)

from _util import rel_err  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# GQA 6:2, Llama 3 RoPE scaling (active: the original context is 8 tokens).
LLAMA = LlamaConfig(
    vocab_size=83,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
)
# Qwen2 switches: MQA 3:1, q/k/v biases, tied embeddings, a 5-token window on layer 1 only.
QWEN = LlamaConfig(
    vocab_size=83,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    qkv_bias=True,
    tie_word_embeddings=True,
    sliding_window=5,
    sliding_window_layers=(False, True),
)
# Mistral-like: a 4-token window on every layer, linear RoPE scaling, o-proj and MLP biases.
MISTRAL = LlamaConfig(
    vocab_size=83,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=5,
    num_key_value_heads=5,
    head_dim=8,
    o_proj_bias=True,
    mlp_bias=True,
    sliding_window=4,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
)
CONFIGS = {"llama": LLAMA, "qwen": QWEN, "mistral": MISTRAL}


def _model(config, seed=0):
    """Random weights; biases and norm weights random too, so that their gradients mean
    something."""
    model = LlamaForCausalLM.random(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and len(var.shape) == 1:
            var.set_value(jnp.asarray(1.0 + 0.2 * rng.standard_normal(var.shape), var.dtype))
    return model


def _padded(rng, vocab):
    """Tokens [4, 13]: a full row, a short one, an empty one and a one-token one."""
    tokens = jnp.asarray(rng.integers(0, vocab, (4, 13)), jnp.int32)
    return tokens, {"lengths": jnp.asarray([13, 6, 0, 1], jnp.int32)}


def _packed(rng, vocab):
    """Tokens [29]: sequences of 7, 0, 13, 1 and 5 tokens, then 3 padding rows."""
    tokens = jnp.asarray(rng.integers(0, vocab, 29), jnp.int32)
    return tokens, {"cu_seqlens": jnp.asarray([0, 7, 7, 20, 21, 26], jnp.int32)}


def _losses_and_grads(model, batches):
    """(loss, gradients w.r.t. every parameter) of each ``(tokens, batch kwargs)``, in one
    compiled function (one compilation for both layouts)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, tokens, batch):
        return next_token_loss(nnx.merge(graphdef, params)(tokens, **batch), tokens, **batch)

    def all_layouts(params, batches):
        return [jax.value_and_grad(loss)(params, tokens, batch) for tokens, batch in batches]

    return jax.jit(all_layouts)(params, batches)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_grads_match_xla(platform, rng, name):
    """Padded rows (a full, a short, an empty and a one-token row) and packed sequences (an
    empty one among them, padding rows after): loss and every parameter's gradient on the
    kernels against the pure-XLA attention path."""
    config = CONFIGS[name]
    model = _model(config)
    batches = platform.put([_padded(rng, config.vocab_size), _packed(rng, config.vocab_size)])
    nnx.update(model, platform.put(nnx.state(model, nnx.Param)))
    got = _losses_and_grads(model.with_attention_impl(platform.name), batches)
    expected = _losses_and_grads(model.with_attention_impl("xla"), batches)
    for layout, (loss, grads), (ref_loss, ref_grads) in zip(
        ["padded", "packed"], got, expected, strict=True
    ):
        assert np.isfinite(float(loss)) and float(loss) > 0
        assert abs(float(loss) - float(ref_loss)) < 1e-3 * abs(float(ref_loss)), layout
        flat = dict(nnx.to_flat_state(grads))
        ref_flat = dict(nnx.to_flat_state(ref_grads))
        assert flat.keys() == ref_flat.keys()
        for path, ref in ref_flat.items():
            where = f"{layout}: {'.'.join(map(str, path))}"
            ref = np.asarray(ref[...])
            assert np.linalg.norm(ref) > 0, f"{where}: no gradient reaches this parameter"
            err = rel_err(flat[path][...], ref)
            assert err < 1e-3, f"{where}: relative error {err:.3g}"


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_packed_equals_padded_equals_prefill(rng, name):
    """One set of sequences three ways: packed (positions restart per sequence), padded rows,
    and the cached prefill path; padding never changes the real rows."""
    config = CONFIGS[name]
    model = _model(config)
    lens = [9, 1, 12, 5]
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    packed = np.zeros(T + 3, np.int32)
    packed[:T] = np.concatenate(seqs)
    padded = np.zeros((len(seqs), 14), np.int32)
    for b, s in enumerate(seqs):
        padded[b, : len(s)] = s
    got_packed = model(jnp.asarray(packed), cu_seqlens=jnp.asarray(cu))
    got_padded = model(jnp.asarray(padded), lengths=jnp.asarray(lens, jnp.int32))
    full_rows = model(jnp.asarray(padded))  # causal: padding after a row does not reach it
    pages = -(-14 // 4)
    cache = model.init_cache(
        1 + len(seqs) * pages, 4, 1 + np.arange(len(seqs) * pages).reshape(-1, pages)
    )
    prefill, _ = model.prefill(cache, jnp.asarray(packed), jnp.asarray(cu), all_logits=True)
    assert got_packed.shape == (T + 3, config.vocab_size) and got_packed.dtype == jnp.float32
    for b, s in enumerate(seqs):
        rows = got_packed[cu[b] : cu[b + 1]]
        assert rel_err(got_padded[b, : len(s)], rows) < 1e-5
        assert rel_err(full_rows[b, : len(s)], rows) < 1e-5
        assert rel_err(prefill[cu[b] : cu[b + 1]], rows) < 1e-5


def test_next_token_loss():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11))
    tokens = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], jnp.int32)
    targets, mask = next_token_targets(tokens, lengths=jnp.asarray([5, 2], jnp.int32))
    assert mask.tolist() == [[True] * 4 + [False], [True] + [False] * 4]
    assert targets[0, :4].tolist() == [2, 3, 4, 5] and targets[1, 0] == 7
    logp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    expected = -(logp[0, 0, 2] + logp[0, 1, 3] + logp[0, 2, 4] + logp[0, 3, 5] + logp[1, 0, 7]) / 5
    loss = next_token_loss(logits, tokens, lengths=jnp.asarray([5, 2], jnp.int32))
    assert abs(float(loss) - expected) < 1e-5 * abs(expected)
    # Full rows without lengths: every row but the last predicts.
    assert next_token_targets(tokens)[1].sum() == 8
    # Packed: sequences [0, 3), [3, 3) (empty), [3, 4), [4, 6), then 2 padding rows.
    packed = jnp.arange(8, dtype=jnp.int32)
    cu = jnp.asarray([0, 3, 3, 4, 6], jnp.int32)
    targets, mask = next_token_targets(packed, cu_seqlens=cu)
    assert mask.tolist() == [True, True, False, False, True, False, False, False]
    assert targets[:2].tolist() == [1, 2] and targets[4] == 5
    # No row predicts a token: 0, not NaN.
    assert (
        float(next_token_loss(jnp.zeros((4, 3)), packed[:4], cu_seqlens=jnp.zeros(2, jnp.int32)))
        == 0.0
    )


def test_pack_sequences():
    seqs = [[1] * 5, [2] * 3, [], [3] * 9, [4]]
    batches = list(pack_sequences(seqs, 8, 3))
    for tokens, cu in batches:
        assert tokens.shape == (8,) and cu.shape == (4,) and tokens.dtype == cu.dtype == np.int32
        assert cu[0] == 0 and np.all(np.diff(cu) >= 0) and cu[-1] <= 8
        assert np.all(tokens[cu[-1] :] == 0)
    pieces = [
        tokens[a:b].tolist()
        for tokens, cu in batches
        for a, b in zip(cu[:-1], cu[1:], strict=True)
        if b > a
    ]
    # In order; the 9-token sequence cut at 8; nothing lost.
    assert pieces == [[1] * 5, [2] * 3, [3] * 8, [3], [4]]
    assert [len(list(pack_sequences([[5]] * 7, 8, 3)))] == [math.ceil(7 / 3)]
    with pytest.raises(ValueError, match="num_tokens"):
        next(pack_sequences(seqs, 0, 3))


def test_call_errors():
    model = _model(LLAMA)
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens takes packed tokens \[T\]"):
        model(tokens, cu_seqlens=jnp.asarray([0, 5], jnp.int32))
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\] = \(2,\)"):
        model(tokens, lengths=jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\]"):
        model(tokens[0])
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[B \+ 1\]"):
        model(tokens[0], cu_seqlens=jnp.asarray([0], jnp.int32))
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) must be"):
        next_token_loss(jnp.zeros((2, 5, 7)), tokens[:, :4])


@pytest.fixture(scope="module")
def train_example():
    pytest.importorskip("optax")
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], r"--steps must be >= 1"),
        (["--seq-len", "4096"], r"--seq-len must not exceed --batch-tokens"),
        (["--layout", "ragged"], r"--layout: invalid choice"),
    ],
)
def test_train_example_argument_errors(train_example, capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        train_example.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_train_example_loss_falls(train_example):
    """A short run on the default device: the training loss and the held-out loss fall."""
    example = train_example
    argv = ["--steps", "24", "--batch-tokens", "512", "--seq-len", "64", "--log-every", "6"]
    before, after, losses = example.main([*argv, "--sample", "8"])
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] and after < before - 0.5, (before, after, losses)
