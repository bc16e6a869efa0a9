"""realformer/dense.py: the row-major bfloat16 matmul gives the plain dot's values and
gradients (float64 NumPy reference on the same bf16 operands), in every variant, under
remat and scan, and sharded; `model.matmul` resolves and validates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realformer import dense as dense_lib
from realformer import models
from realformer import train_lib
from realformer.spec import resolve
from tests.test_models import make_batch, perturbed_params, small_config
from tests.test_train import grads_on_mesh

BF16_EPS = 2.0 ** -8  # bfloat16's relative rounding error


def _bf16(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _f64(a):
  return np.asarray(a, np.float32).astype(np.float64)


def test_row_major_matmul_and_its_vjp_match_float64():
  rng = np.random.default_rng(0)
  x, w, g = _bf16(rng, 37, 24), _bf16(rng, 24, 40), _bf16(rng, 37, 40)
  y, vjp = jax.vjp(dense_lib.row_major_matmul, x, w)
  dx, dw = vjp(g)
  assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  for got, want in ((y, _f64(x) @ _f64(w)), (dx, _f64(g) @ _f64(w).T),
                    (dw, _f64(x).T @ _f64(g))):
    # float32 accumulation of exact bf16 products, then one rounding to bfloat16.
    np.testing.assert_allclose(_f64(got), want, rtol=BF16_EPS, atol=1e-6 * np.abs(want).max())


def test_dot_general_keeps_leading_axes_and_refuses_other_contractions():
  rng = np.random.default_rng(1)
  x, w = _bf16(rng, 2, 5, 8), _bf16(rng, 8, 3)
  y = dense_lib.row_major_dot_general(x, w, (((2,), (0,)), ((), ())))
  assert y.shape == (2, 5, 3)
  np.testing.assert_array_equal(
      y, jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r'takes \[\.\.\., K\] x \[K, N\]'):
    dense_lib.row_major_dot_general(x, w.T, (((2,), (1,)), ((), ())))


def test_auto_picks_row_major_only_for_bfloat16_on_cpu():
  assert jax.default_backend() == 'cpu'
  assert dense_lib.uses_row_major('auto', jnp.bfloat16)
  assert not dense_lib.uses_row_major('auto', jnp.float32)
  assert not dense_lib.uses_row_major('xla', jnp.bfloat16)
  assert dense_lib.uses_row_major('row_major', jnp.float32)
  with pytest.raises(ValueError, match=r"model.matmul='fast'; choose one of auto, xla, row_major"):
    resolve(small_config('postln', matmul='fast'))


def _jaxpr_has_custom_vjp(fn, *args):
  return 'custom_vjp_call' in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize('variant,extra', [
    ('postln', {}), ('preln', {}), ('realformer', {}),
    ('synth_dense_vanilla', {}), ('synth_factorized_dense', {}),
    ('postln', {'remat_policy': 'dots', 'scan_layers': True})])
def test_bfloat16_encoder_row_major_equals_xla_matmul(variant, extra):
  """Same bf16 operands, float32 accumulation: outputs and every gradient agree to within
  bf16 rounding of intermediate activations."""
  batch = make_batch()
  xla = models.build(small_config(variant, dtype='bfloat16', matmul='xla', **extra),
                     head='encoder')
  row = models.build(small_config(variant, dtype='bfloat16', matmul='row_major', **extra),
                     head='encoder')
  params = perturbed_params(xla, batch)
  loss = lambda m: lambda p: jnp.sum(m.apply({'params': p}, batch).hidden.astype(jnp.float32)
                                     ** 2)
  assert _jaxpr_has_custom_vjp(loss(row), params)
  assert not _jaxpr_has_custom_vjp(loss(xla), params)
  mask = np.asarray(batch['attention_mask'], bool)
  a = np.asarray(xla.apply({'params': params}, batch).hidden, np.float32)
  b = np.asarray(row.apply({'params': params}, batch).hidden, np.float32)
  np.testing.assert_allclose(b[mask], a[mask], atol=0.05)
  ga, gb = jax.grad(loss(xla))(params), jax.grad(loss(row))(params)
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    assert v.dtype == jnp.float32, jax.tree_util.keystr(path)
    scale = float(jnp.abs(u).max()) + 1e-6
    np.testing.assert_allclose(np.asarray(v) / scale, np.asarray(u) / scale, atol=0.05,
                               err_msg=jax.tree_util.keystr(path))


def test_row_major_gradients_sharded_equal_one_device():
  """data x fsdp x tensor: the barrier-wrapped transposes partition like any other op."""
  cfg = small_config('realformer', dtype='bfloat16', matmul='row_major',
                     dropout_rate=0.0, attention_dropout_rate=0.0)
  model = models.build(cfg)
  batch = next(train_lib.SyntheticPretrainingData(
      vocab_size=50, seq_len=16, num_predictions=3, global_batch_size=8, seed=2))
  loss_fn = train_lib.pretraining_loss_fn(model)
  loss = lambda p, b: loss_fn(p, b, None, train_lib.pretraining_totals(b))[0]
  one = grads_on_mesh(model, loss, batch, {'data': 1, 'fsdp': 1, 'tensor': 1},
                      jax.devices()[:1])
  many = grads_on_mesh(model, loss, batch, {'data': 2, 'fsdp': 2, 'tensor': 2})
  # bf16 partial products summed in another order across shards: agreement at bf16's level,
  # relative to the largest gradient (the key biases' true gradient is 0: theirs is noise).
  scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(one))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(many)):
    np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=2e-2,
                               err_msg=jax.tree_util.keystr(path))
