"""The Llama-family decoder on jax_flash kernels: against its pure-XLA path, incremental decode
against a full forward pass, batching, generation (greedy, sampling, beam search), the Hugging
Face checkpoint loader against a numpy transcription of transformers' Llama, and the fused q/k/v
and gate/up projections against that transcription's separate ones (prefill, decode, training).

Tiny float32 models on the CPU kernels.
"""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jax_flash.models import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    generate,
    hf_state_dict,
    load_hf_checkpoint,
)
from jax_flash.nn import KVCache, PageAllocator, block_table  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# GQA 6:2, head dim 64 (float32 models: the CUDA kernels of prefill and paged decode take it),
# Llama 3 RoPE scaling (active: the original context is 16 tokens).
LLAMA = LlamaConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=LLAMA3_SCALING,
)
# Qwen2 / Mistral switches: q/k/v biases, tied embeddings, a 5-token sliding window on layer 1.
QWEN = LlamaConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
    qkv_bias=True,
    tie_word_embeddings=True,
    sliding_window=5,
    sliding_window_layers=(False, True),
)
PAGE = 4
NUM_PAGES = 64
# float32 logits against float64 separate projections: a few float32 roundings (eps 1.2e-7;
# 5e-7 seen).
FUSED_TOL = 2e-6


def _randomize_vectors(model, seed):
    """nnx initialises biases and norm weights to constants; random values test their use."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] in ("bias", "weight"):
            var.set_value(jnp.asarray(1.0 + 0.2 * rng.standard_normal(var.shape), var.dtype))


@functools.cache
def _model(config, impl=None):
    if impl is not None:
        return _model(config).with_attention_impl(impl)  # the same weights
    model = LlamaForCausalLM.random(config, seed=0)
    _randomize_vectors(model, 1)
    return model


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, cache, tokens, cu):
    return nnx.merge(graphdef, state).prefill(cache, tokens, cu, all_logits=True)


@functools.partial(jax.jit, static_argnums=(0,))
def _decode(graphdef, state, cache, tokens):
    return nnx.merge(graphdef, state).decode(cache, tokens, all_logits=True)


def _cache(model, capacities, seed=0):
    """A cache whose rows own shuffled, non-contiguous pages."""
    need = [math.ceil(c / PAGE) for c in capacities]
    pool = PageAllocator(NUM_PAGES)  # one cache shape for every test: fewer compilations
    perm = np.random.default_rng(seed).permutation(pool.allocate(pool.num_free))[: sum(need)]
    rows = np.split(perm, np.cumsum(need)[:-1])
    return model.init_cache(NUM_PAGES, PAGE, block_table([r.tolist() for r in rows], 8))


def _prompts(lens, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def _run(model, prompts, steps):
    """Packed prefill of ``prompts`` (all logits), then ``steps`` decode steps of the given tokens
    ``[steps, B]``; returns (prefill logits [T, V], [decode logits [B, V] per step])."""
    graphdef, state = nnx.split(model)
    lens = [len(p) for p in prompts]
    cache = _cache(model, [n + len(steps) for n in lens])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T = int(cu[-1])
    tokens = np.zeros(-(-T // 32) * 32, np.int32)  # padding rows: fewer distinct shapes
    tokens[:T] = np.concatenate(prompts)
    logits, cache = _prefill(graphdef, state, cache, jnp.asarray(tokens), cu)
    logits = logits[:T]
    out = []
    for tok in steps:
        step_logits, cache = _decode(graphdef, state, cache, jnp.asarray(tok, jnp.int32))
        out.append(step_logits[:, -1])
    return np.asarray(logits), [np.asarray(x) for x in out]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama", "qwen"])
def test_kernels_match_xla(config):
    # The native kernels run (no silent jnp fallback): on CPU the CPU kernels, on a GPU the CUDA
    # kernels.
    kernels = _model(config).attention_kernels()
    print(f"attention kernels: {kernels}")
    native = "cpu" if jax.default_backend() == "cpu" else "cuda:"
    assert all(k.startswith(native) for k in kernels.values()), kernels
    prompts = _prompts([7, 1, 13, 4], config.vocab_size, 0)
    steps = np.random.default_rng(1).integers(0, config.vocab_size, (3, 4))
    logits, decoded = _run(_model(config), prompts, steps)
    ref_logits, ref_decoded = _run(_model(config, "xla"), prompts, steps)
    assert np.all(np.isfinite(logits))
    assert _rel(logits, ref_logits) < 1e-5
    for got, ref in zip(decoded, ref_decoded, strict=True):
        assert _rel(got, ref) < 1e-5


def test_incremental_decode_equals_full_forward():
    config = LLAMA
    model = _model(config)
    seq = _prompts([18], config.vocab_size, 2)[0]
    full, _ = _run(model, [seq], [])
    prompt_len = 11  # then 7 single-token decode steps
    _, decoded = _run(model, [seq[:prompt_len]], [[t] for t in seq[prompt_len:]])
    for i, got in enumerate(decoded):
        assert _rel(got[0], full[prompt_len + i]) < 1e-5, i
    # A multi-token step ([B, S] queries, causal against the cache) gives the same rows.
    graphdef, state = nnx.split(model)
    cache = _cache(model, [len(seq)])
    tokens = jnp.asarray(seq[:prompt_len], jnp.int32)
    _, cache = _prefill(graphdef, state, cache, tokens, jnp.asarray([0, prompt_len], jnp.int32))
    chunk = jnp.asarray([seq[prompt_len : prompt_len + 3]], jnp.int32)
    logits, cache = _decode(graphdef, state, cache, chunk)
    assert _rel(logits[0], full[prompt_len : prompt_len + 3]) < 1e-5
    assert cache.kv_lens.tolist() == [prompt_len + 3]


def test_batched_prompts_equal_single():
    model = _model(LLAMA)
    prompts = _prompts([9, 1, 17, 4], LLAMA.vocab_size, 3)
    steps = np.random.default_rng(4).integers(0, LLAMA.vocab_size, (2, 4))
    logits, decoded = _run(model, prompts, steps)
    starts = np.cumsum([0] + [len(p) for p in prompts])
    for b, (p, s) in enumerate(zip(prompts, starts, strict=False)):
        alone, alone_decoded = _run(model, [p], steps[:, b : b + 1])
        assert _rel(logits[s : s + len(p)], alone) < 1e-5
        for got, ref in zip(decoded, alone_decoded, strict=True):
            assert _rel(got[b], ref[0]) < 1e-5
    # generate's rows: see test_generate_greedy (each equals its own full forward pass).


def test_generate_one_prompt_beside_an_inactive_row():
    """One prompt decodes beside an inactive one-token row (nn.MIN_DECODE_ROWS): the output
    and counts are the prompt's alone, and its tokens are those it gets in a larger batch."""
    model = _model(LLAMA)
    p, q = _prompts([11, 6], LLAMA.vocab_size, 8)
    alone = generate(model, [p], 7)
    assert len(alone.tokens) == 1 and len(alone.tokens[0]) == 7
    assert alone.num_prompt_tokens == len(p) and alone.num_decode_tokens == 6
    assert alone.tokens[0] == generate(model, [p, q, q], 7).tokens[0]


def test_generate_greedy_deterministic_and_stops():
    model = _model(LLAMA)
    prompts = _prompts([5, 12, 2, 9], LLAMA.vocab_size, 4)
    a = generate(model, prompts, 8, page_size=PAGE)
    progress = []
    b = generate(
        model,
        prompts,
        8,
        page_size=PAGE,
        steps_per_call=3,
        progress=lambda step, total: progress.append((step, total)),
    )
    assert a.tokens == b.tokens and all(len(t) == 8 for t in a.tokens)
    assert progress == [(4, 8), (7, 8), (8, 8)]
    # Each row's greedy tokens are the argmax of the full forward pass over its prompt and
    # generated tokens, alone: the batched, paged generation equals running each prompt alone.
    for p, toks in zip(prompts, a.tokens, strict=True):
        full, _ = _run(model, [p + toks[:-1]], [])
        assert np.argmax(full[len(p) - 1 :], axis=-1).tolist() == toks
    # Per-sequence stop: on EOS (kept as the last token) and at a per-prompt limit.
    eos = a.tokens[0][3]
    limits = [8, 2, 8, 8]
    c = generate(model, prompts, limits, eos_token_id=[eos, 500], page_size=PAGE)
    for toks, ref, limit in zip(c.tokens, a.tokens, limits, strict=True):
        stop = ref.index(eos) + 1 if eos in ref[:limit] else limit
        assert toks == ref[:stop]
    assert c.num_prompt_tokens == 28 and c.prefill_s > 0 and c.compile_s == 0


def test_generate_sampling_reproducible():
    model = _model(LLAMA)
    prompts = _prompts([5, 12, 2, 9], LLAMA.vocab_size, 5)
    kw = dict(greedy=False, temperature=1.5, top_k=40, top_p=0.95, page_size=PAGE)
    a = generate(model, prompts, 8, seed=7, **kw)
    assert a.tokens == generate(model, prompts, 8, seed=7, **kw).tokens
    assert a.tokens != generate(model, prompts, 8, seed=8, **kw).tokens


def _sequence_logprob(model, prompt, toks):
    full, _ = _run(model, [prompt + toks], [])
    logp = jax.nn.log_softmax(jnp.asarray(full, jnp.float32), axis=-1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(toks)))


def test_beam_search():
    model = _model(LLAMA)
    prompts = _prompts([6, 3, 8, 1], LLAMA.vocab_size, 6)  # 6: a page and a half (copied)
    greedy = generate(model, prompts, 7, page_size=PAGE)
    eos = greedy.tokens[1][4]
    one = generate(model, prompts, 7, num_beams=1, page_size=PAGE, eos_token_id=eos)
    assert one.tokens == generate(model, prompts, 7, page_size=PAGE, eos_token_id=eos).tokens

    assert one.beams == [[t] for t in one.tokens]

    lp, eos = 0.8, greedy.tokens[0][2]
    out = generate(
        model, prompts, 7, num_beams=3, length_penalty=lp, eos_token_id=eos, page_size=PAGE
    )
    for p, beams, scores in zip(prompts, out.beams, out.scores, strict=True):
        assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3
        assert scores == sorted(scores, reverse=True)
        for toks, score in zip(beams, scores, strict=True):
            # The score is the log-probability of the full forward pass: the beams' cache rows
            # were reordered correctly.
            expected = _sequence_logprob(model, p, toks) / len(toks) ** lp
            assert abs(score - expected) < 1e-4 * max(1.0, abs(expected)), (toks, score)
    assert out.tokens == [b[0] for b in out.beams]
    assert any(b[-1] == eos and len(b) < 7 for beams in out.beams for b in beams)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def _hf_forward(sd, cfg, ids):
    """transformers' LlamaForCausalLM forward for one sequence, transcribed to numpy (float64):
    RMSNorm, rotate_half RoPE with the rope_scaling inv_freq, repeat_kv GQA, causal softmax
    (sliding window: keys i - window < j <= i), SwiGLU, tied or separate lm_head."""
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    S = len(ids)

    def norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg["rms_norm_eps"]))

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, D, 2) / D)
    rs = cfg.get("rope_scaling")
    if rs:  # _compute_llama3_parameters
        old = rs["original_max_position_embeddings"]
        low_wl, high_wl = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
        wl = 2 * math.pi / inv_freq
        scaled = np.where(wl > low_wl, inv_freq / rs["factor"], inv_freq)
        smooth = (old / wl - rs["low_freq_factor"]) / (
            rs["high_freq_factor"] - rs["low_freq_factor"]
        )
        smoothed = (1 - smooth) * scaled / rs["factor"] + smooth * scaled
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        inv_freq = np.where(medium, smoothed, scaled)
    emb = np.concatenate([np.outer(np.arange(S), inv_freq)] * 2, axis=-1)  # [S, D]
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]

    def rotate_half(x):
        return np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], axis=-1)

    def linear(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    x = sd["model.embed_tokens.weight"][ids]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").reshape(S, H, D)
        k = linear(h, p + "self_attn.k_proj").reshape(S, Hkv, D)
        v = linear(h, p + "self_attn.v_proj").reshape(S, Hkv, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * D**-0.5
        visible = j <= i
        if cfg.get("layer_types") and cfg["layer_types"][n] == "sliding_attention":
            visible &= j > i - cfg["sliding_window"]
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).reshape(S, H * D)
        x = x + linear(o, p + "self_attn.o_proj")
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        g = linear(h, p + "mlp.gate_proj")
        x = x + linear(g / (1 + np.exp(-g)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = norm(x, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ head.T


def _hf_config(config, model_type):
    c = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else dict(config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        c.update(use_sliding_window=True, sliding_window=config.sliding_window, max_window_layers=1)
        c["layer_types"] = ["full_attention", "sliding_attention"]
    return c


@pytest.mark.parametrize(
    "config,model_type,shards", [(LLAMA, "llama", 3), (QWEN, "qwen2", 1)], ids=["llama", "qwen2"]
)
def test_load_hf_checkpoint(tmp_path, config, model_type, shards):
    source = _model(config)
    sd = hf_state_dict(source)  # q/k/v and gate/up as separate tensors, HF layouts
    hf_cfg = _hf_config(config, model_type)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    names = sorted(sd)
    if shards == 1:
        safetensors_numpy.save_file(sd, str(tmp_path / "model.safetensors"))
    else:
        weight_map = {}
        for s, part in enumerate(np.array_split(np.array(names), shards)):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            safetensors_numpy.save_file({n: sd[n] for n in part}, str(tmp_path / file))
            weight_map.update(dict.fromkeys(part.tolist(), file))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    model, loaded_cfg = load_hf_checkpoint(str(tmp_path))
    assert loaded_cfg == config
    # Every parameter lands where it was (the fused ones assembled from their parts).
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(source, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(got[...], want[...], err_msg=str(path))
    ids = _prompts([21], config.vocab_size, 7)[0]
    logits, _ = _run(model, [ids], [])
    expected, _ = _run(source, [ids], [])
    np.testing.assert_array_equal(logits, expected)
    hf = _hf_forward({k: v.astype(np.float64) for k, v in sd.items()}, hf_cfg, ids)
    assert _rel(logits, hf) < 1e-5

    # A missing tensor is named.
    fewer = {**hf_cfg, "num_hidden_layers": 3, "layer_types": None}
    (tmp_path / "config.json").write_text(json.dumps(fewer))
    with pytest.raises(ValueError, match="model.layers.2"):
        load_hf_checkpoint(str(tmp_path))


# Every bias on (q/k/v, o, gate/up/down), one KV head for three query heads; LLAMA: two KV
# heads of three query heads each, no bias.
QWEN_BIASED = dataclasses.replace(QWEN, o_proj_bias=True, mlp_bias=True)


@pytest.mark.parametrize(
    "config,model_type",
    [(LLAMA, "llama"), (QWEN_BIASED, "qwen2")],
    ids=["llama", "qwen2-biased"],
)
def test_fused_projections_equal_separate(config, model_type):
    """The fused q/k/v (``[hidden, Hkv, G + 2, D]``) and gate/up (``[hidden, 2, inner]``)
    projections give the logits of separate q, k, v, gate and up matmuls over the same weights
    (transformers' computation on the Hugging Face tensors, in float64): packed prefill, decode
    steps and the training forward (``[B, S]`` rows with lengths, and packed sequences)."""
    model = _model(config)
    sd = {k: v.astype(np.float64) for k, v in hf_state_dict(model).items()}
    hf_cfg = _hf_config(config, model_type)
    prompts = _prompts([7, 1, 12], config.vocab_size, 11)
    steps = np.random.default_rng(12).integers(0, config.vocab_size, (3, 3))
    seqs = [p + steps[:, b].tolist() for b, p in enumerate(prompts)]
    separate = [_hf_forward(sd, hf_cfg, s) for s in seqs]  # [len, V] each

    logits, decoded = _run(model, prompts, steps)
    prefill = np.concatenate([f[: len(p)] for f, p in zip(separate, prompts, strict=True)])
    assert _rel(logits, prefill) < FUSED_TOL
    for i, got in enumerate(decoded):
        for b, p in enumerate(prompts):
            assert _rel(got[b], separate[b][len(p) + i]) < FUSED_TOL, (i, b)

    lens = [len(s) for s in seqs]
    rows = np.zeros((len(seqs), max(lens) + 2), np.int32)  # right padding
    for b, s in enumerate(seqs):
        rows[b, : len(s)] = s
    got = np.asarray(model(jnp.asarray(rows), lengths=jnp.asarray(lens, jnp.int32)))
    for b, n in enumerate(lens):
        assert _rel(got[b, :n], separate[b]) < FUSED_TOL, b
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    packed = np.zeros(cu[-1] + 3, np.int32)  # 3 padding rows
    packed[: cu[-1]] = np.concatenate(seqs)
    got = np.asarray(model(jnp.asarray(packed), cu_seqlens=jnp.asarray(cu)))
    assert _rel(got[: cu[-1]], np.concatenate(separate)) < FUSED_TOL


def test_config_from_hf():
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
    )
    mistral = LlamaConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and mistral.layer_window(3) == 4096
    assert not mistral.qkv_bias and mistral.num_key_value_heads == 2 and mistral.head_dim == 4
    qwen = LlamaConfig.from_hf(
        {**base, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}
    )
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.layer_window(3) is None
    llama = LlamaConfig.from_hf(
        {**base, "model_type": "llama", "attention_bias": True, "rope_scaling": LLAMA3_SCALING}
    )
    assert llama.qkv_bias and llama.o_proj_bias and dict(llama.rope_scaling) == LLAMA3_SCALING
    v5 = LlamaConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert v5.rope_theta == 1e6 and v5.rope_scaling is None
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="gemma"):
        LlamaConfig.from_hf({**base, "model_type": "gemma"})


def test_cache_is_a_donatable_pytree():
    model = _model(LLAMA)
    cache = _cache(model, [8, 8])
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * LLAMA.num_hidden_layers + 2
    step = jax.jit(lambda c: c.replace(kv_lens=c.kv_lens + 1), donate_argnums=0)
    new = step(cache)
    assert isinstance(new, KVCache) and new.kv_lens.tolist() == [1, 1]
    assert cache.kv_lens.is_deleted()
