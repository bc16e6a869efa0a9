"""Per-example row selection, for the MLM positions and the last layer's query rows.

    take_rows(hidden, positions)            [B, T, D], [B, S]     -> [B, S, D]
    take_rows(scores, rows, axis=2)         [B, H, T, K], [B, S]  -> [B, H, S, K]
    take_rows(table, rows, axis=1)          [H, T, K] (no batch)  -> [B, H, S, K]

A one-hot contraction rather than take_along_axis: the same values (each output is one input
times 1 plus zeros, summed at HIGHEST precision, so float32 and bfloat16 come out exact), a
cost of B*S*T per selected column that is small next to the work it saves, and no gather for
XLA's SPMD partitioner, which partitioned take_along_axis's backward pass wrongly on
data x fsdp x tensor meshes with two rows per batch shard
(tests/test_train.py::test_gradients_on_three_axis_meshes_...). The one caveat of a
contraction: a non-finite value anywhere in a row's column spreads to every selected row.
"""

import string

import jax
import jax.numpy as jnp


def take_rows(x: jax.Array, rows: jax.Array, axis: int = 1, *,
              batched: bool = True) -> jax.Array:
  """out[b, ..., s, ...] = x[b, ..., rows[b, s], ...]: `rows` [B, S] picks along `axis`.

  batched=False: x is shared by every example (no batch axis, e.g. a [H, T, K] parameter)
  and the result gets the batch axis in front: out[b, ..., s, ...] = x[..., rows[b, s], ...].
  """
  onehot = jax.nn.one_hot(rows, x.shape[axis], dtype=x.dtype)  # [B, S, T]
  dims = [c for c in string.ascii_lowercase if c not in 'bst'][:x.ndim]
  dims[axis] = 't'
  if batched:
    dims[0] = 'b'
  out = ('' if batched else 'b') + ''.join('s' if d == 't' else d for d in dims)
  return jnp.einsum(f'bst,{"".join(dims)}->{out}', onehot, x,
                    precision=jax.lax.Precision.HIGHEST)
