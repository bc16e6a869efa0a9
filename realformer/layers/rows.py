"""Per-example row selection, for the MLM positions and the last layer's query rows.

    take_rows(hidden, positions)            [B, T, D], [B, S]     -> [B, S, D]
    gather_rows(scores, rows, axis=2)       [B, H, T, K], [B, S]  -> [B, H, S, K]
    gather_rows(table, rows, axis=1, batched=False)
                                            [H, T, K] (no batch)  -> [B, H, S, K]

`take_rows` is a one-hot contraction rather than take_along_axis: the same values (each output
is one input times 1 plus zeros, summed at HIGHEST precision, so float32 and bfloat16 come out
exact), B*S*T*D multiply-adds, small next to a layer, and no gather for XLA's SPMD
partitioner, which partitioned take_along_axis's backward pass wrongly on data x fsdp x tensor
meshes with two rows per batch shard when a matmul with a sharded table followed (the MLM
head: tests/test_train.py::test_gradients_on_three_axis_meshes_...). A position outside
[0, T) gives a zero row.

`gather_rows` is an XLA gather, for the [.., T, T] attention tensors (RealFormer's carried
scores, the random synthesizers' tables), where a one-hot contraction would cost B*S*H*T^2
float32 multiply-adds, at HIGHEST precision, in the forward and again in the backward pass.
Positions at or beyond T give row T - 1 (never NaN, which take's default fill would give).

`last_layer_rows` decides which rows the last layer of the pretraining loss computes.
"""

import string
from typing import Optional

import jax
import jax.numpy as jnp

# The last layer's row count is rounded up to this: whole tiles for the accelerators' matrix
# units, and an even query length, which cuDNN's fused attention needs in training.
ROW_MULTIPLE = 8


def take_rows(x: jax.Array, rows: jax.Array, axis: int = 1) -> jax.Array:
  """out[b, ..., s, ...] = x[b, ..., rows[b, s], ...] for x with a leading batch axis."""
  onehot = jax.nn.one_hot(rows, x.shape[axis], dtype=x.dtype)  # [B, S, T]
  dims = [c for c in string.ascii_lowercase if c not in 'bst'][:x.ndim]
  dims[0], dims[axis] = 'b', 't'
  out = ''.join('s' if d == 't' else d for d in dims)
  return jnp.einsum(f'bst,{"".join(dims)}->{out}', onehot, x,
                    precision=jax.lax.Precision.HIGHEST)


def gather_rows(x: jax.Array, rows: jax.Array, axis: int, *, batched: bool = True) -> jax.Array:
  """take_rows by an XLA gather. batched=False: x has no batch axis (a parameter shared by
  every example) and the result gets one in front: out[b, ..., s, ...] = x[..., rows[b, s], ...]."""
  if not batched:
    return jnp.moveaxis(jnp.take(x, rows, axis=axis, mode='clip'), axis, 0)
  index = rows.reshape(rows.shape[:1] + (1,) * (axis - 1) + rows.shape[1:]
                       + (1,) * (x.ndim - axis - 1))
  return jnp.take_along_axis(x, index, axis=axis, mode='clip')


def num_last_layer_rows(num_predictions: int, seq_len: int) -> int:
  """Rows the pruned last layer computes: [CLS] and the predictions, rounded up to
  ROW_MULTIPLE; seq_len (no pruning) when that is not fewer."""
  rows = -(-(num_predictions + 1) // ROW_MULTIPLE) * ROW_MULTIPLE
  return rows if rows < seq_len else seq_len


def last_layer_rows(positions: jax.Array, seq_len: int) -> Optional[jax.Array]:
  """[B, P] masked positions -> [B, R] rows for the last layer: [CLS] (row 0, the pooler's),
  the positions, then [CLS] again as filler; None when every row is cheaper."""
  b, p = positions.shape
  r = num_last_layer_rows(p, seq_len)
  if r == seq_len:
    return None
  cls = jnp.zeros((b, 1), positions.dtype)
  filler = jnp.zeros((b, r - p - 1), positions.dtype)
  return jnp.concatenate([cls, positions, filler], axis=1)


def positions_of_last_layer(x: jax.Array, num_predictions: int) -> jax.Array:
  """The rows of a last layer computed on last_layer_rows' rows ([B, R, ...]) that hold its
  positions, in their order: [B, num_predictions, ...] (the layout is last_layer_rows')."""
  return x[:, 1:1 + num_predictions]
