"""Fast paths give the plain path's results: the fused attention kernel (its XLA
implementation on CPU), its fallback under attention dropout, bfloat16, every remat policy,
and the padded vocabulary."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realformer import models
from realformer.model import attention as attn_lib
from realformer.model.spec import VARIANTS, resolve
from tests.test_models import assert_bfloat16_close, make_batch, perturbed_params, small_config


def _loss(model, batch, **kw):
  return lambda p: jnp.sum(model.apply({'params': p}, batch, **kw).hidden.astype(jnp.float32)
                           ** 2)


@pytest.mark.parametrize('variant', ['postln', 'preln'])
def test_fused_kernel_matches_plain_outputs_and_gradients(variant):
  batch = make_batch()
  plain = models.build(small_config(variant, fused_attention='off'), head='encoder')
  fused = models.build(small_config(variant, fused_attention='xla'), head='encoder')
  assert attn_lib._use_fused(fused.spec, True, False) == 'xla' and fused.spec.plain_dot_product
  params = perturbed_params(plain, batch)
  a, b = plain.apply({'params': params}, batch), fused.apply({'params': params}, batch)
  mask = np.asarray(batch['attention_mask'], bool)
  np.testing.assert_allclose(np.asarray(b.hidden)[mask], np.asarray(a.hidden)[mask],
                             rtol=1e-5, atol=1e-5)
  ga, gb = jax.grad(_loss(plain, batch))(params), jax.grad(_loss(fused, batch))(params)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('variant', sorted(
    v for v in VARIANTS if not resolve(small_config(v)).plain_dot_product))
def test_asking_for_the_fused_kernel_never_changes_what_a_variant_computes(variant):
  """model.fused_attention=xla on every variant whose attention is not plain dot-product
  attention (spec.plain_dot_product: Post-LN and Pre-LN, whose fused outputs and gradients
  the test above checks): the kernel does not stand in, each keeps its own path."""
  batch = make_batch()
  plain = models.build(small_config(variant, fused_attention='off'), head='encoder')
  asked = models.build(small_config(variant, fused_attention='xla'), head='encoder')
  assert attn_lib._use_fused(asked.spec, True, False) is None
  assert not asked.spec.plain_dot_product
  params = perturbed_params(plain, batch)
  a, b = plain.apply({'params': params}, batch), asked.apply({'params': params}, batch)
  mask = np.asarray(batch['attention_mask'], bool)
  np.testing.assert_allclose(np.asarray(b.hidden)[mask], np.asarray(a.hidden)[mask],
                             rtol=1e-5, atol=1e-5)


def test_fused_kernel_in_bfloat16_stays_close_to_float32():
  batch = make_batch()
  plain = models.build(small_config('postln', fused_attention='off'), head='encoder')
  fused = models.build(small_config('postln', fused_attention='xla', dtype='bfloat16'),
                       head='encoder')
  params = perturbed_params(plain, batch)
  a, b = plain.apply({'params': params}, batch), fused.apply({'params': params}, batch)
  assert b.hidden.dtype == jnp.bfloat16
  assert_bfloat16_close(b.hidden, a.hidden, batch['attention_mask'])


def test_fused_kernel_in_float16_keeps_a_fully_masked_row_finite():
  """float16 ends at 65504: the padding bias must stay finite there, or a row whose keys are
  all padding gives NaN (the plain path gives a uniform distribution)."""
  batch = make_batch()
  batch['attention_mask'] = batch['attention_mask'].at[0].set(0)  # an all-padding example
  plain = models.build(small_config('postln', fused_attention='off', dtype='float16'),
                       head='encoder')
  fused = models.build(small_config('postln', fused_attention='xla', dtype='float16'),
                       head='encoder')
  params = perturbed_params(plain, batch)
  a, b = plain.apply({'params': params}, batch), fused.apply({'params': params}, batch)
  assert np.isfinite(np.asarray(b.hidden, np.float32)).all()
  mask = np.asarray(batch['attention_mask'], bool)  # the other examples' real tokens
  np.testing.assert_allclose(np.asarray(b.hidden, np.float32)[mask],
                             np.asarray(a.hidden, np.float32)[mask], atol=0.05)


def test_attention_dropout_falls_back_to_the_plain_path():
  batch = make_batch()
  cfg = dict(attention_dropout_rate=0.3, dropout_rate=0.0)
  plain = models.build(small_config('postln', fused_attention='off', **cfg), head='encoder')
  fused = models.build(small_config('postln', fused_attention='xla', **cfg), head='encoder')
  assert attn_lib._use_fused(fused.spec, False, False) is None  # training: dropout needed
  assert attn_lib._use_fused(fused.spec, True, True) is None  # probabilities asked for
  params = perturbed_params(plain, batch)
  rngs = {'dropout': jax.random.PRNGKey(3)}
  a = plain.apply({'params': params}, batch, deterministic=False, rngs=rngs)
  b = fused.apply({'params': params}, batch, deterministic=False, rngs=rngs)
  np.testing.assert_array_equal(a.hidden, b.hidden)
  c = plain.apply({'params': params}, batch, deterministic=True)
  assert not np.allclose(a.hidden, c.hidden)  # dropout did act


def test_auto_picks_the_plain_path_on_cpu_and_never_for_other_variants():
  assert attn_lib._use_fused(resolve(small_config('postln')), True, False) is None  # CPU
  for variant in ('realformer', 'synth_dense', 'synth_random_vanilla'):
    spec = resolve(small_config(variant, fused_attention='xla'))
    assert attn_lib._use_fused(spec, True, False) is None


@pytest.mark.parametrize('policy', ['full', 'dots', 'dots_no_batch', 'dots_flash'])
def test_remat_policies_match_plain_outputs_and_gradients(policy):
  batch = make_batch()
  plain = models.build(small_config('realformer'), head='encoder')
  remat = models.build(small_config('realformer', remat_policy=policy), head='encoder')
  params = perturbed_params(plain, batch)
  np.testing.assert_allclose(remat.apply({'params': params}, batch).hidden,
                             plain.apply({'params': params}, batch).hidden, rtol=1e-6,
                             atol=1e-6)
  ga, gb = jax.grad(_loss(plain, batch))(params), jax.grad(_loss(remat, batch))(params)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_vocabulary_is_padded_to_128_and_padding_is_never_predicted():
  cfg = small_config('postln', vocab_pad_multiple=128)
  spec = resolve(cfg)
  assert spec.padded_vocab_size == 128 and spec.vocab_size == 50
  batch = make_batch()
  batch['masked_lm_positions'] = jnp.array([[1, 2], [0, 3], [1, 1]], jnp.int32)
  model = models.build(cfg)
  variables = model.init(jax.random.PRNGKey(0), batch)
  table = nn.unbox(variables['params'])['encoder']['embeddings']['word_embeddings']
  assert table['embedding'].shape == (128, 32)
  logits = model.apply(variables, batch).mlm_logits
  assert logits.shape == (3, 2, 128)
  assert float(logits[..., 50:].max()) <= attn_lib.NEG_INF / 2
  assert bool((jax.nn.softmax(logits)[..., 50:] == 0).all())


def test_realformer_carries_float32_scores_under_bfloat16():
  batch = make_batch()
  spec = resolve(small_config('realformer', dtype='bfloat16'))
  block = models.Block(spec)
  x = jnp.ones(batch['input_ids'].shape + (spec.hidden_size,), jnp.bfloat16)
  bias = attn_lib.mask_bias(batch['attention_mask'])
  prev = jnp.zeros((x.shape[0], spec.num_heads, x.shape[1], x.shape[1]), jnp.float32)
  variables = block.init(jax.random.PRNGKey(0), (x, prev), 1, bias)
  (y, scores), _ = block.apply(variables, (x, prev), 1, bias)
  assert y.dtype == jnp.bfloat16 and scores.dtype == jnp.float32
  plain = models.build(small_config('realformer'), head='encoder')
  half = models.build(small_config('realformer', dtype='bfloat16'), head='encoder')
  params = perturbed_params(plain, batch)
  mask = np.asarray(batch['attention_mask'], bool)
  assert_bfloat16_close(half.apply({'params': params}, batch).hidden,
                        plain.apply({'params': params}, batch).hidden, mask)


def test_only_the_word_table_gradient_is_a_scatter_and_it_sums_in_float32():
  """Positions and token types take no gather (their gradient would be a scatter-add whose
  every sequence hits the same rows: most of a BERT-base step on a GPU); words do, and under
  bfloat16 their scatter-add still sums in float32 (a bfloat16 one rounds a frequent token's
  sum at every row and, on a GPU, takes most of the step)."""
  batch = make_batch()
  model = models.build(small_config('postln', dtype='bfloat16'), head='encoder')
  params = perturbed_params(model, batch)
  hlo = jax.jit(jax.grad(_loss(model, batch))).lower(params).as_text()
  scatters = re.split(r'"stablehlo\.scatter"|stablehlo\.scatter\(', hlo)[1:]  # either form
  assert len(scatters) == 1, hlo.count('scatter')
  region = scatters[0][:scatters[0].index('stablehlo.return')]
  assert 'stablehlo.add' in region and 'tensor<f32>' in region and 'bf16' not in region, region
