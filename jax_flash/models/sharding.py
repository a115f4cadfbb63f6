"""`shard_model`: a Llama-family decoder placed tensor-parallel on a mesh.

The layout is Megatron's: the fused q/k/v and MLP gate/up projections split by output columns
(the q/k/v kernel ``[hidden, Hkv, G + 2, D]`` on its KV-head axis: device ``i`` holds KV heads
``i*Hkv/n : (i+1)*Hkv/n`` with the query heads that read them; the gate/up kernel ``[hidden, 2,
inner]`` on inner), o_proj and MLP down_proj split by input rows (their outputs summed over
the devices), embeddings and LM head split by vocabulary when ``n`` divides it (else
replicated), norms replicated; the paged KV cache is split by KV heads. A decode step then needs
one all-reduce after o_proj and one after down_proj per layer, one after the embedding lookup
and one all-gather of the logits.

The weights are placed with ``jax.device_put`` and the layers keep a `jax_flash.nn
.TensorParallel` (static) that pins activations and cache pages inside ``jit`` with
``with_sharding_constraint``; `generate` runs unchanged on the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn import Attention, TensorParallel
from .llama import MLP, LlamaForCausalLM

# The fused projections split by output columns: the axis of kernel and bias split (the
# q/k/v kernel [in, Hkv, G + 2, D] and bias [Hkv, G + 2, D] on Hkv, the gate/up kernel
# [in, 2, inner] and bias [2, inner] on inner). The Linear layers split by input rows.
_COLUMN = {"qkv_proj": -3, "gate_up_proj": -1}
_ROW = frozenset({"o_proj", "down_proj"})


def _split_axis(path: tuple, vocab_split: bool) -> int | None:
    """The axis of the parameter at ``path`` split over the tensor axis (None: replicated)."""
    owner, name = path[-2], path[-1]
    if owner in _COLUMN:
        return _COLUMN[owner]
    if owner in _ROW:  # kernel [in, out]; the bias is added once, after the sum
        return 0 if name == "kernel" else None
    if vocab_split and owner == "embed_tokens":  # [vocab, hidden]
        return 0
    if vocab_split and owner == "lm_head":  # [hidden, vocab]
        return -1
    return None


def shard_model(
    model: LlamaForCausalLM, mesh: jax.sharding.Mesh, *, axis: str = "tensor"
) -> LlamaForCausalLM:
    """The model tensor-parallel over mesh axis ``axis``: a new model (the given one is left
    as it was) whose weights lie split on ``mesh`` and whose `init_cache` builds the paged
    cache split by KV heads there, so that :func:`jax_flash.models.generate` runs it unchanged.

    Parameters
    ----------
    model : LlamaForCausalLM
    mesh : a ``jax.sharding.Mesh`` with an axis ``axis``; its other axes must have size 1.
    axis : the mesh axis to split heads and MLP columns over.

    The row-parallel projections (o_proj, down_proj) sum their per-device partial products in
    float32 and round once to the compute dtype, as one device's matmul does (not once per
    device and again after the sum). Results still differ from one device's where the float32
    sums, taken in another order, round to another last bit; in float32 greedy tokens agree,
    in bfloat16 a last-bit difference grows through the layers and a close greedy choice can
    flip (as between bfloat16 and float32 on one device).

    Raises
    ------
    ValueError
        When the axis size does not divide ``num_key_value_heads`` or ``intermediate_size``.

    Examples
    --------
    >>> import jax
    >>> from jax_flash.models import LlamaConfig, LlamaForCausalLM, generate, shard_model
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> mesh = jax.make_mesh((1,), ("tensor",))
    >>> model = shard_model(LlamaForCausalLM.random(cfg), mesh)
    >>> [len(t) for t in generate(model, [[1, 2, 3]], max_new_tokens=4).tokens]
    [4]
    """
    parallel = TensorParallel(mesh, axis)
    c = model.config
    parallel.check_divides("num_key_value_heads", c.num_key_value_heads)
    parallel.check_divides("intermediate_size", c.intermediate_size)
    vocab_split = c.vocab_size % parallel.size == 0
    graphdef, state = nnx.split(model)
    # New Variables (a bare merge would share the given model's, and place them too).
    sharded = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for path, node in nnx.iter_graph(sharded):
        if isinstance(node, nnx.Param):
            value = node[...]
            split = _split_axis(path, vocab_split)
            node.set_value(jax.device_put(value, parallel.sharding(value.ndim, split)))
        elif isinstance(node, Attention):
            node.set_parallel(parallel)
        elif isinstance(node, MLP):
            node.parallel = parallel
        elif isinstance(node, nnx.Linear) and path[-1] in _ROW:
            node.preferred_element_type = jnp.float32
    sharded.parallel, sharded.vocab_parallel = parallel, vocab_split
    return sharded
