"""Inverted dropout whose masks cost a quarter of flax.linen.Dropout's random numbers.

nn.Dropout draws one float32 uniform per element, and with JAX's partitionable threefry
(the default) every element then costs one whole threefry-2x32 block: 64 random bits of
which it keeps 23. Here each block gives four 16-bit uniforms instead (timings against
nn.Dropout: benchmarks/dropout_masks.py, figures in BENCHMARKS.md):

    keep  = u16 >= round(rate * 2**16)      (u16 uniform on 0..65535)
    out   = where(keep, x / P(keep), 0)     with P(keep) = 1 - round(rate * 2**16) / 2**16

so the drop probability is `rate` to within 2**-17 (0.1 -> 0.100006) and the output is
unbiased (it divides by the exact keep probability, not by 1 - rate; in float32 before
rounding to a bfloat16 input's dtype).

The blocks' counters are iotas over the mask's own shape (row = the flattened leading
indices, column = the block along the last axis), so like jax.random under
jax_threefry_partitionable the mask is partitionable: a sharded run draws the same mask as
an unsharded one without generating the global array on every device. A key of another
implementation (rbg, unsafe_rbg: see JAX_DEFAULT_PRNG_IMPL) draws 16-bit uniforms with
jax.random.bits instead.
"""

import functools
from typing import List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.random import threefry2x32_p

_ONE = 1 << 16  # 16-bit uniforms


def _threefry_quarters(key_data: jax.Array, shape: Sequence[int]) -> List[jax.Array]:
  """Four uint32 arrays of 16-bit uniforms, each [*lead, ceil(n / 4)]: one threefry-2x32
  block per column gives one element of each."""
  *lead, n = shape
  grid = (*lead, -(-n // 4))
  if np.prod(lead, dtype=np.int64) >= 2 ** 32 or grid[-1] >= 2 ** 32:
    raise ValueError(f'dropout mask {tuple(shape)}: more than 2^32 rows or blocks per row; '
                     'split the array')
  row = jnp.zeros(grid, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(lead))):
    row = row + jax.lax.broadcasted_iota(jnp.uint32, grid, axis) * np.uint32(stride)
    stride *= lead[axis]
  col = jax.lax.broadcasted_iota(jnp.uint32, grid, len(lead))
  b1, b2 = threefry2x32_p.bind(key_data[0], key_data[1], row, col)
  return [b1 & 0xFFFF, b1 >> 16, b2 & 0xFFFF, b2 >> 16]


def _interleave(parts: List[jax.Array], n: int) -> jax.Array:
  """[*lead, c] x 4 -> [*lead, n]: element 4j + i is parts[i][..., j]."""
  stacked = jnp.stack(parts, axis=-1)
  return stacked.reshape(*stacked.shape[:-2], -1)[..., :n]


def threefry_key_data(key: jax.Array) -> Optional[jax.Array]:
  """A dropout key's uint32[2] data if it is a threefry key (typed, or a legacy uint32[2] key
  under the default threefry implementation); None for other implementations."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(key)) != 'threefry2x32':
      return None
    return jax.random.key_data(key)
  threefry = key.shape == (2,) and jax.config.jax_default_prng_impl == 'threefry2x32'
  return key if threefry else None


def _quarters(key: jax.Array, shape: Tuple[int, ...]) -> Optional[List[jax.Array]]:
  """_threefry_quarters for a threefry key; None otherwise."""
  data = threefry_key_data(key)
  return None if data is None else _threefry_quarters(data, shape)


def uniform_u16(key: jax.Array, shape: Sequence[int]) -> jax.Array:
  """Uniform uint16 of `shape` from a dropout key (typed or legacy uint32 key)."""
  shape = tuple(int(d) for d in shape)
  if not shape:
    return uniform_u16(key, (1,)).reshape(())
  parts = _quarters(key, shape)
  if parts is None:
    return jax.random.bits(key, shape, jnp.uint16)
  return _interleave(parts, shape[-1]).astype(jnp.uint16)


def keep_scale(rate: float) -> float:
  """1 / P(keep): what a kept element is multiplied by."""
  return _ONE / (_ONE - keep_threshold(rate))


def keep_threshold(rate: float) -> int:
  """Elements whose 16-bit uniform falls below this are dropped."""
  return int(round(rate * _ONE))


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int]):
  """(bool mask of kept elements, 1 / P(keep)) for drop probability `rate`."""
  threshold = keep_threshold(rate)
  if threshold >= _ONE:
    raise ValueError(f'dropout rate {rate} leaves nothing; use a rate below 1')
  shape = tuple(int(d) for d in shape)
  parts = _quarters(key, shape) if shape else None
  if parts is None:
    keep = uniform_u16(key, shape) >= jnp.uint16(threshold)
  else:  # compare before interleaving: the mask XLA keeps for the backward pass is bool
    keep = _interleave([p >= np.uint32(threshold) for p in parts], shape[-1])
  return keep, keep_scale(rate)


# The name every dropout mask carries for jax.checkpoint's policies (checkpoint_name): a
# remat policy that saves it keeps the masks rather than drawing them again in the backward
# pass (model.remat_policy='dots_flash'); Dropout.redraw's backward draws its mask again
# whatever the policy keeps.
MASKS_NAME = 'dropout_masks'


def _dropped(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
  keep, scale = keep_mask(key, rate, x.shape)
  keep = checkpoint_name(keep, MASKS_NAME)
  kept = (x.astype(jnp.float32) * scale).astype(x.dtype)  # scale rounded once, not twice
  return jnp.where(keep, kept, jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dropped_redrawn(x, key, rate):
  return _dropped(x, key, rate)


def _dropped_redrawn_fwd(x, key, rate):
  return _dropped(x, key, rate), key


def _dropped_redrawn_bwd(rate, key, g):
  # The same mask, drawn again from the key: d(where(keep, x * s, 0)) = where(keep, g * s, 0).
  zero = np.zeros(key.shape, jax.dtypes.float0)
  return _dropped(g, key, rate), zero


_dropped_redrawn.defvjp(_dropped_redrawn_fwd, _dropped_redrawn_bwd)


class Dropout(nn.Module):
  """Drop-in for nn.Dropout(rate)(x, deterministic) with the cheaper masks above.

  redraw: keep only the key for the backward pass and draw the mask again there, instead of
  keeping the boolean mask (a byte an element): the same values and gradients, for the
  price of a second draw (realformer.model.encoder.recomputes_elementwise: on TPUs).
  """
  rate: float
  rng_collection: str = 'dropout'
  redraw: bool = False

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or self.rate == 0.0:
      return x
    key = self.make_rng(self.rng_collection)
    if self.redraw:
      return _dropped_redrawn(x, key, self.rate)
    return _dropped(x, key, self.rate)

  def threefry_key(self) -> jax.Array:
    """The uint32[2] threefry key data that __call__ would draw its mask from: the same
    rng stream, so a kernel that draws keep_mask's mask itself (flash_attention) drops what
    this module would. An error for keys of another implementation."""
    data = threefry_key_data(self.make_rng(self.rng_collection))
    if data is None:
      raise ValueError('model.fused_attention=flash draws threefry dropout masks, and the '
                       f'default PRNG is {jax.config.jax_default_prng_impl}: unset '
                       'JAX_DEFAULT_PRNG_IMPL, or use model.fused_attention=off')
    return data


def drop_fraction(rate: float) -> float:
  """The exact drop probability that `rate` gives (round(rate * 2**16) / 2**16)."""
  return keep_threshold(rate) / _ONE
