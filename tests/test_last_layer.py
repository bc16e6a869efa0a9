"""model.last_layer='predicted': in the pretraining loss the last layer computes only [CLS]
and the masked positions. Every variant gives the full layer's logits and gradients (float32;
Post-LN and RealFormer in bfloat16 too), the FLOPs drop as train_lib.flops_per_example says, and the paths that must
see every row (scanned layers, captured attention, the public contract) keep them."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from realformer import models
from realformer.layers import rows as rows_lib
from realformer.model.spec import resolve
from realformer.train import pretraining
from realformer.train import train_lib
from synthesizer import synthetic
from tests.test_models import VARIANTS, make_batch, perturbed_params, small_config

# Masked positions per row, padding ones included (weight 0), repeats and position 0 too.
POSITIONS = [[0, 3, 11, 5], [1, 2, 6, 6], [0, 1, 2, 0]]


def pretraining_batch():
  batch = make_batch()
  b, p = len(POSITIONS), len(POSITIONS[0])
  return dict(batch, masked_lm_positions=jnp.asarray(POSITIONS, jnp.int32),
              masked_lm_ids=jnp.asarray(np.arange(b * p).reshape(b, p) % 40 + 5, jnp.int32),
              masked_lm_weights=jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]],
                                            jnp.float32),
              next_sentence_labels=jnp.asarray([0, 1, 1], jnp.int32))


def _loss(model):
  loss_fn = pretraining.loss_fn(model)
  return lambda p, b: loss_fn(p, b, None, pretraining.totals(b))[0]


def _models(variant, dtype='float32', **extra):
  """(the model computing every row of its last layer, the pruned one, params, batch)."""
  batch = pretraining_batch()
  build = lambda rows: models.build(small_config(variant, dtype=dtype, last_layer=rows,
                                                 **extra))
  full, pruned = build('all'), build('predicted')
  return full, pruned, perturbed_params(full, batch), batch


def _compare(variant, dtype='float32', **extra):
  full, pruned, params, batch = _models(variant, dtype, **extra)
  apply = lambda m: m.apply({'params': params}, batch, full_hidden=False)
  a, b = apply(full), apply(pruned)
  tol = 0.05 if dtype == 'bfloat16' else 2e-5
  for name in ('mlm_logits', 'nsp_logits', 'pooled', 'hidden'):
    np.testing.assert_allclose(np.asarray(getattr(b, name), np.float32),
                               np.asarray(getattr(a, name), np.float32), atol=tol,
                               rtol=tol, err_msg=name)
  assert a.hidden.shape == (3, 4, 32)  # only the masked rows, in both
  ga, gb = jax.grad(_loss(full))(params, batch), jax.grad(_loss(pruned))(params, batch)
  scale = max(float(jnp.abs(u).max()) for u in jax.tree.leaves(ga))
  norm = lambda x: np.linalg.norm(np.asarray(x, np.float64))
  largest = max(norm(u) for u in jax.tree.leaves(ga))
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    if dtype != 'bfloat16':
      np.testing.assert_allclose(np.asarray(v) / scale, np.asarray(u) / scale, atol=tol,
                                 err_msg=jax.tree_util.keystr(path))
    elif norm(u) >= 1e-3 * largest:  # each gradient within 10% of its own size (bfloat16's
      # rounding: at most 2.6% here), the last layer's small query projection's included
      assert norm(np.asarray(v, np.float64) - np.asarray(u, np.float64)) <= 0.1 * norm(u), (
          jax.tree_util.keystr(path))


@pytest.mark.parametrize('variant', VARIANTS)
def test_every_variant_gives_the_full_layers_logits_and_gradients(variant):
  _compare(variant)


@pytest.mark.parametrize('variant,extra', [
    ('realformer', {'running_mean': True}), ('realformer', {'block': 'pre_ln'}),
    ('synth_random_vanilla', {'remat_policy': 'full'}),
    ('postln', {'fused_attention': 'xla'})])
def test_layouts_remat_and_fused_attention(variant, extra):
  _compare(variant, **extra)


@pytest.mark.parametrize('variant', ['postln', 'realformer'])
def test_bfloat16(variant):
  _compare(variant, dtype='bfloat16')


def model_matmul_flops(jaxpr) -> int:
  """2 x multiply-adds of every dot_general in a jaxpr (nested ones included), leaving out
  rows.take_rows's one-hot selections (the only dots at Precision.HIGHEST)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      precision = eqn.params['precision']
      if jax.lax.Precision.HIGHEST not in (precision if isinstance(precision, tuple)
                                           else (precision,)):
        (contracting, _), _ = eqn.params['dimension_numbers']
        lhs = eqn.invars[0].aval.shape
        total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
            lhs[i] for i in contracting)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          total += model_matmul_flops(getattr(sub, 'jaxpr', sub))
  return total


@pytest.mark.parametrize('variant', VARIANTS)
def test_train_step_matmuls_are_exactly_flops_per_example(variant):
  """The gradient's matmuls, counted in its jaxpr, are train_lib.flops_per_example (the figure
  the benchmarks divide by) exactly, for every row and for the pruned last layer; for every
  variant (tests/test_launch.py judges the compiled programs' FLOPs of one variant of each
  kind of attention). A factorized random table's R1 R2^T is not in the figure (it does not
  grow with the batch: computed once, forward and backward, but per example in a pruned last
  layer): added here exactly."""
  batch = pretraining_batch()
  b, t = batch['input_ids'].shape
  p = batch['masked_lm_positions'].shape[1]
  counted = {}
  for rows in ('all', 'predicted'):
    config = small_config(variant, last_layer=rows)
    model = models.build(config)
    params = perturbed_params(model, batch)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(model)))(params, batch).jaxpr
    counted[rows] = model_matmul_flops(jaxpr)
    want = b * train_lib.flops_per_example(config, t, p)
    n, h, k = config.num_layers, config.num_heads, config.synth_factorized_rank
    last = rows_lib.num_last_layer_rows(p, t) if rows == 'predicted' else t
    if variant == 'synth_factorized_random':
      product = 3 * 2 * h * t * k  # R1 R2^T for a row of T, forward and backward
      want += ((n - 1) * t + last) * product if rows == 'all' else (
          (n - 1) * t * product + b * last * product)
    assert counted[rows] == want, rows
  assert counted['predicted'] < counted['all']


@synthetic.register('distance_penalty')
class DistancePenalty(synthetic.LogitComponent):
  """-|k - q| / 4 for every head: a constant of the shapes (no parameters), a bias of the
  logits (added with weight 1)."""
  mixed = False

  def __call__(self, x, rows=None):
    keys = jnp.arange(x.shape[1])
    queries = keys[None, :] if rows is None else rows  # [1 or B, S]
    bias = -jnp.abs(keys[None, None, :] - queries[:, :, None]).astype(jnp.float32) / 4
    return jnp.broadcast_to(bias[:, None], (bias.shape[0], self.spec.num_heads) + bias.shape[1:])


def test_no_gradient_of_the_probabilities_where_no_logit_trains():
  """A fixed random table with a bias that has no parameters: no logit takes a gradient, so
  the probabilities' gradient is neither formed (the jaxpr) nor counted (the figure)."""
  batch = pretraining_batch()
  b, t = batch['input_ids'].shape
  p = batch['masked_lm_positions'].shape[1]
  for rows in ('all', 'predicted'):
    config = small_config('synth_random_fixed', attention='random+distance_penalty',
                          last_layer=rows)
    assert resolve(config).mixture == ()
    model = models.build(config)
    params = perturbed_params(model, batch)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(model)))(params, batch).jaxpr
    assert model_matmul_flops(jaxpr) == b * train_lib.flops_per_example(config, t, p), rows


def test_contract_paths_keep_every_row():
  # (the pruned model's own outputs and gradients: the variant's case above)
  full, pruned, params, batch = _models('synth_dense_vanilla')
  # The public contract: by default hidden is every row, whatever last_layer says.
  out = pruned.apply({'params': params}, batch)
  assert out.hidden.shape == (3, 12, 32)
  np.testing.assert_allclose(out.mlm_logits, full.apply({'params': params}, batch).mlm_logits,
                             atol=2e-5)
  # Captured attention needs every row of every layer: the pruned model then computes them.
  captured = pruned.apply({'params': params}, batch, capture_attention=True, full_hidden=False)
  assert captured.attention[-1].shape == (3, 4, 12, 12)
  np.testing.assert_allclose(captured.mlm_logits, out.mlm_logits, atol=2e-5)


def test_scanned_layers_pick_the_rows_from_the_full_output():
  batch = pretraining_batch()
  model = models.build(small_config('realformer', scan_layers=True))
  params = perturbed_params(model, batch)
  a = model.apply({'params': params}, batch, full_hidden=False)
  b = model.apply({'params': params}, batch)
  np.testing.assert_allclose(a.hidden, rows_lib.take_rows(b.hidden, batch['masked_lm_positions']),
                             atol=1e-6)
  np.testing.assert_allclose(a.mlm_logits, b.mlm_logits, atol=1e-6)


def test_dropout_runs_on_the_selected_rows():
  """Training mode: the masks are drawn over the pruned shapes (same distribution, other
  bits); with zero rates the two paths agree exactly as in evaluation."""
  batch = pretraining_batch()
  build = lambda rows, rate: models.build(small_config(
      'realformer', last_layer=rows, dropout_rate=rate, attention_dropout_rate=rate))
  params = perturbed_params(build('all', 0.0), batch)
  run = lambda m: m.apply({'params': params}, batch, deterministic=False, full_hidden=False,
                          rngs={'dropout': jax.random.PRNGKey(3)}).mlm_logits
  np.testing.assert_allclose(run(build('predicted', 0.0)), run(build('all', 0.0)), atol=2e-5)
  dropped = run(build('predicted', 0.5))
  assert np.isfinite(dropped).all()
  assert not np.allclose(dropped, run(build('predicted', 0.0)), atol=1e-3)
  # Training computes the pruned rows too (not only evaluation): fewer matmul FLOPs.
  flops = {rows: model_matmul_flops(jax.make_jaxpr(lambda p, m=build(rows, 0.5): m.apply(
      {'params': p}, batch, deterministic=False, full_hidden=False,
      rngs={'dropout': jax.random.PRNGKey(3)}).mlm_logits)(params).jaxpr)
           for rows in ('predicted', 'all')}
  assert flops['predicted'] < flops['all'], flops


def test_take_rows_and_gather_rows_against_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 4, 12, 5)).astype(np.float32)
  rows = np.asarray(POSITIONS)
  want = np.stack([x[b][:, rows[b]] for b in range(3)])
  for select in (rows_lib.take_rows, rows_lib.gather_rows):
    np.testing.assert_array_equal(select(jnp.asarray(x), jnp.asarray(rows), axis=2), want)
  shared = x[0]  # [H, T, K], no batch axis
  got = rows_lib.gather_rows(jnp.asarray(shared), jnp.asarray(rows), axis=1, batched=False)
  np.testing.assert_array_equal(got, np.stack([shared[:, rows[b]] for b in range(3)]))
  bf = jnp.asarray(x[:, 0], jnp.bfloat16)  # [B, T, D]: exact in bfloat16 too
  np.testing.assert_array_equal(np.asarray(rows_lib.take_rows(bf, jnp.asarray(rows)), np.float32),
                                np.stack([np.asarray(bf, np.float32)[b][rows[b]]
                                          for b in range(3)]))
  # Out of range: a zero row from the contraction, the last row from the gather, never NaN.
  far = jnp.asarray([[12, -1]] * 3)
  np.testing.assert_array_equal(rows_lib.take_rows(jnp.asarray(x), far, axis=2), 0.0)
  np.testing.assert_array_equal(rows_lib.gather_rows(jnp.asarray(x), far + 20, axis=2),
                                x[:, :, [11, 11]])


def test_last_layer_rows_are_cls_positions_and_filler_to_a_multiple_of_8():
  positions = jnp.asarray([[5, 9, 9], [1, 0, 2]], jnp.int32)
  rows = rows_lib.last_layer_rows(positions, 64)
  np.testing.assert_array_equal(rows, [[0, 5, 9, 9, 0, 0, 0, 0], [0, 1, 0, 2, 0, 0, 0, 0]])
  assert [rows_lib.num_last_layer_rows(p, 128) for p in (0, 7, 8, 20, 76, 127)] == [
      8, 8, 16, 24, 80, 128]
  assert rows_lib.num_last_layer_rows(20, 24) == 24  # not fewer than T: every row
  assert rows_lib.last_layer_rows(positions, 8) is None
  # The formula follows the same rows, down to no predictions at all ([CLS] alone).
  config = small_config('postln')
  layer_rows = lambda p: (train_lib.flops_per_example(config, 64, p)
                          - train_lib.flops_per_example(small_config('postln', last_layer='all'),
                                                        64, p))
  assert layer_rows(0) == layer_rows(7) < layer_rows(8) < 0


def test_pruned_query_rows_pass_cudnns_fused_attention_checks(monkeypatch):
  """On NVIDIA GPUs in bfloat16, Post-LN and Pre-LN take cuDNN's flash attention
  (fused_attention='auto'), which refuses an odd query length in training with a bias: the
  last layer's P + 1 = 21 rows at BERT's P = 20 would crash. The rows are padded to a multiple
  of 8. CI has no GPU: jax's own shape check runs here, with the device check faking an H100."""
  fa = pytest.importorskip('jax._src.cudnn.fused_attention_stablehlo')
  monkeypatch.setattr(fa, 'check_compute_capability', lambda capability: True)
  monkeypatch.setattr(fa, 'is_cuda_compute_capability_equal', lambda capability: False)

  def check(q_len, kv_len):
    q = jax.ShapeDtypeStruct((8, q_len, 12, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((8, kv_len, 12, 64), jnp.bfloat16)
    fa.check_is_flash_attention(q, kv, kv, fa.AttentionLayout.BTNH.value, 91000,
                                has_bias=True, is_training=True)
  for t, p in ((128, 20), (512, 76), (512, 80), (128, 0)):
    check(rows_lib.num_last_layer_rows(p, t), t)
  with pytest.raises(NotImplementedError):
    check(21, 128)  # what an unpadded last layer would send


def test_bad_value_is_clear():
  with pytest.raises(ValueError, match=r"model.last_layer='masked'; choose one of predicted, all"):
    resolve(small_config('postln', last_layer='masked'))
