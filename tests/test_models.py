"""Every encoder variant against the independent NumPy reference (tests/reference.py),
plus the structural properties the papers imply: padding invariance, RealFormer's residual
scores, scan == unrolled, the fused path == the plain path, dtype policy, sharded init."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain
from realformer import models
from realformer.model.spec import resolve
from realformer.train import partitioning
from tests import reference

VARIANTS = pretrain.VARIANTS
LENGTHS = (12, 7, 3)  # real tokens per row; the rest is padding


def small_config(variant, **overrides):
  c = pretrain.get_config(f'{variant},tiny')
  c.unlock()
  m = c.model
  m.num_layers, m.hidden_size, m.num_heads, m.mlp_dim = 3, 32, 4, 64
  m.vocab_size, m.vocab_pad_multiple, m.max_len = 50, 16, 24
  m.synth_factorized_rank = 3
  for k, v in overrides.items():
    m[k] = v
  return m


def make_batch(t=12, lengths=LENGTHS, seed=0):
  rng = np.random.default_rng(seed)
  b = len(lengths)
  mask = (np.arange(t)[None] < np.array(lengths)[:, None]).astype(np.int32)
  ids = rng.integers(5, 50, (b, t)) * mask
  seg = ((np.arange(t)[None] >= np.array(lengths)[:, None] // 2) * mask).astype(np.int32)
  return {'input_ids': jnp.asarray(ids, jnp.int32), 'segment_ids': jnp.asarray(seg),
          'attention_mask': jnp.asarray(mask)}


def perturbed_params(model, batch, seed=0):
  """Initialised params plus noise, so biases, LayerNorms and mixtures are non-trivial."""
  params = nn.unbox(model.init(jax.random.PRNGKey(seed), batch)['params'])
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  leaves = [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, leaves)


def assert_bfloat16_close(got, want, mask):
  """bfloat16 hidden states `got` against float32 `want` at the real positions: within 2% in
  norm (bfloat16's rounding of this model with perturbed params: 0.7%; RealFormer's residual
  attention moves Post-LN's by about 5%, so a bug of that size shows)."""
  got, want = (np.asarray(x, np.float64)[np.asarray(mask, bool)] for x in (got, want))
  assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want), (
      np.linalg.norm(got - want) / np.linalg.norm(want))


def np_batch(batch):
  return {k: np.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize('variant', VARIANTS)
def test_variant_matches_numpy_reference(variant):
  cfg = small_config(variant)
  spec = resolve(cfg)
  model = models.build(cfg)
  batch = make_batch()
  positions = jnp.array([[0, 3, 11], [1, 2, 6], [0, 1, 2]], jnp.int32)
  params = perturbed_params(model, batch)
  out = model.apply({'params': params}, dict(batch, masked_lm_positions=positions),
                    capture_attention=True)
  b = np_batch(batch)
  hidden, probs, _, _ = reference.encoder(params['encoder'], spec, b['input_ids'],
                                          b['segment_ids'], b['attention_mask'])
  np.testing.assert_allclose(out.hidden, hidden, rtol=2e-4, atol=2e-4)
  for got, want in zip(out.attention, probs):
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=2e-5)
  np.testing.assert_allclose(out.pooled, reference.pooled(params['encoder'], hidden), atol=2e-4)
  want_mlm = reference.mlm_logits(params, spec, hidden, np.asarray(positions))
  np.testing.assert_allclose(out.mlm_logits[..., :spec.vocab_size],
                             want_mlm[..., :spec.vocab_size], rtol=2e-4, atol=2e-4)
  assert np.all(np.asarray(out.mlm_logits[..., spec.vocab_size:]) < -1e8)


@pytest.mark.parametrize('overrides', [
    {'variant': 'preln', 'residual_attention': True},
    {'variant': 'realformer', 'running_mean': True},
    {'variant': 'postln', 'attention': 'factorized_random+dot'},
    {'variant': 'postln', 'attention': 'dense+random+dot'},
    {'variant': 'synth_factorized_dense', 'synth_factorized_a': 6},
])
def test_config_combinations_match_reference(overrides):
  cfg = small_config(**overrides)
  spec = resolve(cfg)
  model = models.build(cfg, head='encoder')
  batch = make_batch()
  params = perturbed_params(model, batch)
  out = model.apply({'params': params}, batch, capture_attention=True)
  b = np_batch(batch)
  hidden, probs, _, _ = reference.encoder(params, spec, b['input_ids'], b['segment_ids'],
                                          b['attention_mask'])
  np.testing.assert_allclose(out.hidden, hidden, rtol=2e-4, atol=2e-4)
  for got, want in zip(out.attention, probs):
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=2e-5)


def test_tanh_gelu_matches_reference_and_differs_from_erf():
  """model.gelu=tanh (the official RealFormer code's GELU) in the MLP and the MLM head, against
  the reference; the two forms differ by more than the tolerance, so the test can tell."""
  batch = make_batch()
  positions = jnp.array([[0, 3, 11], [1, 2, 6], [0, 1, 2]], jnp.int32)
  b = np_batch(batch)
  outs = {}
  for form in ('erf', 'tanh'):
    cfg = small_config('realformer', gelu=form)
    spec = resolve(cfg)
    model = models.build(cfg)
    params = perturbed_params(model, batch)
    out = model.apply({'params': params}, dict(batch, masked_lm_positions=positions))
    hidden = reference.encoder(params['encoder'], spec, b['input_ids'], b['segment_ids'],
                               b['attention_mask'])[0]
    np.testing.assert_allclose(out.hidden, hidden, rtol=2e-4, atol=2e-4)
    want = reference.mlm_logits(params, spec, hidden, np.asarray(positions))
    np.testing.assert_allclose(out.mlm_logits[..., :spec.vocab_size],
                               want[..., :spec.vocab_size], rtol=2e-4, atol=2e-4)
    outs[form] = np.asarray(out.mlm_logits[..., :spec.vocab_size]), want[..., :spec.vocab_size]
  # Each model is outside the tolerance of the other form's reference.
  assert not np.allclose(outs['erf'][0], outs['tanh'][1], rtol=2e-4, atol=2e-4)
  assert not np.allclose(outs['tanh'][0], outs['erf'][1], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('variant', VARIANTS)
def test_padding_does_not_change_real_positions(variant):
  cfg = small_config(variant)
  model = models.build(cfg, head='encoder')
  short = make_batch(t=8, lengths=(8, 5, 2))
  params = perturbed_params(model, short)
  long = {k: jnp.pad(v, ((0, 0), (0, 9))) for k, v in short.items()}  # 9 more pads
  a = model.apply({'params': params}, short, capture_attention=True)
  b = model.apply({'params': params}, long, capture_attention=True)
  mask = np.asarray(short['attention_mask'], bool)
  np.testing.assert_allclose(np.asarray(b.hidden)[:, :8][mask], np.asarray(a.hidden)[mask],
                             rtol=1e-5, atol=1e-5)
  for pa, pb in zip(a.attention, b.attention):
    np.testing.assert_allclose(pb[:, :, :8, :8], pa, atol=1e-6)
    assert float(jnp.abs(pb[:, :, :, 8:]).max()) == 0.0  # no weight on the added pads


def test_realformer_one_layer_equals_postln():
  batch = make_batch()
  rf = models.build(small_config('realformer', num_layers=1), head='encoder')
  pl = models.build(small_config('postln', num_layers=1), head='encoder')
  params = perturbed_params(rf, batch)
  np.testing.assert_array_equal(rf.apply({'params': params}, batch).hidden,
                                pl.apply({'params': params}, batch).hidden)


def test_realformer_logits_are_the_sum_of_own_scores():
  cfg = small_config('realformer')
  spec = resolve(cfg)
  rf, pl = models.build(cfg, head='encoder'), models.build(small_config('postln'), head='encoder')
  batch = make_batch()
  params = perturbed_params(rf, batch)
  out_rf = rf.apply({'params': params}, batch, capture_attention=True)
  out_pl = pl.apply({'params': params}, batch)
  assert float(jnp.abs(out_rf.hidden - out_pl.hidden).max()) > 1e-3  # more layers: differs
  b = np_batch(batch)
  _, _, own, carried = reference.encoder(params, spec, b['input_ids'], b['segment_ids'],
                                         b['attention_mask'])
  bias = np.where(b['attention_mask'][:, None, None, :] > 0, 0.0, reference.NEG)
  for l, probs in enumerate(out_rf.attention):
    total = sum(own[: l + 1])  # layer l's logits: sum of the layers' own scaled scores
    np.testing.assert_allclose(carried[l], total, rtol=1e-12)
    np.testing.assert_allclose(probs, reference.softmax(total + bias), atol=2e-5)


def test_realformer_carries_its_raw_scores_unmasked_and_undivided():
  """The scores a RealFormer layer passes on (the official residual_attention_layer's `cur`):
  its own Q K^T / sqrt(d) plus the incoming scores, at every key including padding (the mask
  is added after), and not divided by the running mean's layer count (only the softmax's
  logits are)."""
  from realformer.model import attention as attn_lib  # pylint: disable=g-import-not-at-top
  spec = resolve(small_config('realformer', running_mean=True))
  layer = attn_lib.SelfAttention(spec)
  rng = np.random.default_rng(0)
  b, t, h = 2, 6, spec.num_heads
  x = jnp.asarray(rng.normal(size=(b, t, spec.hidden_size)), jnp.float32)
  bias = attn_lib.mask_bias(jnp.asarray([[1] * 6, [1] * 4 + [0] * 2]))
  prev = jnp.asarray(rng.normal(size=(b, h, t, t)), jnp.float32)
  params = nn.unbox(layer.init(jax.random.PRNGKey(0), x, bias, prev, 2)['params'])
  params = jax.tree.map(lambda p: p + 0.1 * jnp.asarray(rng.normal(size=p.shape), p.dtype),
                        params)  # (biases not zero)
  _, carry, _ = layer.apply({'params': params}, x, bias, prev, 2)
  heads = lambda name: (np.asarray(x, np.float64) @ np.asarray(params[name]['kernel'])
                        + np.asarray(params[name]['bias'])).reshape(b, t, h, spec.head_dim)
  own = np.einsum('bqhd,bkhd->bhqk', heads('query'), heads('key')) / np.sqrt(spec.head_dim)
  np.testing.assert_allclose(carry, own + np.asarray(prev), rtol=2e-5, atol=2e-5)


def _stack_layers(params, n):
  enc = dict(params)
  layers = [enc.pop(f'layers_{i}') for i in range(n)]
  enc['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return enc


@pytest.mark.parametrize('variant,remat,running_mean', [
    ('realformer', 'none', True), ('realformer', 'dots', False), ('preln', 'dots', True),
    ('synth_random_vanilla', 'full', True), ('synth_dense_vanilla', 'full', False)])
def test_scan_and_remat_equal_unrolled(variant, remat, running_mean):
  """Scanned layers (remat none, dots and full) compute the unrolled stack's hidden states,
  attention probabilities and gradients, RealFormer's scores carried with and without the
  running mean."""
  batch = make_batch()
  unrolled = models.build(small_config(variant, running_mean=running_mean), head='encoder')
  scanned = models.build(small_config(variant, running_mean=running_mean, scan_layers=True,
                                      remat_policy=remat), head='encoder')
  params = perturbed_params(unrolled, batch)
  stacked = _stack_layers(params, 3)
  shapes = jax.tree.map(jnp.shape, nn.unbox(scanned.init(jax.random.PRNGKey(0), batch)['params']))
  assert jax.tree.map(jnp.shape, stacked) == shapes
  a = unrolled.apply({'params': params}, batch, capture_attention=True)
  b = scanned.apply({'params': stacked}, batch, capture_attention=True)
  np.testing.assert_allclose(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)
  for pa, pb in zip(a.attention, b.attention):
    np.testing.assert_allclose(pb, pa, atol=1e-6)

  def loss(p, m):  # gradients agree too (remat recomputes, scan carries the scores)
    return jnp.sum(m.apply({'params': p}, batch).hidden ** 2)
  ga = _stack_layers(jax.grad(loss)(params, unrolled), 3)
  gb = jax.grad(loss)(stacked, scanned)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_fused_attention_path_matches_plain():
  batch = make_batch()
  plain = models.build(small_config('postln', fused_attention='off'), head='encoder')
  fused = models.build(small_config('postln', fused_attention='xla'), head='encoder')
  params = perturbed_params(plain, batch)
  a = plain.apply({'params': params}, batch)
  b = fused.apply({'params': params}, batch)
  np.testing.assert_allclose(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('variant', ['postln', 'realformer', 'synth_dense_vanilla'])
def test_bfloat16_compute_keeps_float32_params_and_softmax(variant):
  batch = make_batch()
  f32 = models.build(small_config(variant), head='encoder')
  bf16 = models.build(small_config(variant, dtype='bfloat16'), head='encoder')
  variables = bf16.init(jax.random.PRNGKey(0), batch)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(variables)))
  variables = {'params': perturbed_params(bf16, batch)}
  a = f32.apply(variables, batch, capture_attention=True)
  b = bf16.apply(variables, batch, capture_attention=True)
  assert b.hidden.dtype == jnp.bfloat16 and b.attention[0].dtype == jnp.float32
  assert_bfloat16_close(b.hidden, a.hidden, batch['attention_mask'])


def test_fully_padded_row_stays_finite():
  model = models.build(small_config('realformer'), head='encoder')
  batch = make_batch(lengths=(12, 0, 3))
  out = model.apply(model.init(jax.random.PRNGKey(0), batch), batch, capture_attention=True)
  assert bool(jnp.isfinite(out.hidden).all())
  assert all(bool(jnp.isfinite(p).all()) for p in out.attention)


@pytest.mark.parametrize('offset', [0.0, 1e3, 4e3])
def test_layer_norm_is_exact_for_rows_with_a_large_mean(offset):
  """The variance in two passes: E[x^2] - E[x]^2 in float32 loses every digit of a row with
  mean 4000 and spread 1 (and gave 3.9e6 there, the variance clipped to 0 over sqrt(1e-12))."""
  from realformer.model.encoder import layer_norm  # pylint: disable=g-import-not-at-top
  spec = resolve(small_config('postln'))
  x = offset + np.random.default_rng(0).normal(size=(4, spec.hidden_size))
  ln = layer_norm(spec, 'ln')
  params = ln.init(jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32))
  got = np.asarray(ln.apply(params, jnp.asarray(x, jnp.float32)))
  want = reference.layer_norm(x, {'scale': 1.0, 'bias': 0.0}, spec.layer_norm_eps)
  np.testing.assert_allclose(got, want, atol=2e-3)


def test_sequence_longer_than_max_len_is_a_clear_error():
  for variant in ('postln', 'synth_random'):
    model = models.build(small_config(variant), head='encoder')
    batch = make_batch(t=30, lengths=(30, 5, 5))
    with pytest.raises(ValueError, match='exceeds model.max_len=24'):
      model.init(jax.random.PRNGKey(0), batch)


def test_a_fixed_random_table_gets_no_gradient_and_the_mixture_weights_do():
  """(That the mixture weights are a softmax over the components: the float64 reference
  tests above.)"""
  batch = make_batch()
  model = models.build(small_config('synth_random_fixed', attention='random+dot'),
                       head='encoder')
  params = nn.unbox(model.init(jax.random.PRNGKey(0), batch)['params'])
  grads = jax.grad(lambda p: jnp.sum(model.apply({'params': p}, batch).hidden ** 2))(params)
  att = grads['layers_0']['attention']
  assert float(jnp.abs(att['synth_random']['random_logits']).max()) == 0.0
  assert float(jnp.abs(att['mixture_logits']).max()) > 0.0


def test_config_errors_are_clear():
  with pytest.raises(ValueError, match='unknown variant'):
    pretrain.get_config('realformr,base')
  with pytest.raises(ValueError, match='unknown size'):
    pretrain.get_config('realformer,huge')
  c = pretrain.get_config('realformer,base')
  with pytest.raises(AttributeError):
    c.model.hidden_sise = 3  # the config is locked: a misspelt key is an error
  with pytest.raises(ValueError, match='model.attention'):
    resolve(small_config('postln', attention='dot+rnadom'))
  with pytest.raises(ValueError, match='does not divide model.max_len'):
    resolve(small_config('synth_factorized_dense', synth_factorized_a=5))
  with pytest.raises(ValueError, match=r"model.block='no_such_block'; choose one of post_ln, "
                                       r'pre_ln \(or one of your own: realformer/model/'
                                       r'blocks.py\)'):
    resolve(small_config('postln', block='no_such_block'))
  # ... also for a spec made without resolve: never a KeyError, nor another block's layer.
  spec = dataclasses.replace(resolve(small_config('postln')), block='no_such_block')
  with pytest.raises(ValueError, match=r"model.block='no_such_block'; choose one of"):
    models.build(spec, head='encoder').init(jax.random.PRNGKey(0), make_batch())


@pytest.mark.parametrize('size,expected', [('small', (4, 512, 8, 2048)),
                                           ('base', (12, 768, 12, 3072)),
                                           ('large', (24, 1024, 16, 4096)),
                                           ('xlarge', (36, 1536, 24, 6144))])
def test_sizes_are_the_papers(size, expected):
  for variant in VARIANTS:
    m = pretrain.get_config(f'{variant},{size}').model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.mlp_dim) == expected
    resolve(m)


def test_sharded_init_and_apply_equal_single_device():
  cfg = small_config('synth_random_vanilla', scan_layers=True)
  model = models.build(cfg)
  batch = make_batch(lengths=(12, 7, 3, 9, 1, 12, 4, 8))
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  with partitioning.traced_on(mesh):
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch))
    shardings = partitioning.logical_to_sharding(abstract, mesh)
    variables = jax.jit(lambda r: model.init(r, batch), out_shardings=shardings)(
        jax.random.PRNGKey(0))
    kernel = variables['params']['encoder']['layers']['attention']['query']['kernel'].value
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor')
    sharded = jax.jit(lambda v, b: model.apply(v, b).hidden)(variables, batch)
  single = model.apply(jax.device_get(nn.unbox(variables)), batch).hidden
  np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)


def test_realformer_bfloat16_carry_is_close_to_float32_and_carried_in_bfloat16():
  batch = make_batch()
  f32 = models.build(small_config('realformer'), head='encoder')
  bf16 = models.build(small_config('realformer', residual_dtype='bfloat16'), head='encoder')
  scanned = models.build(small_config('realformer', residual_dtype='bfloat16',
                                      scan_layers=True), head='encoder')
  params = perturbed_params(f32, batch)
  a = f32.apply({'params': params}, batch, capture_attention=True)
  b = bf16.apply({'params': params}, batch, capture_attention=True)
  np.testing.assert_array_equal(b.attention[0], a.attention[0])  # layer 0 carries nothing in
  assert float(jnp.abs(b.attention[-1] - a.attention[-1]).max()) > 0  # rounding shows later
  for pa, pb in zip(a.attention, b.attention):
    np.testing.assert_allclose(pb, pa, atol=2e-2)
  np.testing.assert_allclose(b.hidden, a.hidden, atol=5e-2)
  # The carried scores really are bfloat16: in a float32 model nothing else of shape
  # [B, H, T, T] is (the scanned stack's carry, in its jaxpr).
  jaxpr = str(jax.make_jaxpr(lambda p: scanned.apply({'params': p}, batch).hidden)(
      _stack_layers(params, 3)))
  t = batch['input_ids'].shape[1]
  assert f'bf16[3,4,{t},{t}]' in jaxpr
  scanned_f32 = models.build(small_config('realformer', scan_layers=True), head='encoder')
  assert f'bf16[3,4,{t},{t}]' not in str(jax.make_jaxpr(
      lambda p: scanned_f32.apply({'params': p}, batch).hidden)(_stack_layers(params, 3)))
  c = scanned.apply({'params': _stack_layers(params, 3)}, batch)
  np.testing.assert_allclose(c.hidden, b.hidden, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='residual_dtype'):
    resolve(small_config('realformer', residual_dtype='float16'))


def test_every_preset_is_named_where_users_read_the_list():
  """realformer/model/spec.py's VARIANTS is the one list; the README's variant table and
  configs/pretrain.py's docstring name each preset for the reader, and fall behind silently
  without this."""
  import os  # pylint: disable=g-import-not-at-top
  readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             'README.md'), encoding='utf-8').read()
  table = readme[:readme.index('Sizes:')]
  for variant in pretrain.VARIANTS:
    assert f'`{variant}`' in table, variant
    assert variant in pretrain.__doc__, variant


def test_the_name_and_summary_say_whether_a_random_table_trains():
  """A run's name is what its encoder computes: a synth_random with its table fixed is not
  synth_random (nor synth_random_fixed with its table trained), which the warning on an
  init_checkpoint of another variant and the launch check's header read."""
  assert resolve(small_config('synth_random')).name == 'synth_random'
  assert resolve(small_config('synth_random_fixed')).name == 'synth_random_fixed'
  fixed = resolve(small_config('synth_random', synth_random_trainable=False))
  assert fixed.name == 'synth_random (attention random, fixed random table, post_ln)'
  assert 'attention random, random table fixed,' in fixed.summary
  trained = resolve(small_config('synth_random_fixed', synth_random_trainable=True))
  assert trained.name == 'synth_random_fixed (attention random, trained random table, post_ln)'
  assert 'table fixed' not in trained.summary
  assert resolve(small_config('postln', synth_random_trainable=False)).name == 'postln'
  assert (resolve(small_config('postln', attention='factorized_random+dot',
                               synth_random_trainable=False)).name ==
          'postln (attention factorized_random+dot, fixed random table, post_ln)')
