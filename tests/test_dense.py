"""realformer/layers/dense.py: CpuDense's custom VJP gives the dense layer's values and gradients
(float64 NumPy reference on the same operands) in float32 and bfloat16, equals flax's
nn.Dense in every variant, under remat and scan, and sharded; `model.dense_impl` resolves
and validates."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realformer import models
from realformer.layers import dense as dense_lib
from realformer.model.spec import resolve
from realformer.train import pretraining
from tests.test_models import make_batch, perturbed_params, small_config
from tests.test_train import grads_on_mesh

BF16_EPS = 2.0 ** -8  # bfloat16's relative rounding error


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32)).astype(np.float64)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_affine_and_its_vjp_match_float64(dtype):
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  x, w, g = normal(37, 24), normal(24, 40), normal(37, 40)
  b = jnp.asarray(rng.standard_normal(40), jnp.float32)
  y, vjp = jax.vjp(dense_lib.affine, x, w, b)
  dx, dw, db = vjp(g)
  assert y.dtype == dx.dtype == dw.dtype == jnp.dtype(dtype) and db.dtype == jnp.float32
  # Products of the given operands summed in float32, then one rounding to dtype.
  rtol = BF16_EPS if dtype == 'bfloat16' else 1e-5
  for got, want in ((y, _f64(x) @ _f64(w) + _f64(b)), (dx, _f64(g) @ _f64(w).T),
                    (dw, _f64(x).T @ _f64(g)), (db, _f64(g).sum(0))):
    np.testing.assert_allclose(_f64(got), want, rtol=rtol, atol=1e-5 * np.abs(want).max())


def test_cpu_dense_keeps_leading_axes_and_flax_dense_parameters():
  spec = resolve(small_config('postln', dense_impl='cpu'))
  layer = dense_lib.dense(5, ('embed', 'mlp'), spec, 'proj')
  flax_layer = dense_lib.dense(5, ('embed', 'mlp'),
                               resolve(small_config('postln', dense_impl='flax')), 'proj')
  assert isinstance(layer, dense_lib.CpuDense) and not isinstance(flax_layer,
                                                                   dense_lib.CpuDense)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 8)), jnp.float32)
  variables = flax_layer.init(jax.random.PRNGKey(0), x)
  assert (jax.tree.map(jnp.shape, layer.init(jax.random.PRNGKey(0), x))
          == jax.tree.map(jnp.shape, variables))
  np.testing.assert_allclose(layer.apply(variables, x), flax_layer.apply(variables, x),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('impl', ['cpu', 'flax'])
def test_a_gain_scales_the_kernels_initial_spread(impl):
  """dense(..., gain=g) draws its kernel N(0, (g * initializer_range)^2), as a block whose
  initialisation scales some projections (DeepNet's) needs; the bias stays zero."""
  spec = resolve(small_config('postln', dense_impl=impl))
  x = jnp.zeros((1, 256))
  drawn = {g: dense_lib.dense(512, ('embed', 'mlp'), spec, 'proj', gain=g).init(
      jax.random.PRNGKey(0), x)['params'] for g in (1.0, 0.25)}
  for g, params in drawn.items():
    std = float(np.std(np.asarray(params['kernel'].unbox())))
    assert abs(std / (g * spec.initializer_range) - 1) < 0.01, (g, std)
    assert not np.asarray(params['bias'].unbox()).any()
  np.testing.assert_allclose(np.asarray(drawn[0.25]['kernel'].unbox()),
                             0.25 * np.asarray(drawn[1.0]['kernel'].unbox()), rtol=1e-6)


def test_auto_picks_cpu_dense_on_cpu_and_bad_values_are_clear():
  assert jax.default_backend() == 'cpu'
  spec = lambda impl, platform='': resolve(small_config('postln', dense_impl=impl), platform)
  assert dense_lib.uses_cpu_dense(spec('auto')) and dense_lib.uses_cpu_dense(spec('cpu'))
  assert not dense_lib.uses_cpu_dense(spec('flax'))
  # The target platform decides, not this host: a TPU compile gets nn.Dense.
  assert not dense_lib.uses_cpu_dense(spec('auto', 'tpu'))
  with pytest.raises(ValueError, match=r"model.dense_impl='fast'; choose one of auto, flax, cpu"):
    resolve(small_config('postln', dense_impl='fast'))


@pytest.mark.parametrize('variant,extra', [
    ('postln', {}), ('preln', {}), ('realformer', {}),
    ('synth_dense_vanilla', {}), ('synth_factorized_dense', {}),
    ('postln', {'remat_policy': 'dots', 'scan_layers': True})])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_encoder_with_cpu_dense_equals_flax_dense(variant, extra, dtype):
  batch = make_batch()
  build = lambda impl: models.build(small_config(variant, dtype=dtype, dense_impl=impl,
                                                 **extra), head='encoder')
  plain, cpu = build('flax'), build('cpu')
  params = perturbed_params(plain, batch)
  loss = lambda m: lambda p: jnp.sum(m.apply({'params': p}, batch).hidden.astype(jnp.float32)
                                     ** 2)
  assert 'custom_vjp_call' in str(jax.make_jaxpr(loss(cpu))(params))
  assert 'custom_vjp_call' not in str(jax.make_jaxpr(loss(plain))(params))
  # float32: summation order only. bfloat16: activations rounded at other points (a few
  # bf16 ulps after three layers).
  tol, rtol = (0.05, 0.04) if dtype == 'bfloat16' else (2e-5, 0)
  mask = np.asarray(batch['attention_mask'], bool)
  a = np.asarray(plain.apply({'params': params}, batch).hidden, np.float32)
  b = np.asarray(cpu.apply({'params': params}, batch).hidden, np.float32)
  np.testing.assert_allclose(b[mask], a[mask], rtol=rtol, atol=tol)
  ga, gb = jax.grad(loss(plain))(params), jax.grad(loss(cpu))(params)
  scale = max(float(jnp.abs(u).max()) for u in jax.tree.leaves(ga))
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    assert v.dtype == jnp.float32, jax.tree_util.keystr(path)
    np.testing.assert_allclose(np.asarray(v) / scale, np.asarray(u) / scale, atol=tol,
                               err_msg=jax.tree_util.keystr(path))


def test_bfloat16_cpu_dense_gradients_sharded_equal_one_device():
  """data x fsdp x tensor: the barrier-wrapped transposes partition like any other op."""
  cfg = small_config('realformer', dtype='bfloat16', dense_impl='cpu',
                     dropout_rate=0.0, attention_dropout_rate=0.0)
  model = models.build(cfg)
  batch = next(pretraining.SyntheticData(
      vocab_size=50, seq_len=16, num_predictions=3, global_batch_size=8, seed=2))
  loss_fn = pretraining.loss_fn(model)
  loss = lambda p, b: loss_fn(p, b, None, pretraining.totals(b))[0]
  one = grads_on_mesh(model, loss, batch, {'data': 1, 'fsdp': 1, 'tensor': 1},
                      jax.devices()[:1])
  many = grads_on_mesh(model, loss, batch, {'data': 2, 'fsdp': 2, 'tensor': 2})
  # bf16 partial products summed in another order across shards: agreement at bf16's level,
  # relative to the largest gradient (the key biases' true gradient is 0: theirs is noise).
  scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(one))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(many)):
    np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=2e-2,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('impl', ['cpu', 'flax'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_layer_of_some_columns_is_the_whole_layer_cut(impl, dtype):
  """dense(..., columns=f) keeps the whole layer's parameters and computes f's columns of its
  output (the Dense Synthesizer's first T of each head's max_len logits): the same values as
  the whole layer's output cut afterwards, in both implementations, and the gradient of the
  columns left out is zero."""
  spec = resolve(small_config('postln', dense_impl=impl, dtype=dtype))
  heads, width, kept = 3, 8, 5
  cut = lambda w: w.reshape(w.shape[:-1] + (heads, width))[..., :kept].reshape(
      w.shape[:-1] + (heads * kept,))
  whole = dense_lib.dense(heads * width, ('embed', 'mlp'), spec, 'proj')
  some = dense_lib.dense(heads * width, ('embed', 'mlp'), spec, 'proj', columns=cut)
  assert isinstance(some, dense_lib.CpuDense if impl == 'cpu' else dense_lib.ColumnsDense)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 16)), spec.dtype)
  variables = some.init(jax.random.PRNGKey(0), x)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, whole.init(
      jax.random.PRNGKey(0), x))  # (a checkpoint of either loads into the other)
  variables = jax.tree.map(lambda p: p + 0.1, nn.meta.unbox(variables))  # a bias not 0
  y = some.apply(variables, x)
  assert y.shape == (2, 3, heads * kept) and y.dtype == spec.dtype
  rtol = BF16_EPS if dtype == 'bfloat16' else 1e-5  # (the matmul's blocking may differ)
  np.testing.assert_allclose(_f64(y), _f64(cut(whole.apply(variables, x))), rtol=rtol,
                             atol=rtol * 1e-2)
  grads = jax.grad(lambda v: jnp.sum(some.apply(v, x).astype(jnp.float32) ** 2))(variables)
  for name, g in grads['params'].items():
    g = np.asarray(g).reshape(g.shape[:-1] + (heads, width))
    assert not g[..., kept:].any() and g[..., :kept].all(), name
