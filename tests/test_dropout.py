"""realformer.layers.dropout: the drop rate, unbiasedness, independence, partitionability and the
fallback for non-threefry keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from realformer.layers import dropout as dropout_lib


@pytest.mark.parametrize('rate', [0.1, 0.5])
def test_drop_rate_and_unbiased_scale(rate):
  x = jnp.full((200, 16, 64), 2.0)
  y = np.asarray(dropout_lib.Dropout(rate).apply({}, x, False,
                                                  rngs={'dropout': jax.random.PRNGKey(0)}))
  dropped = np.mean(y == 0)
  n = y.size
  assert abs(dropped - dropout_lib.drop_fraction(rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
  assert abs(dropout_lib.drop_fraction(rate) - rate) <= 2.0 ** -17
  kept = y[y != 0]
  np.testing.assert_allclose(kept, 2.0 / (1 - dropout_lib.drop_fraction(rate)), rtol=1e-6)
  assert abs(y.mean() - 2.0) < 5 * 2.0 * np.sqrt(rate / (1 - rate) / n)  # E[y] = x


def test_deterministic_and_zero_rate_are_the_identity():
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 7))
  np.testing.assert_array_equal(dropout_lib.Dropout(0.1).apply({}, x, True), x)
  np.testing.assert_array_equal(
      dropout_lib.Dropout(0.0).apply({}, x, False, rngs={'dropout': jax.random.PRNGKey(0)}), x)


def test_uniforms_are_uniform_and_neighbours_independent():
  u = np.asarray(dropout_lib.uniform_u16(jax.random.PRNGKey(7), (64, 4, 33, 33)),
                 np.float64) / 65535
  assert u.shape == (64, 4, 33, 33)
  hist = np.histogram(u, bins=16, range=(0, 1))[0] / u.size
  np.testing.assert_allclose(hist, 1 / 16, atol=0.002)
  flat = u.reshape(-1, 33)
  for lag in (1, 2, 3, 4):  # the four 16-bit words of one block, and the next block
    assert abs(np.corrcoef(flat[:, :-lag].ravel(), flat[:, lag:].ravel())[0, 1]) < 0.01
  rows = u.reshape(-1, 33 * 33)
  assert abs(np.corrcoef(rows[:-1].ravel(), rows[1:].ravel())[0, 1]) < 0.01
  other = np.asarray(dropout_lib.uniform_u16(jax.random.PRNGKey(8), u.shape), np.float64)
  assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < 0.01


def test_typed_and_legacy_threefry_keys_agree_and_other_impls_work():
  a = dropout_lib.uniform_u16(jax.random.PRNGKey(3), (4, 9))
  b = dropout_lib.uniform_u16(jax.random.key(3), (4, 9))
  np.testing.assert_array_equal(a, b)
  for impl in ('rbg', 'unsafe_rbg'):  # jax's own bits of those generators, uniform
    key = jax.random.key(3, impl=impl)
    c = dropout_lib.uniform_u16(key, (4, 9))
    assert c.shape == (4, 9) and c.dtype == jnp.uint16
    np.testing.assert_array_equal(c, jax.random.bits(key, (4, 9), jnp.uint16))
    kept, _ = dropout_lib.keep_mask(key, 0.3, (256, 256))
    assert abs(float(np.mean(kept)) - 0.7) < 0.01, impl
  assert dropout_lib.uniform_u16(jax.random.PRNGKey(3), ()).shape == ()


def test_sharded_masks_equal_unsharded():
  mesh = jax.make_mesh((4, 2), ('data', 'tensor'))
  x = jnp.ones((8, 6, 16, 16))
  f = lambda k, x: dropout_lib.Dropout(0.1).apply({}, x, False, rngs={'dropout': k})
  key = jax.random.PRNGKey(11)
  whole = np.asarray(jax.jit(f)(key, x))
  spec = NamedSharding(mesh, P('data', 'tensor'))
  sharded = jax.jit(f, out_shardings=spec)(key, jax.device_put(x, spec))
  np.testing.assert_array_equal(np.asarray(sharded), whole)
  hlo = jax.jit(f, out_shardings=spec).lower(key, jax.device_put(x, spec)).compile().as_text()
  assert 'all-gather' not in hlo and 'f32[8,6,16,16]' not in hlo  # no global mask per device


def test_rate_one_is_an_error():
  with pytest.raises(ValueError, match='rate'):
    dropout_lib.keep_mask(jax.random.PRNGKey(0), 1.0, (3,))


def test_keep_mask_is_the_thresholded_uniforms():
  key = jax.random.PRNGKey(5)
  for shape in [(3, 7, 10), (4, 9)]:
    keep, _ = dropout_lib.keep_mask(key, 0.25, shape)
    want = dropout_lib.uniform_u16(key, shape) >= round(0.25 * 65536)
    np.testing.assert_array_equal(keep, want)


def test_raw_keys_of_another_default_impl_do_not_take_the_threefry_path():
  previous = jax.config.jax_default_prng_impl
  jax.config.update('jax_default_prng_impl', 'philox4x32')
  try:
    key = jax.random.PRNGKey(3)  # raw uint32[2], like threefry's
    assert key.shape == (2,)
    np.testing.assert_array_equal(dropout_lib.uniform_u16(key, (4, 9)),
                                  jax.random.bits(key, (4, 9), jnp.uint16))
  finally:
    jax.config.update('jax_default_prng_impl', previous)


def test_bfloat16_is_scaled_in_float32_then_rounded_once():
  x = jax.random.normal(jax.random.PRNGKey(2), (64, 256)).astype(jnp.bfloat16)
  key = jax.random.PRNGKey(0)
  y = dropout_lib.Dropout(0.1).apply({}, x, False, rngs={'dropout': key})
  scale = 1 / (1 - dropout_lib.drop_fraction(0.1))
  want = np.asarray((x.astype(jnp.float32) * scale).astype(jnp.bfloat16), np.float32)
  got = np.asarray(y, np.float32)
  assert y.dtype == jnp.bfloat16 and 0.05 < np.mean(got == 0) < 0.15
  np.testing.assert_array_equal(got[got != 0], want[got != 0])
