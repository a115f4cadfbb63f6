"""Training helpers for the causal LM: the next-token cross-entropy of padded (``[B, S]`` with
lengths) or packed (``[T]`` with ``cu_seqlens``) batches, and the packing of token sequences
into fixed-shape batches (one compilation for every step).

The logits come from calling the model, :meth:`LlamaForCausalLM.__call__
<jax_flash.models.LlamaForCausalLM.__call__>`, with the same ``cu_seqlens`` / ``lengths``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..nn import packed_positions


def next_token_targets(tokens, *, cu_seqlens=None, lengths=None):
    """The token each row predicts, and whether it has one.

    Row ``t`` predicts ``tokens[t + 1]`` when that token belongs to the same sequence: the last
    token of a sequence, padding (past ``lengths[b]``, or past ``cu_seqlens[B]``) and the rows
    of empty sequences predict nothing.

    Parameters
    ----------
    tokens : int ``[B, S]`` (with ``lengths`` or full rows) or ``[T]`` (with ``cu_seqlens``).
    cu_seqlens : int32 ``[B + 1]`` or None.
    lengths : int32 ``[B]`` or None.

    Returns
    -------
    ``(targets int32 like tokens, mask bool like tokens)``.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if cu_seqlens is not None:
        if tokens.ndim != 1 or lengths is not None:
            raise ValueError(
                "next_token_targets: cu_seqlens takes packed tokens [T] (and no lengths), got "
                f"tokens {tuple(tokens.shape)}"
            )
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        T = tokens.shape[0]
        seq, _, valid = packed_positions(cu, T)
        t = jnp.arange(T, dtype=jnp.int32)
        mask = valid & (t + 1 < cu[seq + 1])
        targets = jnp.concatenate([tokens[1:], tokens[:1]])
        return targets, mask
    if tokens.ndim != 2:
        raise ValueError(
            "next_token_targets: tokens must be [B, S] (or packed [T] with cu_seqlens), got "
            f"shape {tuple(tokens.shape)}"
        )
    B, S = tokens.shape
    limit = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    if limit.shape != (B,):
        raise ValueError(
            f"next_token_targets: lengths must have shape [B] = ({B},), got {tuple(limit.shape)}"
        )
    mask = jnp.arange(S, dtype=jnp.int32)[None] + 1 < jnp.clip(limit, 0, S)[:, None]
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return targets, mask


def next_token_loss(logits, tokens, *, cu_seqlens=None, lengths=None):
    """Mean next-token cross-entropy (natural log) over the rows that predict a token.

    Parameters
    ----------
    logits : float ``[B, S, V]`` or ``[T, V]``, the model's on ``tokens`` (computed in float32).
    tokens, cu_seqlens, lengths : as :func:`next_token_targets`.

    Returns
    -------
    float32 scalar; 0 when no row predicts a token.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax_flash.models import LlamaConfig, LlamaForCausalLM, next_token_loss
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM.random(cfg)
    >>> tokens = jnp.arange(20, dtype=jnp.int32) % 64             # two packed sequences
    >>> cu = jnp.array([0, 12, 20], jnp.int32)
    >>> loss = next_token_loss(model(tokens, cu_seqlens=cu), tokens, cu_seqlens=cu)
    >>> loss.shape, bool(loss > 0)
    ((), True)
    """
    targets, mask = next_token_targets(tokens, cu_seqlens=cu_seqlens, lengths=lengths)
    logits = jnp.asarray(logits).astype(jnp.float32)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"next_token_loss: logits {tuple(logits.shape)} must be tokens' shape "
            f"{tuple(targets.shape)} + [V]"
        )
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(count, 1).astype(jnp.float32)


def pack_sequences(
    sequences: Iterable[Sequence[int]], num_tokens: int, max_sequences: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pack token sequences, in order, into batches of one shape.

    Each batch holds at most ``max_sequences`` sequences in ``num_tokens`` rows; a sequence
    longer than ``num_tokens`` is cut into pieces of at most ``num_tokens`` (each its own
    sequence, from position 0). Unused rows are padding (token 0, past ``cu[B]``) and unused
    sequences are empty (``cu`` repeats its last value), so every batch has the same shapes.

    Yields
    ------
    ``(tokens int32 [num_tokens], cu_seqlens int32 [max_sequences + 1])`` numpy arrays.

    >>> [(t.tolist(), cu.tolist()) for t, cu in pack_sequences([[1, 2, 3], [4, 5], [6]], 4, 2)]
    [([1, 2, 3, 0], [0, 3, 3]), ([4, 5, 6, 0], [0, 2, 3])]
    """
    if num_tokens < 1 or max_sequences < 1:
        raise ValueError(
            f"pack_sequences: num_tokens ({num_tokens}) and max_sequences ({max_sequences}) "
            "must be >= 1"
        )
    tokens: list[int] = []
    ends: list[int] = []

    def batch():
        out = np.zeros(num_tokens, np.int32)
        out[: len(tokens)] = tokens
        cu = np.full(max_sequences + 1, len(tokens), np.int32)
        cu[0] = 0
        cu[1 : len(ends) + 1] = ends
        return out, cu

    for sequence in sequences:
        sequence = list(sequence)
        for start in range(0, len(sequence), num_tokens):
            piece = sequence[start : start + num_tokens]
            if len(tokens) + len(piece) > num_tokens or len(ends) == max_sequences:
                yield batch()
                tokens, ends = [], []
            tokens.extend(piece)
            ends.append(len(tokens))
    if ends:
        yield batch()
