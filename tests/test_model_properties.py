"""Structural properties of the encoder family: parameter counts against BERT-base and each
Synthesizer's exact additions, input independence of Random attention, and a gradient for
every trainable parameter of every variant."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain
from realformer import models
from realformer.model.spec import resolve
from tests.test_models import VARIANTS, make_batch, perturbed_params, small_config

# Published BERT-base (uncased, vocab 30522) counts, as HF transformers reports them.
BERT_BASE_MODEL = 109_482_240         # BertModel: embeddings + 12 layers + pooler
BERT_BASE_PRETRAINING = 110_106_428   # BertForPreTraining: + MLM transform/bias + NSP


def count_params(model_config, head):
  batch = {k: jnp.zeros((1, 8), jnp.int32) for k in ('input_ids', 'segment_ids',
                                                      'attention_mask')}
  shapes = jax.eval_shape(models.build(model_config, head=head).init, jax.random.PRNGKey(0),
                          batch)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes['params'])))


def base_config(variant, **overrides):
  c = pretrain.get_config(f'{variant},base')
  c.unlock()
  c.model.vocab_size = 30522
  for k, v in overrides.items():
    c.model[k] = v
  return c.model


def test_base_parameter_count_is_bert_base():
  exact = base_config('postln', vocab_pad_multiple=1)
  assert count_params(exact, 'encoder') == BERT_BASE_MODEL
  assert count_params(exact, 'pretraining') == BERT_BASE_PRETRAINING
  padded = base_config('postln')  # vocabulary padded to a multiple of 128 (+70 rows)
  n = count_params(padded, 'pretraining')
  assert abs(n - BERT_BASE_PRETRAINING) / BERT_BASE_PRETRAINING < 0.01
  for variant in ('preln', 'realformer'):
    # Pre-LN adds one final LayerNorm; RealFormer adds nothing.
    extra = 2 * 768 if variant == 'preln' else 0
    assert count_params(base_config(variant, vocab_pad_multiple=1), 'encoder') == (
        BERT_BASE_MODEL + extra)


def synthesizer_addition(variant):
  """Parameters a Synthesizer variant adds over Post-LN per layer, from the paper's shapes."""
  spec = resolve(base_config(variant))
  d, h, n, k = spec.hidden_size, spec.num_heads, spec.max_len, spec.synth_factorized_rank
  a, b = spec.factorized_ab
  per_component = {
      'dot': 0,
      'dense': d * d + d + d * h * n + h * n,       # W1, b1, W2 (per head), b2
      'random': h * n * n,                          # R
      'factorized_dense': d * h * a + h * a + d * h * b + h * b,
      'factorized_random': 2 * h * n * k,           # R1, R2
  }
  added = sum(per_component[c] for c in spec.attention)
  if 'dot' not in spec.attention:
    added -= 2 * (d * d + d)  # no query and key projections
  if len(spec.attention) > 1:
    added += len(spec.attention)  # mixture weights
  return added


@pytest.mark.parametrize('variant', [v for v in VARIANTS if v.startswith('synth_')])
def test_synthesizer_parameter_additions(variant):
  postln = count_params(base_config('postln'), 'encoder')
  ours = count_params(base_config(variant), 'encoder')
  assert ours - postln == 12 * synthesizer_addition(variant)


@pytest.mark.parametrize('variant', ['synth_random', 'synth_random_fixed',
                                     'synth_factorized_random'])
def test_random_attention_does_not_depend_on_the_tokens(variant):
  model = models.build(small_config(variant), head='encoder')
  a, b = make_batch(seed=0), make_batch(seed=1)
  assert not np.array_equal(a['input_ids'], b['input_ids'])
  variables = model.init(jax.random.PRNGKey(0), a)
  out_a = model.apply(variables, a, capture_attention=True)
  out_b = model.apply(variables, b, capture_attention=True)
  for pa, pb in zip(out_a.attention, out_b.attention):
    np.testing.assert_array_equal(pa, pb)
  assert not np.allclose(out_a.hidden, out_b.hidden)  # while the outputs do depend on them


@pytest.mark.parametrize('variant,overrides', [(v, {}) for v in VARIANTS] + [
    ('synth_factorized_random', {'synth_random_trainable': False})])  # (no preset of its own)
def test_every_trainable_parameter_receives_a_gradient(variant, overrides):
  """Every parameter's gradient is far from rounding noise (at least 1e-6 of the largest),
  but for those that get none: a fixed random table's (exactly zero) and the key
  projection's bias (a constant added to every key's score of a query, which softmax
  ignores: zero in exact arithmetic, rounding noise here)."""
  batch = make_batch()
  batch['masked_lm_positions'] = jnp.array([[1, 4], [2, 5], [0, 1]], jnp.int32)
  model = models.build(small_config(variant, **overrides))
  params = perturbed_params(model, batch)  # (at init, a mixture's weights barely matter)
  targets = jnp.array([[7, 8], [9, 10], [11, 12]])

  def loss(p):
    out = model.apply({'params': p}, batch)
    mlm = -jnp.take_along_axis(jax.nn.log_softmax(out.mlm_logits), targets[..., None], -1)
    nsp = -jax.nn.log_softmax(out.nsp_logits)[:, 0]
    return mlm.mean() + nsp.mean()

  grads = jax.tree_util.tree_flatten_with_path(jax.grad(loss)(params))[0]
  fixed = not resolve(small_config(variant, **overrides)).synth_random_trainable
  largest = max(float(jnp.abs(g).max()) for _, g in grads)
  frozen_seen = False
  for path, g in grads:
    name, size = jax.tree_util.keystr(path), float(jnp.abs(g).max())
    if fixed and ('random_logits' in name or 'random_factor' in name):
      assert size == 0.0, name
      frozen_seen = True
    elif name.endswith("['key']['bias']"):
      assert size < 1e-6 * largest, (name, size)
    else:
      assert size > 1e-6 * largest, (name, size)
  assert frozen_seen == fixed
