"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) on jax_flash attention, and a loader of
Hugging Face checkpoints.

The computation follows transformers' ``modeling_llama`` step by step so that a checkpoint gives
the same logits here: RMSNorm in float32, cast back to the input dtype, then times the weight;
rotate-half ("neox") RoPE with the frequencies transformers computes (Llama 3 scaling
included); ``softmax_scale = head_dim ** -0.5``; SwiGLU MLP ``down(silu(gate(x)) * up(x))``;
logits ``lm_head(norm(h))`` (tied: ``h @ embed_tokens.T``), returned in float32. In float32 the
logits equal transformers' to rounding; in bfloat16 they agree to bfloat16 rounding (RoPE here
rotates in float32 and rounds once, where transformers first rounds cos/sin to bfloat16).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn import (
    Attention,
    FusedLinear,
    KVCache,
    NoCache,
    PackedNoCache,
    TensorParallel,
    decode_batch,
    packed_positions,
    prefill_batch,
    project,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters, named as in a Hugging Face ``config.json``.

    ``rope_scaling`` is stored as a tuple of ``(key, value)`` items (hashable; a dict is
    accepted); ``sliding_window_layers`` says which layers use ``sliding_window`` (None: all).
    ``dtype`` is the compute and parameter dtype ("bfloat16", "float16" or "float32").
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[bool, ...] | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: str = "float32"

    def __post_init__(self):
        set_ = object.__setattr__
        if self.num_key_value_heads is None:
            set_(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, Mapping):
            set_(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.eos_token_id, list):
            set_(self, "eos_token_id", tuple(self.eos_token_id))
        if self.sliding_window_layers is not None:
            set_(self, "sliding_window_layers", tuple(bool(s) for s in self.sliding_window_layers))
            if len(self.sliding_window_layers) != self.num_hidden_layers:
                raise ValueError(
                    f"LlamaConfig: sliding_window_layers has {len(self.sliding_window_layers)} "
                    f"entries for {self.num_hidden_layers} layers"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads {self.num_attention_heads} must be a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )

    def layer_window(self, i: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or self.sliding_window_layers[i]:
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, config: Mapping) -> LlamaConfig:
        """The config of a Hugging Face ``config.json`` dict (model_type llama, mistral, qwen2).

        Llama: ``attention_bias`` gives q/k/v/o biases, ``mlp_bias`` the MLP's. Mistral: the
        ``sliding_window`` on every layer. Qwen2: q/k/v biases; with ``use_sliding_window`` the
        window on layers ``>= max_window_layers``. ``layer_types`` (newer configs) overrides
        which layers slide. RoPE from ``rope_theta``/``rope_scaling`` or ``rope_parameters``.
        """
        c = dict(config)
        kind = c.get("model_type", "llama")
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig.from_hf: model_type {kind!r} is not supported "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"LlamaConfig.from_hf: hidden_act {act!r} is not supported (silu)")
        rope = c.get("rope_parameters") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            kind_ = scaling.get("rope_type", scaling.get("type", "default"))
            if kind_ not in _ROPE_TYPES:
                raise ValueError(
                    f"LlamaConfig.from_hf: rope type {kind_!r} is not supported {_ROPE_TYPES}"
                )
            scaling = (
                None
                if kind_ == "default"
                else {k: v for k, v in scaling.items() if k != "rope_theta"}
            )
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("LlamaConfig.from_hf: partial_rotary_factor != 1 is not supported")
        layers = c["num_hidden_layers"]
        window, sliding_layers = None, None
        if kind == "mistral":
            window = c.get("sliding_window")
        elif kind == "qwen2" and c.get("use_sliding_window", False):
            window = c.get("sliding_window")
            start = c.get("max_window_layers", layers)
            sliding_layers = tuple(i >= start for i in range(layers))
        if window is not None and c.get("layer_types"):
            sliding_layers = tuple(t == "sliding_attention" for t in c["layer_types"])
        bias = bool(c.get("attention_bias", False))
        eos = c.get("eos_token_id")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c.get("num_key_value_heads"),
            head_dim=c.get("head_dim"),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=True if kind == "qwen2" else bias,
            o_proj_bias=bias if kind == "llama" else False,
            mlp_bias=bool(c.get("mlp_bias", False)) if kind == "llama" else False,
            sliding_window=window,
            sliding_window_layers=sliding_layers,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
        )


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalised in float32 and cast back to x's dtype
    before the weight (as transformers' ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = float(eps)

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one matmul: ``gate_up_proj``'s
    kernel is ``[hidden, 2, inner]`` (``[:, 0]`` gate, ``[:, 1]`` up; bias ``[2, inner]``)."""

    def __init__(self, hidden: int, inner: int, *, bias: bool, dtype, param_dtype, rngs):
        lin = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # gate and up stacked on an axis of their own before inner (not [gate | up] on one
        # axis): a tensor-parallel split of inner gives each device the same columns of both,
        # the pairs silu(gate) * up multiplies, as column-parallel gate/up projections did.
        self.gate_up_proj = FusedLinear(hidden, (2, inner), **lin)
        self.down_proj = nnx.Linear(inner, hidden, **lin)
        self.parallel: TensorParallel | None = None

    def __call__(self, x):
        gate_up = project(self.gate_up_proj, x)  # [..., 2, inner]
        h = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        if self.parallel is None:
            return project(self.down_proj, h)
        # Column-parallel gate/up, row-parallel down (summed in float32 over the devices: see
        # shard_model), back to the compute dtype.
        h = self.parallel.constrain(h, -1)
        return self.parallel.constrain(project(self.down_proj, h).astype(x.dtype))


class DecoderLayer(nnx.Module):
    def __init__(
        self, config: LlamaConfig, index: int, *, attention_impl, dtype, param_dtype, rngs
    ):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            qkv_bias=c.qkv_bias,
            o_bias=c.o_proj_bias,
            rope_theta=c.rope_theta,
            rope_scaling=None if c.rope_scaling is None else dict(c.rope_scaling),
            sliding_window=c.layer_window(index),
            attention_impl=attention_impl,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(
            c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype
        )
        self.mlp = MLP(
            c.hidden_size,
            c.intermediate_size,
            bias=c.mlp_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x, positions, kv, batch):
        h, kv = self.self_attn(self.input_layernorm(x), positions, kv, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaForCausalLM(nnx.Module):
    """Llama-family decoder with a paged KV cache (`prefill`, `decode`), and a cache-free
    forward for training (calling the model: tokens to logits, differentiable).

    Parameters
    ----------
    config : LlamaConfig
    attention_impl : None, "cpu", "cuda" or "xla"
        None runs jax_flash's kernels; "xla" runs the pure-XLA reference path of the same ops
        (RoPE, cache append, prefill and decode attention), for checking.
    dtype, param_dtype : default ``config.dtype``.
    rngs : nnx.Rngs for the random initialisation.

    Attribute names follow the Hugging Face checkpoint (``embed_tokens``, ``layers[i].self_attn
    .o_proj``, ..., ``norm``, ``lm_head``) except for the fused projections: ``self_attn
    .qkv_proj`` holds q/k/v_proj (`jax_flash.nn.Attention`), ``mlp.gate_up_proj`` gate/up_proj
    (`MLP`); :func:`hf_parameters` maps every Hugging Face tensor to its place.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    >>> [len(t) for t in out.tokens]
    [4, 4]
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        attention_impl: str | None = None,
        dtype=None,
        param_dtype=None,
        rngs: nnx.Rngs,
    ):
        c = config
        dtype = jnp.dtype(c.dtype if dtype is None else dtype)
        param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
        self.config = c
        self.attention_impl = attention_impl
        self.dtype = dtype
        # Set by shard_model: the layout, and whether embeddings and LM head split by vocab.
        self.parallel: TensorParallel | None = None
        self.vocab_parallel = False
        self.embed_tokens = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List(
            DecoderLayer(
                c, i, attention_impl=attention_impl, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nnx.Linear(
                c.hidden_size,
                c.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        *,
        seed: int = 0,
        attention_impl=None,
        dtype=None,
        param_dtype=None,
    ) -> LlamaForCausalLM:
        """A model with random weights drawn on the host with numpy: quick to build (no
        compilation of initialisers). Linear kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
        norm weights 1, biases 0."""
        model = nnx.eval_shape(
            lambda: cls(
                config,
                attention_impl=attention_impl,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=nnx.Rngs(0),
            )
        )
        rng = np.random.default_rng(seed)
        for path, var in nnx.iter_graph(model):
            if not isinstance(var, nnx.Param):
                continue
            if path[-1] == "kernel":
                value = rng.standard_normal(var.shape, np.float32) / np.sqrt(var.shape[0])
            elif path[-1] == "embedding":
                value = rng.standard_normal(var.shape, np.float32)
            else:
                value = np.full(var.shape, 1.0 if path[-1] == "weight" else 0.0, np.float32)
            var.set_value(jnp.asarray(value, var.dtype))
        return model

    def with_attention_impl(self, attention_impl: str | None) -> LlamaForCausalLM:
        """The same model (parameters shared, not copied) with attention through
        ``attention_impl`` (e.g. "xla", the reference path)."""
        graphdef, state = nnx.split(self)
        other = nnx.merge(graphdef, state)
        other.attention_impl = attention_impl
        for _, node in nnx.iter_graph(other):
            if isinstance(node, Attention):
                node.set_attention_impl(attention_impl)
        return other

    def attention_kernels(self, page_size: int = 16, platform: str | None = None) -> dict:
        """The kernels this model's attention runs on `platform` (None: JAX's default), by
        :func:`jax_flash.kernel_for` on its head dims, dtype and attention implementation:
        ``{"prefill": ..., "decode": ...}`` (e.g. "cuda:tensor_core", "cpu", "xla reference")."""
        from ..introspect import kernel_for
        from ..ops.flash_attention import flash_attention_varlen
        from ..ops.paged_attention import paged_attention

        c, dt, impl = self.config, self.dtype, self.attention_impl
        S = jax.ShapeDtypeStruct
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rows, kv, cu = S((8, hq, d), dt), S((8, hkv, d), dt), S((3,), jnp.int32)
        pages, i32 = S((4, page_size, hkv, d), dt), jnp.int32
        prefill = kernel_for(
            flash_attention_varlen, rows, kv, kv, cu, cu,
            causal=True, implementation=impl, platform=platform,
        )  # fmt: skip
        decode = kernel_for(
            paged_attention, S((2, hq, d), dt), pages, pages, S((2, 2), i32), S((2,), i32),
            implementation=impl, platform=platform,
        )  # fmt: skip
        return {"prefill": prefill, "decode": decode}

    def forward(self, tokens, positions, kv, batch):
        """Hidden states after the final norm, and the layers' updated caches.

        tokens/positions: ``[T]`` (packed, `jax_flash.nn.Prefill`), ``[B]`` or ``[B, S]``;
        kv: per-layer ``(k, v)`` caches; batch: `Prefill`, `Decode` or `Dense`.
        """
        x = self.embed_tokens(tokens)
        if self.parallel is not None:  # a vocab-parallel lookup is summed over the devices
            x = self.parallel.constrain(x)
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv, strict=True):
            x, layer_kv = layer(x, positions, layer_kv, batch)
            new_kv.append(layer_kv)
        return self.norm(x), tuple(new_kv)

    def logits(self, h):
        """float32 logits ``[..., vocab]`` of final hidden states."""
        out = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        out = out.astype(jnp.float32)
        if self.parallel is None:
            return out
        if self.vocab_parallel:  # each device its own columns (not the whole head gathered)
            out = self.parallel.constrain(out, -1)
        return self.parallel.constrain(out)  # sampling reads whole rows

    def init_cache(self, num_pages: int, page_size: int, block_tables) -> KVCache:
        """An empty paged cache for this model (block tables ``[B, max_pages]``); on the
        model's mesh, split by KV heads, when it is tensor-parallel (:func:`shard_model`)."""
        c = self.config
        return KVCache.create(
            c.num_hidden_layers,
            num_pages,
            page_size,
            c.num_key_value_heads,
            c.head_dim,
            block_tables,
            self.dtype,
            self.parallel,
        )

    def _with_layers(self, cache: KVCache, kv, kv_lens) -> KVCache:
        k, v = zip(*kv, strict=True)
        return cache.replace(k_pages=tuple(k), v_pages=tuple(v), kv_lens=kv_lens)

    def prefill(self, cache: KVCache, tokens, cu_seqlens, *, rows=None, all_logits=False):
        """Run packed prompts, each from position 0, writing them into the cache.

        Parameters
        ----------
        cache : KVCache whose rows ``rows`` are empty.
        tokens : int32 ``[T]``, prompt ``b`` at ``cu_seqlens[b]:cu_seqlens[b+1]``; rows past
            ``cu_seqlens[B]`` are padding (not written).
        cu_seqlens : int32 ``[B + 1]``.
        rows : int ``[B]``, the cache row of each prompt (default ``0..B-1``).
        all_logits : return the logits of every packed row ``[T, V]`` instead of each prompt's
            last ``[B, V]``.

        Returns
        -------
        ``(logits float32, cache)`` with ``cache.kv_lens[rows]`` = the prompt lengths.
        """
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        B, T = cu.shape[0] - 1, tokens.shape[0]
        rows = jnp.arange(B, dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
        positions, batch = prefill_batch(cache, cu, T, rows)
        h, kv = self.forward(tokens, positions, cache.layers(), batch)
        if not all_logits:
            h = h[jnp.clip(cu[1:] - 1, 0, T - 1)]
        kv_lens = cache.kv_lens.at[rows].set(cu[1:] - cu[:-1])
        return self.logits(h), self._with_layers(cache, kv, kv_lens)

    def decode(self, cache: KVCache, tokens, *, active=None, all_logits=False):
        """Append ``tokens`` (``[B]``, or ``[B, S]``) to every row of the cache and attend.

        Rows with ``active[b]`` False are neither written nor lengthened (their logits are
        meaningless). Returns ``(logits float32 [B, V] (the last token; [B, S, V] with
        all_logits), cache)``.
        """
        toks = tokens[:, None] if tokens.ndim == 1 else tokens
        positions, batch, kv_lens = decode_batch(cache, toks.shape[1], active)
        h, kv = self.forward(toks, positions, cache.layers(), batch)
        return self.logits(h if all_logits else h[:, -1]), self._with_layers(cache, kv, kv_lens)

    def __call__(self, tokens, *, cu_seqlens=None, lengths=None):
        """Logits of whole sequences with no cache (training, scoring); differentiable w.r.t.
        the parameters (`jax.grad` through jax_flash's attention and RoPE).

        Parameters
        ----------
        tokens : int32 ``[B, S]`` (rows of one length, attended with
            :func:`jax_flash.flash_attention`), or ``[T]`` packed sequences with ``cu_seqlens``
            (attended with :func:`jax_flash.flash_attention_varlen`).
        cu_seqlens : int32 ``[B + 1]`` with ``[T]`` tokens: sequence ``b`` owns rows
            ``cu[b]:cu[b+1]``, its positions restart from 0; rows past ``cu[B]`` are padding.
        lengths : int32 ``[B]`` with ``[B, S]`` tokens: valid tokens per row (right padding).
            Without it every row is full; padding at the end of a row does not change the
            causal rows before it either way, but ``lengths`` skips its attention.

        Returns
        -------
        float32 logits ``[B, S, V]`` (or ``[T, V]``); causal per sequence, every layer's
        sliding window applied. See :func:`jax_flash.models.next_token_loss`.
        """
        tokens = jnp.asarray(tokens)
        if cu_seqlens is not None:
            if tokens.ndim != 1 or lengths is not None:
                raise ValueError(
                    "LlamaForCausalLM: cu_seqlens takes packed tokens [T] (and no lengths), got "
                    f"tokens {tuple(tokens.shape)}"
                )
            cu = jnp.asarray(cu_seqlens, jnp.int32)
            if cu.ndim != 1 or cu.shape[0] < 2:
                raise ValueError(
                    f"LlamaForCausalLM: cu_seqlens must have shape [B + 1], got {tuple(cu.shape)}"
                )
            _, positions, valid = packed_positions(cu, tokens.shape[0])
            positions, batch = jnp.where(valid, positions, 0), PackedNoCache(cu)
        else:
            if tokens.ndim != 2:
                raise ValueError(
                    "LlamaForCausalLM: tokens must be [B, S] (or packed [T] with cu_seqlens), "
                    f"got shape {tuple(tokens.shape)}"
                )
            B, S = tokens.shape
            if lengths is not None:
                lengths = jnp.asarray(lengths, jnp.int32)
                if lengths.shape != (B,):
                    raise ValueError(
                        f"LlamaForCausalLM: lengths must have shape [B] = ({B},), got "
                        f"{tuple(lengths.shape)}"
                    )
            positions, batch = jnp.arange(S, dtype=jnp.int32), NoCache(lengths)
        h, _ = self.forward(tokens, positions, (None,) * len(self.layers), batch)
        return self.logits(h)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where a Hugging Face tensor lives in the model: in ``variable[index]`` (a part of a
    fused projection, or the whole variable with ``index=()``), reshaped to ``shape`` and, for a
    ``Linear.weight`` (``[out, in]`` in the checkpoint, ``[in, ...]`` here), transposed."""

    variable: nnx.Variable
    shape: tuple[int, ...]  # the Hugging Face tensor's
    index: tuple = ()
    transpose: bool = False

    def read(self) -> np.ndarray:
        """The tensor in Hugging Face layout, of the variable's dtype."""
        part = np.asarray(self.variable[...])[self.index]
        if self.transpose:
            return part.reshape(self.shape[::-1]).T
        return part.reshape(self.shape)

    def write(self, buffer: np.ndarray, array) -> None:
        """Store the Hugging Face ``array`` into ``buffer``, a host array of the variable's
        shape and dtype."""
        array = np.asarray(array)
        if self.transpose:
            array = array.T
        view = buffer[self.index]
        view[...] = array.reshape(view.shape).astype(buffer.dtype)


def hf_parameters(model: LlamaForCausalLM) -> dict[str, HFTensor]:
    """Hugging Face tensor name -> its `HFTensor`, the place of the tensor in ``model``.

    ``q_proj``/``k_proj``/``v_proj`` are parts of a layer's fused ``qkv_proj`` (kernel
    ``[hidden, Hkv, G + 2, D]``: the query heads of each KV head, its k, its v), ``gate_proj``
    and ``up_proj`` parts of ``gate_up_proj`` (kernel ``[hidden, 2, inner]``).

    >>> from jax_flash.models import LlamaConfig, LlamaForCausalLM, hf_parameters
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> params = hf_parameters(LlamaForCausalLM.random(cfg))
    >>> params["model.layers.0.self_attn.k_proj.weight"].read().shape
    (16, 32)
    """
    whole = slice(None)
    out = {
        "model.embed_tokens.weight": _whole(model.embed_tokens.embedding),
        "model.norm.weight": _whole(model.norm.weight),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = _whole(model.lm_head.kernel, transpose=True)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        group = attn.num_heads // attn.num_kv_heads
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden, inner = attn.qkv_proj.kernel.shape[0], mlp.gate_up_proj.out_shape[1]
        # name: (fused projection, the part's index into its output axes, HF output size)
        parts = {
            "self_attn.q_proj": (attn.qkv_proj, (whole, slice(0, group)), q_size),
            "self_attn.k_proj": (attn.qkv_proj, (whole, group), kv_size),
            "self_attn.v_proj": (attn.qkv_proj, (whole, group + 1), kv_size),
            "mlp.gate_proj": (mlp.gate_up_proj, (0,), inner),
            "mlp.up_proj": (mlp.gate_up_proj, (1,), inner),
        }
        for name, (fused, index, size) in parts.items():
            out[p + name + ".weight"] = HFTensor(
                fused.kernel, (size, hidden), (whole, *index), transpose=True
            )
            if fused.bias is not None:
                out[p + name + ".bias"] = HFTensor(fused.bias, (size,), index)
        for name, lin in (("self_attn.o_proj", attn.o_proj), ("mlp.down_proj", mlp.down_proj)):
            out[p + name + ".weight"] = _whole(lin.kernel, transpose=True)
            if lin.bias is not None:
                out[p + name + ".bias"] = _whole(lin.bias)
        out[p + "input_layernorm.weight"] = _whole(layer.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = _whole(layer.post_attention_layernorm.weight)
    return out


def _whole(variable, transpose=False) -> HFTensor:
    shape = tuple(variable.shape)
    return HFTensor(variable, shape[::-1] if transpose else shape, (), transpose)


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face names and layouts (``Linear.weight``
    ``[out, in]``, q/k/v and gate/up as separate tensors), as host arrays of the parameter
    dtype: what ``safetensors.numpy.save_file`` writes and :func:`load_hf_checkpoint` reads."""
    return {name: np.ascontiguousarray(t.read()) for name, t in hf_parameters(model).items()}


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"load_hf_checkpoint: no *.safetensors in {path}")
    return files


def load_hf_checkpoint(path: str, *, dtype=None, attention_impl: str | None = None):
    """Load a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, sharded
    through ``model.safetensors.index.json`` or not).

    Parameters
    ----------
    path : the directory.
    dtype : compute/parameter dtype (default the checkpoint's ``torch_dtype``).
    attention_impl : as :class:`LlamaForCausalLM`.

    Returns
    -------
    ``(model, config)``. Every parameter must be present with its expected shape; tensors the
    model does not use raise (an unsupported architecture), except RoPE buffers and a tied
    ``lm_head.weight``.
    """
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        config = LlamaConfig.from_hf(json.load(f))
    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(
            config, attention_impl=attention_impl, dtype=dtype, rngs=nnx.Rngs(0)
        )
    )
    params = hf_parameters(model)
    # A fused variable is assembled on the host from its tensors (q, k and v; gate and up) and
    # placed once the last of them is read: [host buffer, tensors still to come] per variable.
    pending = {}
    for t in params.values():
        pending.setdefault(id(t.variable), [None, 0])[1] += 1
    unexpected = []
    for file in _safetensors_files(path):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                if name not in params:
                    if not (name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                target = params.pop(name)
                array = f.get_tensor(name)
                if tuple(array.shape) != target.shape:
                    raise ValueError(
                        f"load_hf_checkpoint: {name} has shape {tuple(np.shape(array))} in "
                        f"{file}, expected {target.shape}"
                    )
                var = target.variable
                entry = pending[id(var)]
                if entry[0] is None:
                    entry[0] = np.empty(var.shape, var.dtype)
                target.write(entry[0], array)
                entry[1] -= 1
                if entry[1] == 0:
                    var.set_value(jnp.asarray(entry[0]))
                    entry[0] = None
    if params or unexpected:
        raise ValueError(
            f"load_hf_checkpoint: {path}: missing tensors {sorted(params)[:8]}"
            f"{' ...' if len(params) > 8 else ''}; unexpected tensors {unexpected[:8]}"
        )
    return model, config


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json``, or None when there is none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)
