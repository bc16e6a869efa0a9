"""What a training step keeps for its backward pass on TPUs (encoder.recomputes_elementwise):
the LayerNorms and GELU rematerialised, the hidden dropout's mask drawn again from its key,
and the flash kernels keeping their masks' bits and nothing else [B, H, T, T] but
RealFormer's carry. The same values and gradients as what the CPU keeps, bit for bit, with
fewer residuals (the arrays jax.vjp's closure keeps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realformer import models
from realformer.layers import dropout as dropout_lib
from realformer.model import encoder
from realformer.model.spec import resolve
from tests.test_models import make_batch, perturbed_params, small_config


def _residual_shapes(f, *args):
  """(shape, dtype) of each array the backward of f keeps: the leaves of its VJP closure."""
  _, vjp = jax.vjp(f, *args)
  return [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(vjp)]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_redrawn_dropout_keeps_only_its_key(dtype):
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 64)).astype(dtype)
  w = jax.random.normal(jax.random.PRNGKey(1), x.shape)
  rngs = {'dropout': jax.random.PRNGKey(2)}

  def loss(redraw):
    return lambda x: jnp.sum(dropout_lib.Dropout(0.3, redraw=redraw).apply(
        {}, x, False, rngs=rngs).astype(jnp.float32) * w)

  kept, redrawn = loss(False), loss(True)
  np.testing.assert_array_equal(redrawn(x), kept(x))
  np.testing.assert_array_equal(jax.grad(redrawn)(x), jax.grad(kept)(x))
  assert ((4, 8, 64), 'bool') in _residual_shapes(kept, x)
  assert ((4, 8, 64), 'bool') not in _residual_shapes(redrawn, x)
  # beside the loss's own weights, at most the key
  assert len(_residual_shapes(redrawn, x)) < len(_residual_shapes(kept, x))


def test_on_tpus_the_layer_recomputes_its_elementwise_work_with_the_same_numbers():
  """A Post-LN model specified for a TPU, run on this CPU (flax's dense layers and the plain
  attention path on both sides, float32, no attention dropout: the Mosaic kernel's own tests
  are tests/test_flash_variants.py): the same hidden states and parameter gradients under
  dropout as the CPU's model, bit for bit, keeping fewer float32 [B, T, D] arrays and no
  boolean mask of the hidden dropout."""
  cfg = small_config('postln', dense_impl='flax', attention_dropout_rate=0.0, dropout_rate=0.1)
  cpu, tpu = (resolve(cfg, platform=p) for p in ('cpu', 'tpu'))
  assert not encoder.recomputes_elementwise(cpu) and encoder.recomputes_elementwise(tpu)
  assert not encoder.recomputes_elementwise(resolve(cfg, platform='gpu'))
  batch = make_batch()
  ours = {p: models.build(resolve(cfg, platform=p), head='encoder') for p in ('cpu', 'tpu')}
  params = perturbed_params(ours['cpu'], batch)
  rngs = {'dropout': jax.random.PRNGKey(5)}

  def loss(model):
    return lambda p: jnp.sum(model.apply({'params': p}, batch, deterministic=False,
                                         rngs=rngs).hidden ** 2)

  for f in (lambda m: loss(m)(params), lambda m: jax.grad(loss(m))(params)):
    for a, b in zip(jax.tree.leaves(f(ours['cpu'])), jax.tree.leaves(f(ours['tpu']))):
      np.testing.assert_array_equal(b, a)
  b, t = batch['input_ids'].shape
  hidden = ((b, t, cfg.hidden_size), 'float32')
  kept = {p: _residual_shapes(loss(m), params) for p, m in ours.items()}
  assert kept['tpu'].count(hidden) < kept['cpu'].count(hidden)
  # one boolean mask per hidden dropout fewer: the embeddings' and two in each layer
  mask = ((b, t, cfg.hidden_size), 'bool')
  assert kept['cpu'].count(mask) - kept['tpu'].count(mask) == 1 + 2 * cfg.num_layers


@pytest.mark.parametrize('policy', ['dots', 'full', 'dots_flash'])
def test_under_a_remat_policy_a_tpus_layer_recomputes_as_a_gpus_does(policy):
  """Under model.remat_policy the layer's recomputed forward computes the LayerNorms, GELU and
  the masks again; a TPU's model does not rematerialise them inside it as well (a third
  LayerNorm, a third draw of each mask): its gradient computes as many LayerNorms (rsqrt)
  and draws as many masks (threefry2x32) as a GPU's, at most twice the forward's."""
  from tests.test_flash_variants import _runs  # pylint: disable=g-import-not-at-top
  cfg = small_config('postln', dense_impl='flax', fused_attention='off',
                     attention_dropout_rate=0.1, dropout_rate=0.1, remat_policy=policy)
  batch = make_batch()
  counts = {}
  for platform in ('gpu', 'tpu'):
    spec = resolve(cfg, platform=platform)
    assert not encoder.recomputes_elementwise(spec)
    model = models.build(spec, head='encoder')
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch))['params']  # pylint: disable=cell-var-from-loop
    loss = lambda p: jnp.sum(model.apply({'params': p}, batch, deterministic=False,  # pylint: disable=cell-var-from-loop
                                         rngs={'dropout': jax.random.PRNGKey(1)}).hidden ** 2)
    grad, forward = jax.make_jaxpr(jax.grad(loss))(params), jax.make_jaxpr(loss)(params)
    counts[platform] = [(_runs(grad, p), _runs(forward, p)) for p in ('rsqrt', 'threefry2x32')]
  assert counts['tpu'] == counts['gpu']
  for in_grad, in_forward in counts['tpu']:
    assert in_forward <= in_grad <= 2 * in_forward


@pytest.mark.parametrize('rate,t', [(0.0, 40), (0.1, 40), (0.1, 200)])
@pytest.mark.parametrize('with_term', [False, True])
def test_the_mosaic_kernels_keep_the_masks_bits_and_no_probabilities(rate, t, with_term):
  """What the TPU kernels' backward keeps (Pallas's interpreter): under dropout, the keep
  bits of each threefry block (four keys) that the forward drew, four blocks an int32 at
  128-key tiles ([B, H, Tq / 16, Tk] at whole tiles), eight at 256 ([B, H, Tq / 32, Tk]),
  and nothing else [B, H, Tq, Tk] but the term (RealFormer's previous scores); without
  dropout no bits. The backward kernels read the bits, not the key: the
  gradients are those of keep_mask's mask (tests/test_flash_variants.py)."""
  from realformer.layers import flash_attention_tpu  # pylint: disable=g-import-not-at-top
  b, h, d = 2, 2, 16
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, t, h, d)) for i in range(3))
  term = jax.random.normal(jax.random.PRNGKey(3), (b, h, t, t)) if with_term else None
  bias = jnp.zeros((b, t), jnp.float32)

  def loss(q, k, v, term):
    out = flash_attention_tpu.flash_attention(
        q, k, v, bias, term=term, dropout_rate=rate, dropout_key=jnp.array([1, 2], jnp.uint32),
        interpret=True)
    return out.sum()

  kept = _residual_shapes(loss, q, k, v, term)
  tile = flash_attention_tpu.tile_for(t, t)
  rows = tile // (16 if tile == 128 else 32)
  bits = [s for s in kept if s[1] == 'int32' and len(s[0]) == 4]
  assert bits == ([((b, h, rows, tile), 'int32')] if rate else [])
  pairs = [s for s in kept if s[0][-2:] in ((t, t), (tile, tile))]
  assert pairs == ([((b, h, t, t), 'float32')] if with_term else [])


def test_realformers_first_layer_keeps_no_carry_through_the_flash_kernel():
  """Unscanned, RealFormer's first layer reads no previous scores: through the flash kernel
  (Triton's, in Pallas's interpreter) it keeps nothing [B, H, T, T] for its backward, and
  each later layer keeps the one carry it reads (a carry of zeros was built, kept and read
  at the first)."""
  batch = make_batch()
  b, t = batch['input_ids'].shape
  rngs = {'dropout': jax.random.PRNGKey(5)}
  for layers in (1, 2):
    cfg = small_config('realformer', fused_attention='flash', attention_dropout_rate=0.1,
                       dropout_rate=0.0, num_layers=layers)
    model = models.build(cfg, head='encoder')
    params = perturbed_params(model, batch)
    loss = lambda p, model=model: jnp.sum(model.apply(
        {'params': p}, batch, deterministic=False, rngs=rngs).hidden ** 2)
    carries = [s for s in _residual_shapes(loss, params)
               if len(s[0]) == 4 and s[0][:2] == (b, cfg.num_heads) and s[1] == 'float32']
    assert len(carries) == layers - 1, (layers, carries)
