"""realformer.layers.flash_attention (model.fused_attention=flash): its threefry is jax's; the
kernel (Pallas's interpreter on CPU) matches a float64 reference that drops keep_mask's mask,
outputs and gradients; inside the model it gives the plain path's outputs and gradients with
attention dropout, sharded or not; and it lowers to Triton for CUDA from this CPU machine."""


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.extend.random import threefry2x32_p

from realformer import models
from realformer.layers import dropout as dropout_lib
from realformer.layers import flash_attention as flash_lib
from realformer.layers import flash_attention_tpu as flash_tpu_lib
from realformer.model import attention as attn_lib
from realformer.finetune import task as finetune_task
from realformer.model.spec import resolve
from realformer.train import partitioning
from realformer.train import pretraining
from tests.test_models import make_batch, perturbed_params, small_config
from tests.test_train import tiny_config


def test_threefry_in_integer_ops_is_jaxs():
  rng = np.random.default_rng(0)
  for _ in range(3):
    k0, k1 = (jnp.uint32(v) for v in rng.integers(0, 2 ** 32, 2))
    x0, x1 = (jnp.asarray(rng.integers(0, 2 ** 32, 64), jnp.uint32) for _ in range(2))
    want = threefry2x32_p.bind(k0, k1, x0, x1)
    for g, w in zip(flash_lib.threefry2x32(k0, k1, x0, x1), want):
      np.testing.assert_array_equal(g, w)
    # In int32, as Mosaic computes it: the same bits.
    signed = (jax.lax.bitcast_convert_type(x, jnp.int32) for x in (k0, k1, x0, x1))
    for g, w in zip(flash_lib.threefry2x32(*signed), want):
      np.testing.assert_array_equal(jax.lax.bitcast_convert_type(g, jnp.uint32), w)


B, T, H, D = 3, 32, 2, 16
LENGTHS = (32, 19, 6)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, w = (rng.normal(size=(B, T, H, D)) for _ in range(4))
  real = np.arange(T)[None] < np.array(LENGTHS)[:, None]
  bias = np.where(real, 0.0, attn_lib.NEG_INF)
  return q, k, v, w, bias


def _reference(q, k, v, bias, keep, scale):
  """float64: softmax(q k^T / sqrt(D) + bias), dropped where keep is False, times v."""
  s = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) + bias[:, None, None, :]
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  if keep is not None:
    p = np.where(keep, p * scale, 0.0)
  return np.einsum('bhqk,bkhd->bqhd', p, v)


@pytest.mark.parametrize('rate', [0.0, 0.1, 0.5])
def test_kernel_matches_a_float64_reference_with_keep_masks_mask(rate):
  q, k, v, w, bias = _inputs()
  key = jax.random.PRNGKey(11)
  keep, scale = (None, None) if rate == 0 else dropout_lib.keep_mask(key, rate, (B, H, T, T))
  keep = None if keep is None else np.asarray(keep)

  def ours(q, k, v):
    out = flash_lib.flash_attention(q, k, v, jnp.asarray(bias, jnp.float32), dropout_rate=rate,
                                    dropout_key=key, interpret=True,
                                    tilings=flash_lib.Tilings.same(8, 2))
    return out, jnp.sum(out * jnp.asarray(w, jnp.float32))

  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
  out, _ = ours(*f32)
  np.testing.assert_allclose(out, _reference(q, k, v, bias, keep, scale), atol=2e-6)
  grads = jax.grad(lambda *a: ours(*a)[1], argnums=(0, 1, 2))(*f32)
  with jax.enable_x64():
    def ref_loss(q, k, v):
      s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) + bias[:, None, None, :]
      p = jax.nn.softmax(s, axis=-1)
      if keep is not None:
        p = jnp.where(keep, p * scale, 0.0)
      return jnp.sum(jnp.einsum('bhqk,bkhd->bqhd', p, v) * w)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, want):
      np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(r), atol=1e-5)
  if rate:  # the mask did act: without it the output differs
    assert not np.allclose(out, _reference(q, k, v, bias, None, None), atol=1e-3)


def test_a_sequence_without_real_keys_averages_its_values_like_the_plain_path():
  """Its row max is about -1e9, where float32 cannot hold max + log(sum): the backward's
  probabilities must still be 1 / Tk, as the plain path's (float32) are."""
  q, k, v, w, bias = _inputs(2)
  bias[1] = attn_lib.NEG_INF
  q, k, v, w, bias = (jnp.asarray(x, jnp.float32) for x in (q, k, v, w, bias))
  key = jax.random.PRNGKey(1)
  flash = lambda q, k, v, rate: flash_lib.flash_attention(
      q, k, v, bias, dropout_rate=rate, dropout_key=key, interpret=True)

  def plain(q, k, v, rate):
    p = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D)
                       + bias[:, None, None], -1)
    if rate:
      keep, scale = dropout_lib.keep_mask(key, rate, p.shape)
      p = jnp.where(keep, p * scale, 0.0)
    return jnp.einsum('bhqk,bkhd->bqhd', p, v)

  out = flash(q, k, v, 0.0)
  np.testing.assert_allclose(out[1], np.broadcast_to(v[1].mean(0), out[1].shape), atol=1e-6)
  for rate in (0.0, 0.1):
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, rate) * w)
    for g, r in zip(jax.grad(loss(flash), (0, 1, 2))(q, k, v),
                    jax.grad(loss(plain), (0, 1, 2))(q, k, v)):
      np.testing.assert_allclose(g, r, atol=1e-5)


def test_lengths_that_fill_no_block_are_padded_and_drop_keep_masks_mask():
  """13 queries against 13 keys (the last block of threefry words half used), and a block
  size larger than the sequence: the padding changes neither the values nor the mask."""
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 13, 2, 8)) for _ in range(3))
  bias = np.where(np.arange(13)[None] < np.array([[13], [9]]), 0.0, attn_lib.NEG_INF)
  key = jax.random.PRNGKey(2)
  keep, scale = dropout_lib.keep_mask(key, 0.25, (2, 2, 13, 13))
  s = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(8) + bias[:, None, None, :]
  p = np.exp(s - s.max(-1, keepdims=True))
  p = np.where(np.asarray(keep), p / p.sum(-1, keepdims=True) * scale, 0.0)
  want = np.einsum('bhqk,bkhd->bqhd', p, v)
  for tilings in (None, flash_lib.Tilings.same(16, 2)):
    out = flash_lib.flash_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                    jnp.asarray(bias, jnp.float32), dropout_rate=0.25,
                                    dropout_key=key, interpret=True, tilings=tilings)
    np.testing.assert_allclose(out, want, atol=2e-6)


@pytest.mark.parametrize('length,real,heads,blocks', [
    (128, 100, 2, (64, 32, 32, 16)),  # no padding; dQ at 4 x 16 keys a step, the others 4 x 32
    (100, 90, 1, (16, 32, 32, 16)),  # queries padded to 112 (16 a step), keys to 128
])
def test_default_tilings_give_the_plain_paths_values_and_gradients(length, real, heads, blocks):
  """The default tilings (block_q; forward's, dK/dV's and dQ's block_c): value and gradients
  as jax's of the plain computation with keep_mask's mask."""
  rng = np.random.default_rng(length)
  q, k, v, w = (jnp.asarray(rng.normal(size=(1, length, heads, 16)), jnp.float32)
                for _ in range(4))
  bias = jnp.where(jnp.arange(length)[None] < real, 0.0, attn_lib.NEG_INF)
  key = jax.random.PRNGKey(9)
  tilings = flash_lib.default_tilings(length, length)
  assert (tilings.block_q, tilings.forward.block_c, tilings.dkv.block_c,
          tilings.dq.block_c) == blocks

  def plain(q, k, v):
    p = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) / 4.0 + bias[:, None, None], -1)
    keep, scale = dropout_lib.keep_mask(key, 0.1, p.shape)
    return jnp.sum(jnp.einsum('bhqk,bkhd->bqhd', jnp.where(keep, p * scale, 0.0), v) * w)

  flash = lambda q, k, v: jnp.sum(flash_lib.flash_attention(
      q, k, v, bias, dropout_rate=0.1, dropout_key=key, interpret=True) * w)
  np.testing.assert_allclose(flash(q, k, v), plain(q, k, v), rtol=1e-5)
  for g, r in zip(jax.grad(flash, (0, 1, 2))(q, k, v), jax.grad(plain, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, r, atol=1e-5)


def test_in_bfloat16_within_rounding_of_the_plain_path():
  """bfloat16 inputs, as the GPU runs: the plain path's computation (float32 softmax and
  dropout, probabilities rounded to bfloat16 before P V) against the kernel's."""
  q, k, v, w, bias = _inputs(5)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  bias, w = jnp.asarray(bias, jnp.float32), jnp.asarray(w, jnp.float32)
  key = jax.random.PRNGKey(6)

  def plain(q, k, v):
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    p = jax.nn.softmax(s + bias[:, None, None], -1)
    keep, scale = dropout_lib.keep_mask(key, 0.1, p.shape)
    dropped = jnp.where(keep, p * scale, 0.0).astype(jnp.bfloat16)
    return jnp.einsum('bhqk,bkhd->bqhd', dropped, v)

  flash = lambda q, k, v: flash_lib.flash_attention(q, k, v, bias, dropout_rate=0.1,
                                                    dropout_key=key, interpret=True)
  out = flash(q, k, v)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(plain(q, k, v), np.float32),
                             atol=2e-2)
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)
  for g, r in zip(jax.grad(loss(flash), (0, 1, 2))(q, k, v),
                  jax.grad(loss(plain), (0, 1, 2))(q, k, v)):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=5e-2)


def test_every_block_size_draws_the_same_mask():
  q, k, v, _, bias = _inputs(1)
  key = jax.random.PRNGKey(5)
  outs = [flash_lib.flash_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                    jnp.asarray(bias, jnp.float32), dropout_rate=0.2,
                                    dropout_key=key, interpret=True,
                                    tilings=flash_lib.Tilings.same(bq, bc))
          for bq, bc in ((32, 8), (8, 2), (16, 1))]
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], atol=1e-6)


def test_each_kernel_tiled_its_own_way_gives_the_same_values_and_gradients():
  """The forward, dK/dV and dQ kernels at three different tilings (what
  benchmarks/flash_tiles.py sweeps): the same outputs and gradients as one tiling, and as
  the float64 reference with keep_mask's mask."""
  q, k, v, w, bias = _inputs(7)
  key = jax.random.PRNGKey(12)
  keep, scale = dropout_lib.keep_mask(key, 0.2, (B, H, T, T))
  mixed = flash_lib.Tilings(forward=flash_lib.Tiling(16, 4), dkv=flash_lib.Tiling(4, 2),
                            dq=flash_lib.Tiling(8, 8))
  assert (mixed.block_q, mixed.block_c) == (16, 8)

  def loss(tilings):
    def f(q, k, v):
      out = flash_lib.flash_attention(q, k, v, jnp.asarray(bias, jnp.float32),
                                      dropout_rate=0.2, dropout_key=key, interpret=True,
                                      tilings=tilings)
      return jnp.sum(out * jnp.asarray(w, jnp.float32))
    return f

  args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
  got = jax.value_and_grad(loss(mixed), (0, 1, 2))(*args)
  same = jax.value_and_grad(loss(flash_lib.Tilings.same(8, 2)), (0, 1, 2))(*args)
  np.testing.assert_allclose(got[0], same[0], rtol=1e-6)
  for g, r in zip(got[1], same[1]):
    np.testing.assert_allclose(g, r, atol=1e-5)
  ref = lambda q: np.sum(_reference(q, k, v, bias, np.asarray(keep), scale) * w)
  np.testing.assert_allclose(got[0], ref(q), rtol=1e-5)
  eps, dq = 1e-6, np.zeros_like(q)
  dq[1, 3, 0, 2] = eps  # one coordinate of dQ against a float64 difference quotient
  np.testing.assert_allclose(got[1][0][1, 3, 0, 2], (ref(q + dq) - ref(q - dq)) / (2 * eps),
                             rtol=1e-3, atol=1e-4)


def test_a_tile_that_is_not_a_power_of_two_is_refused_in_one_line():
  with pytest.raises(ValueError, match='block_c=24 is not a power of 2'):
    flash_lib.Tiling(64, 24)


def _models(variant='postln', **cfg):
  plain = models.build(small_config(variant, fused_attention='off', **cfg), head='encoder')
  flash = models.build(small_config(variant, fused_attention='flash', **cfg), head='encoder')
  return plain, flash


@pytest.mark.parametrize('variant', ['postln', 'preln'])
def test_in_the_model_flash_gives_the_plain_paths_outputs_and_gradients_under_dropout(variant):
  batch = make_batch()
  plain, flash = _models(variant, attention_dropout_rate=0.3, dropout_rate=0.1)
  assert attn_lib._use_flash(flash.spec, False, False, None)
  params = perturbed_params(plain, batch)
  rngs = {'dropout': jax.random.PRNGKey(3)}

  def loss(model):
    return lambda p: jnp.sum(model.apply({'params': p}, batch, deterministic=False,
                                         rngs=rngs).hidden ** 2)

  a = plain.apply({'params': params}, batch, deterministic=False, rngs=rngs).hidden
  b = flash.apply({'params': params}, batch, deterministic=False, rngs=rngs).hidden
  mask = np.asarray(batch['attention_mask'], bool)
  np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], rtol=1e-5, atol=1e-5)
  c = plain.apply({'params': params}, batch, deterministic=True).hidden
  assert not np.allclose(np.asarray(a)[mask], np.asarray(c)[mask], atol=1e-3)  # dropout acted
  ga, gb = jax.grad(loss(plain))(params), jax.grad(loss(flash))(params)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_flash_stands_in_only_under_dropout_and_not_in_the_last_layer(caplog):
  cfg = dict(fused_attention='flash', attention_dropout_rate=0.3)
  for variant in ('realformer', 'synth_random_vanilla', 'synth_dense'):  # (test_flash_variants)
    assert attn_lib._use_flash(resolve(small_config(variant, **cfg)), False, False, None)
  spec = resolve(small_config('postln', **cfg))
  assert attn_lib._use_flash(spec, False, False, None)
  assert not attn_lib._use_flash(spec, True, False, None)  # no dropout: flash is auto
  assert not attn_lib._use_flash(spec, False, True, None)  # probabilities asked for
  assert not attn_lib._use_flash(spec, False, False, jnp.zeros((2, 3), jnp.int32))  # rows
  assert not attn_lib._use_flash(resolve(small_config('postln', fused_attention='flash',
                                                      attention_dropout_rate=0.0)),
                                 False, False, None)
  assert attn_lib._use_fused(spec, True, False) is None  # auto's choice on a CPU
  # flash asked for on a CPU runs Pallas's interpreter: said once
  attn_lib._said_interpreted.cache_clear()
  with caplog.at_level('WARNING'):
    assert attn_lib._flash_kernel(spec)[1] and attn_lib._flash_kernel(spec)[1]
  assert caplog.text.count("on a CPU runs the GPU kernel in Pallas's interpreter") == 1
  # The pretraining model's last layer: tests/test_flash_variants.py.


@pytest.mark.parametrize('seq_len,head_dim', [(40, 64), (128, 64), (384, 64), (512, 64),
                                              (128, 32), (100, 32)])
def test_forward_and_backward_lower_to_triton_for_cuda(seq_len, head_dim):
  """BERT-base's attention shapes in bfloat16 (pretraining's lengths, SQuAD's, a fine-tuning
  bucket's) and MiniLM's heads of 32, lowered for CUDA on this CPU: the Pallas kernels'
  Triton lowering (the part a GPU would reject at its first step) runs here."""
  q = jax.ShapeDtypeStruct((4, seq_len, 12, head_dim), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((4, seq_len), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)

  def loss(q, k, v, bias, key):
    out = flash_lib.flash_attention(q, k, v, bias, dropout_rate=0.1, dropout_key=key)
    return out.astype(jnp.float32).sum()

  with _an_h100():
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
        q, q, q, bias, key).lower(lowering_platforms=('cuda',))
  text = lowered.as_text()
  for name in ('flash_attention_forward', 'flash_attention_dkv', 'flash_attention_dq'):
    assert text.count('xla.gpu.triton') == 3 and f'name = "{name}' in text, name


def _an_h100():
  """An abstract H100: jax's Triton lowering asks which GPU it lowers for."""
  from jax._src.mesh import AbstractDevice  # pylint: disable=g-import-not-at-top
  device = AbstractDevice(device_kind='NVIDIA H100 80GB HBM3', num_cores=132, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def test_auto_takes_the_flash_kernel_on_gpus_in_half_precision_under_attention_dropout():
  """`auto` (the default) trains with the flash kernel where it runs and was faster than
  the plain path: a GPU, bfloat16 (float16 is untimed), heads of 32 or 64, threefry keys,
  whole heads on each device; evaluation keeps cuDNN's kernel."""
  cfg = dict(attention_dropout_rate=0.1, hidden_size=64, num_heads=2)  # heads of 32
  spec = lambda variant='postln', platform='gpu', **kw: resolve(
      small_config(variant, **{'dtype': 'bfloat16', **cfg, **kw}), platform=platform)
  gpu = spec()
  assert gpu.fused_attention == 'auto' and attn_lib._use_flash(gpu, False, False, None)
  assert attn_lib._use_flash(spec(dtype='float16', fused_attention='flash'), False, False, None)
  assert not attn_lib._use_flash(gpu, True, False, None)  # evaluation: cuDNN's kernel
  assert attn_lib._use_fused(gpu, True, False) == 'cudnn'
  for tpu in (spec(platform='tpu'), spec('realformer', platform='tpu', dtype='float32'),
              spec('synth_random_vanilla', platform='tpu'),
              spec('synth_dense', platform='tpu')):  # the Mosaic kernel, for every variant
    assert attn_lib._use_flash(tpu, False, False, None)
    assert attn_lib._flash_kernel(tpu)[0] is flash_tpu_lib.flash_attention
  # A run's log says which path each layer's attention takes.
  for got, want in ((gpu, 'flash (Triton), evaluation jax.nn.dot_product_attention (cudnn)'),
                    (spec('realformer', platform='tpu'), 'flash (Mosaic), evaluation plain'),
                    (spec('realformer'), 'plain, evaluation plain'),
                    (spec(platform='cpu', fused_attention='xla'),
                     'plain, evaluation jax.nn.dot_product_attention (xla)')):
    assert attn_lib.paths(got) == 'training ' + want
  # Mosaic has no float16 tiles: auto keeps the plain path there (flash: tested below).
  assert not attn_lib._use_flash(spec(platform='tpu', dtype='float16'), False, False, None)
  for other in (spec(dtype='float32'), spec(dtype='float16'), spec(platform='cpu'),
                spec(hidden_size=32, num_heads=4),  # heads of 8
                spec(hidden_size=256, num_heads=2),  # heads of 128: not tuned or lowered
                spec(fused_attention='off'), spec(fused_attention='xla'),
                spec('realformer'), spec('synth_dense'), spec(attention_dropout_rate=0.0)):
    assert not attn_lib._use_flash(other, False, False, None), other
  for tensor, whole_heads in ((2, True), (4, False)):
    mesh = partitioning.make_mesh({'data': 8 // tensor, 'fsdp': 1, 'tensor': tensor})
    with partitioning.traced_on(mesh):
      assert attn_lib._use_flash(gpu, False, False, None) == whole_heads
      # (the run's log line, made in the same context)
      assert attn_lib.paths(gpu).startswith('training flash' if whole_heads else
                                            'training plain'), tensor
  impl = jax.config.jax_default_prng_impl
  try:
    jax.config.update('jax_default_prng_impl', 'rbg')
    assert not attn_lib._use_flash(gpu, False, False, None)
  finally:
    jax.config.update('jax_default_prng_impl', impl)


@pytest.mark.parametrize('capability,takes_it', [('9.0', True), ('8.0', True), ('7.5', False),
                                                 ('gfx90a', False)])
def test_auto_takes_the_kernel_only_on_gpus_that_triton_compiles_for(monkeypatch, capability,
                                                                     takes_it):
  """An attached GPU below compute capability 8.0 (Triton's floor in jax), or an AMD one,
  keeps the plain path under `auto`."""
  class Gpu:  # what jax.local_devices(backend='gpu') returns, as far as the choice reads it
    compute_capability = capability
  real = jax.local_devices
  monkeypatch.setattr(jax, 'local_devices',
                      lambda *a, backend=None, **k: [Gpu()] if backend == 'gpu'
                      else real(*a, backend=backend, **k))
  spec = resolve(small_config('postln', dtype='bfloat16', attention_dropout_rate=0.1,
                              hidden_size=64, num_heads=2), platform='gpu')
  assert attn_lib._use_flash(spec, False, False, None) == takes_it


def test_one_line_errors():
  # On a TPU flash is the Mosaic kernel (tests/test_flash_variants.py), of any head size.
  assert resolve(small_config('postln', fused_attention='flash'), platform='tpu').head_dim == 8
  with pytest.raises(ValueError, match='a power of 2 of at least 16.*not 8'):
    resolve(small_config('postln', fused_attention='flash'), platform='gpu')  # 32 / 4 heads
  with pytest.raises(ValueError, match='a power of 2 of at least 16.*not 48'):
    resolve(small_config('postln', fused_attention='flash', hidden_size=96, num_heads=2),
            platform='gpu')
  assert resolve(small_config('postln', fused_attention='flash', hidden_size=64, num_heads=2),
                 platform='gpu').head_dim == 32
  with pytest.raises(ValueError, match='flash on a TPU takes bfloat16 or float32.*float16'):
    resolve(small_config('realformer', fused_attention='flash', dtype='float16'),
            platform='tpu')
  # float32 on a TPU (a pure Synthesizer's term alone too), and where flash never runs (no
  # attention dropout): no error.
  resolve(small_config('synth_dense', fused_attention='flash'), platform='tpu')
  resolve(small_config('postln', fused_attention='flash', attention_dropout_rate=0.0),
          platform='tpu')
  # A fine-tuning off a GPU takes auto for the pretraining's GPU kernel (a CPU here).
  for kernel, want in (('flash', 'auto'), ('cudnn', 'auto'), ('xla', 'xla'), ('off', 'off')):
    model = ml_collections.ConfigDict(dict(small_config('postln', fused_attention=kernel)))
    assert finetune_task.gpu_kernels_off_gpus(model).fused_attention == want
    assert model.fused_attention == kernel  # the stored config is left as it was
  mesh = partitioning.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 8})
  with pytest.raises(ValueError, match='runs whole heads on each device; choose a mesh.tensor '
                                       'that divides 4'):
    partitioning.check_heads(resolve(small_config('postln', fused_attention='flash')), mesh)
  partitioning.check_heads(resolve(small_config('postln', fused_attention='off')), mesh)
  # cuDNN's kernel off a GPU: the launch check's target, and train.py on a CPU (a stored
  # config that names it builds anywhere: analysis and export; fine-tuning takes auto).
  cudnn = lambda **kw: small_config('postln', fused_attention='cudnn', **kw)
  with pytest.raises(ValueError, match='cudnn needs a GPU, not tpu; use auto or xla'):
    resolve(cudnn(dtype='bfloat16'), platform='tpu')
  assert resolve(cudnn(dtype='bfloat16')).fused_attention == 'cudnn'
  # cuDNN's attention takes half precision only: float32 would fail at the first evaluation
  with pytest.raises(ValueError, match=r'^model.fused_attention=cudnn needs model.dtype='
                                       r'bfloat16 or float16 \(cuDNN\'s attention takes no '
                                       r'float32\); use auto'):
    resolve(cudnn(), platform='gpu')
  assert resolve(cudnn(dtype='float16'), platform='gpu').fused_attention == 'cudnn'
  assert resolve(cudnn()).dtype == jnp.float32  # (a stored config still builds: analysis)
  with pytest.raises(ValueError, match=r'^model.fused_attention=cudnn needs a GPU, not cpu; '
                                       r'use auto or xla$'):
    config = tiny_config()
    config.model.fused_attention, config.model.dtype = 'cudnn', 'bfloat16'
    pretraining.PretrainingTask.checked_config(config, partitioning.make_mesh(
        {'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1]))
  old = jax.config.jax_default_prng_impl
  jax.config.update('jax_default_prng_impl', 'rbg')
  try:
    with pytest.raises(ValueError, match='unset JAX_DEFAULT_PRNG_IMPL'):
      dropout_lib.Dropout(0.1).apply({}, rngs={'dropout': jax.random.PRNGKey(0)},
                                     method='threefry_key')
  finally:
    jax.config.update('jax_default_prng_impl', old)


def test_the_tiling_benchmark_times_every_tiling_it_checks(tmp_path):
  """benchmarks/flash_tiles.py --smoke (Pallas's interpreter): every tiling of its grid is
  timed, draws the default's mask and computes its values; the whole attention is timed at
  the default tilings and at the fastest tiling of each kernel."""
  import json, os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, os.path.join(repo, 'benchmarks', 'flash_tiles.py'), '--smoke',
                  '--out', str(tmp_path)], check=True, cwd=tmp_path, timeout=600,
                 env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, capture_output=True)
  (shape,) = json.loads((tmp_path / 'flash_tiles.json').read_text())['shapes']
  assert {r['kernel'] for r in shape['rows']} == {'forward', 'dkv', 'dq'}
  for row in shape['rows']:
    assert 'error' not in row and row['ms'] > 0 and row['max_difference'] < 0.02, row
    assert row['mask_equal'] is (True if row['kernel'] == 'forward' else None), row
  assert set(shape['whole_ms']) == {'flash, default tilings',
                                    'flash, fastest tiling of each kernel'}
  assert '| dkv (default) |' in (tmp_path / 'flash_tiles.md').read_text()


def test_default_tilings_fit_the_shared_memory_of_the_gpu_compiled_for(monkeypatch):
  """The tuned tiles on Hopper, smaller ones where a GPU's blocks have less shared memory or
  a row has more bytes (each choice compiled for such a GPU: tests/test_launch.py,
  BENCHMARKS.md); the device is the one compiling_for names, else jax's."""
  tuned = flash_lib.default_tilings(512, 512)
  assert tuned == flash_lib.default_tilings(512, 512, 2, True, flash_lib.HOPPER_SHARED_MEMORY)
  assert flash_lib.default_tilings(512, 512, 4, True).dkv.num_stages == 2  # 270 KiB at 3
  a100 = flash_lib.SHARED_MEMORY[8, 0]
  assert flash_lib.default_tilings(512, 512, 2, False, a100) == tuned
  wide = flash_lib.default_tilings(512, 512, 4, False, a100)
  assert (wide.dkv.block_q, {t.num_stages for t in (wide.forward, wide.dkv, wide.dq)}) == (32, {2})
  small = flash_lib.default_tilings(512, 512, 4, True, flash_lib.SHARED_MEMORY[8, 9])
  assert max(t.block_q for t in (small.forward, small.dkv, small.dq)) == 32
  assert max(t.block_c for t in (small.forward, small.dkv, small.dq)) == 16
  # Shorter lengths keep their smaller blocks: never larger than the length asks.
  assert flash_lib.default_tilings(40, 40, 4, True, a100).forward.block_q == 16
  # A row's bytes decide (an H100 asked 243,200 bytes of 232,448 for RealFormer's bfloat16
  # heads of 128 at the tuned tiles): bfloat16 heads of 128 are float32's of 64; float32's
  # of 128 take the next class's tiles (in one stage below Hopper).
  hopper = flash_lib.HOPPER_SHARED_MEMORY
  for term in (False, True):
    assert (flash_lib.default_tilings(512, 512, 2, term, hopper, head_dim=128) ==
            flash_lib.default_tilings(512, 512, 4, term, hopper))
    assert (flash_lib.default_tilings(512, 512, 4, term, hopper, head_dim=128) ==
            flash_lib.default_tilings(512, 512, 4, term, a100))
    assert {t.num_stages for t in (lambda x: (x.forward, x.dkv, x.dq))(
        flash_lib.default_tilings(512, 512, 4, term, a100, head_dim=128))} == {1}
    assert (flash_lib.default_tilings(512, 512, 2, term, hopper, head_dim=32) ==
            flash_lib.default_tilings(512, 512, 2, term, hopper))  # (64's: as tuned)

  class Gpu:
    platform, compute_capability = 'gpu', '8.0'
  assert flash_lib.shared_memory_here() == flash_lib.HOPPER_SHARED_MEMORY  # (a CPU here)
  with flash_lib.compiling_for([Gpu()]):
    assert flash_lib.shared_memory_here() == a100
    for other in ('7.5', 'gfx90a'):  # not in the table (ROCm's names no capability): the least
      Gpu.compute_capability = other
      assert flash_lib.shared_memory_here() == min(flash_lib.SHARED_MEMORY.values())
