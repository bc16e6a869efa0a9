"""The flash kernels' contract, for both: Triton's (realformer.layers.flash_attention) and
Mosaic's (realformer.layers.flash_attention_tpu), in Pallas's interpreter on the CPU:
plain attention, an additive term, RealFormer's carried scores, the Synthesizer mixtures and
the term alone (the pure Synthesizers). Values and every gradient (q, k, v, the term, the
incoming scores' gradient) against a float64 reference with keep_mask's mask; in the model,
the plain path's outputs and parameter gradients under attention dropout for every variant,
sharded or not, in
float32 and bfloat16, with the pruned last layer; the Triton kernels lower for CUDA and the
Mosaic kernels compile for TPU slices (libtpu)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from realformer import models
from realformer.layers import dropout as dropout_lib
from realformer.layers import flash_attention as flash_lib
from realformer.layers import flash_attention_tpu as flash_tpu_lib
from realformer.model import attention as attn_lib
from realformer.model.spec import resolve
from realformer.tools import hlo_stats
from realformer.tools import launch
from realformer.train import partitioning
from tests.test_launch import bypassing_the_runs_compilation_cache
from tests.test_launch import needs_libtpu
from tests.test_flash_attention import _an_h100
from tests.test_models import make_batch, perturbed_params, small_config

B, H, D = 3, 2, 16

# Each kernel, with the tiles its interpreter tests run at (Triton's small ones, to cross
# tile boundaries; Mosaic's are 128, its lanes, so lengths above 128 cross them).
KERNELS = {
    'triton': functools.partial(flash_lib.flash_attention,
                                tilings=flash_lib.Tilings.same(8, 2), interpret=True),
    'mosaic': functools.partial(flash_tpu_lib.flash_attention, interpret=True, block=128),
}


def _case(tq, tk, lengths, term_batch, seed=0, heads=H):
  """float64 q, k, v, the term, the output and scores weights of the loss, and the key bias
  (the last sequence's keys all padding when its length is 0)."""
  rng = np.random.default_rng(seed)
  q, w = (rng.normal(size=(B, tq, heads, D)) for _ in range(2))
  k, v = (rng.normal(size=(B, tk, heads, D)) for _ in range(2))
  term = 2.0 * rng.normal(size=(term_batch, heads, tq, tk))
  ws = rng.normal(size=(B, heads, tq, tk))
  real = np.arange(tk)[None] < np.array(lengths)[:, None]
  bias = np.where(real, 0.0, attn_lib.NEG_INF)
  return q, k, v, term, w, ws, bias


def _reference_loss(keep, scale, bias, logit_scale, with_scores, dot=True):
  """float64 (under enable_x64): sum(out * w) [+ sum(scores * ws)] of the contract (without
  the dot product: the term alone)."""
  def loss(q, k, v, term, w, ws):
    own = (jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) if dot else 0.0) + term
    p = jax.nn.softmax(own * logit_scale + bias[:, None, None, :], axis=-1)
    if keep is not None:
      p = jnp.where(keep, p * scale, 0.0)
    value = jnp.sum(jnp.einsum('bhqk,bkhd->bqhd', p, v) * w)
    return value + (jnp.sum(own * ws) if with_scores else 0.0)
  return loss


@pytest.mark.parametrize('kernel', KERNELS)
@pytest.mark.parametrize('tq,tk,lengths,term_batch,rate,logit_scale,with_scores', [
    (32, 32, (32, 19, 6), B, 0.2, None, True),  # RealFormer: scores out, their gradient in
    (136, 136, (136, 119, 3), B, 0.2, 1 / 3, True),  # its running mean, two tiles of 128
    (13, 13, (13, 9, 4), B, 0.5, None, True),  # odd lengths: queries and keys padded
    (32, 32, (32, 19, 6), 1, 0.2, None, False),  # a term shared by the batch (Random)
    (20, 20, (20, 11, 1), B, 0.0, None, False),  # a per-example term (Dense), no dropout
    (136, 136, (136, 130, 7), 0, 0.1, 0.5, False),  # no term, a scale; two tiles of 128
    (32, 32, (32, 19, 6), 0, 0.2, None, True),  # RealFormer's first layer: scores, no term
])
def test_term_kernel_matches_a_float64_reference(kernel, tq, tk, lengths, term_batch, rate,
                                                 logit_scale, with_scores):
  _check_against_the_reference(KERNELS[kernel], tq, tk, lengths, term_batch, rate,
                               logit_scale, with_scores)


@pytest.mark.parametrize('kernel', KERNELS)
@pytest.mark.parametrize('tk,lengths,term_batch,rate,logit_scale,with_scores', [
    (136, (136, 119, 3), 1, 0.2, None, False),  # pure Random: a table shared by the batch
    (13, (13, 9, 4), B, 0.5, 0.5, True),  # pure Dense per example, odd lengths, scores out
])
def test_the_term_alone_matches_a_float64_reference(kernel, tk, lengths, term_batch, rate,
                                                    logit_scale, with_scores):
  """Without q and k the logits are the term (the pure Synthesizers): q's and k's gradients
  are zero, the term's and v's the reference's."""
  _check_against_the_reference(KERNELS[kernel], tk, tk, lengths, term_batch, rate,
                               logit_scale, with_scores, dot=False)


@pytest.mark.parametrize('tq,tk,block,heads,group', [
    (300, 300, None, H, None),  # the kernels' own choice: one 384 tile, one head a step
    (136, 264, 128, 4, 2),  # 2 x 3 tiles of 128 (Tq != Tk), two steps of two heads
    (300, 300, 256, 4, 2),  # 2 x 2 tiles of 256: the mask's bits kept eight blocks an int32
    (600, 600, 512, H, None),  # 2 x 2 tiles of 512, likewise
])
def test_mosaic_tiles_and_heads_a_step_match_the_float64_reference(tq, tk, block, heads,
                                                                   group):
  """RealFormer's contract (a term in, scores out, under dropout) at the tiles and heads a
  grid step that tile_for and heads_per_step choose, and across several tiles of each
  length with two steps of two heads."""
  kernel = functools.partial(flash_tpu_lib.flash_attention, interpret=True, block=block,
                             group=group)
  _check_against_the_reference(kernel, tq, tk, (tk, tk - 30, 5), B, 0.2, None, True,
                               heads=heads)


def _check_against_the_reference(kernel, tq, tk, lengths, term_batch, rate, logit_scale,
                                 with_scores, heads=H, dot=True):
  """The kernel's loss, outputs and gradients against the float64 reference (dot=False:
  the kernel given no q and k)."""
  q, k, v, term, w, ws, bias = _case(tq, tk, lengths, max(term_batch, 1), heads=heads,
                                     seed=tq + term_batch)
  if not term_batch:
    term = np.zeros_like(term)
  key = jax.random.PRNGKey(7)
  keep, scale = (None, 1.0) if rate == 0 else dropout_lib.keep_mask(key, rate, (B, heads, tq, tk))
  keep = None if keep is None else np.asarray(keep)

  def ours(q, k, v, term, w, ws):
    result = kernel(
        q if dot else None, k if dot else None, v, jnp.asarray(bias, jnp.float32),
        term=term if term_batch else None,
        logit_scale=logit_scale, scores_dtype=jnp.float32 if with_scores else None,
        dropout_rate=rate, dropout_key=key)
    out, scores = result if with_scores else (result, None)
    loss = jnp.sum(out * w) + (jnp.sum(scores * ws) if with_scores else 0.0)
    return loss, (out, scores)

  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, term, w, ws)]
  (value, (out, scores)), grads = jax.value_and_grad(ours, argnums=(0, 1, 2, 3),
                                                     has_aux=True)(*args)
  with jax.enable_x64():
    ref = _reference_loss(keep, scale, bias, 1.0 if logit_scale is None else logit_scale,
                          with_scores, dot)
    want_value, want_grads = jax.value_and_grad(ref, argnums=(0, 1, 2, 3))(
        q, k, v, term, w, ws)
    if with_scores:
      want_scores = (np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) if dot else 0) + term
      np.testing.assert_allclose(scores, want_scores, atol=1e-5)
  assert out.shape == (B, tq, heads, D)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for name, g, r in list(zip(('dq', 'dk', 'dv', 'dterm'), grads, want_grads))[
      :4 if term_batch else 3]:
    assert g.shape == r.shape, name
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(r), atol=1e-4,
                               err_msg=name)
  if term_batch:
    assert np.abs(np.asarray(want_grads[3])).max() > 1e-3  # the term's gradient is not trivial
  if rate:  # the mask did act
    assert not np.allclose(value, jax.jit(_reference_loss(
        None, 1.0, bias, 1.0 if logit_scale is None else logit_scale, with_scores, dot))(
        *args), rtol=1e-3)


@pytest.mark.parametrize('kernel', KERNELS)
def test_a_sequence_whose_keys_are_all_padding_is_the_plain_paths_with_a_term(kernel):
  """Its logits are about -1e9, where float32 holds none of the term: the plain path (float32)
  spreads it evenly over the keys, and so does the kernel, values and gradients alike."""
  q, k, v, term, w, ws, bias = (jnp.asarray(x, jnp.float32)
                                for x in _case(16, 16, (16, 5, 0), B, seed=3))
  key = jax.random.PRNGKey(2)

  def flash(q, k, v, term):
    return KERNELS[kernel](q, k, v, bias, term=term, logit_scale=0.5, scores_dtype=jnp.float32,
                           dropout_rate=0.1, dropout_key=key)

  def plain(q, k, v, term):
    own = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) + term
    p = jax.nn.softmax(own * 0.5 + bias[:, None, None], -1)
    keep, scale = dropout_lib.keep_mask(key, 0.1, p.shape)
    return jnp.einsum('bhqk,bkhd->bqhd', jnp.where(keep, p * scale, 0.0), v), own

  out = flash(q, k, v, term)[0]
  keep, scale = dropout_lib.keep_mask(key, 0.1, (B, H, 16, 16))
  uniform = np.einsum('hqk,khd->qhd', np.where(keep[2], scale / 16, 0.0), v[2])
  np.testing.assert_allclose(out[2], uniform, atol=1e-5)
  loss = lambda f: lambda *a: sum(jnp.sum(x * y) for x, y in zip(f(*a), (w, ws)))
  np.testing.assert_allclose(loss(flash)(q, k, v, term), loss(plain)(q, k, v, term), rtol=1e-5)
  for g, r in zip(jax.grad(loss(flash), (0, 1, 2, 3))(q, k, v, term),
                  jax.grad(loss(plain), (0, 1, 2, 3))(q, k, v, term)):
    np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.mark.parametrize('kernel', KERNELS)
def test_a_key_bias_of_minus_infinity_masks_as_the_finite_one(kernel):
  """Left padding past a whole first block of keys (Triton's 8 keys here, Mosaic's 128): with
  -inf there, the online softmax's first block would make its row NaN."""
  q, k, v, term, *_ = (jnp.asarray(x, jnp.float32) for x in _case(16, 136, (136,) * B, 1))
  left = np.arange(136)[None] < np.array([130, 0, 9])[:, None]
  key = jax.random.PRNGKey(1)
  out = {name: KERNELS[kernel](q, k, v, jnp.where(left, fill, 0.0), term=term,
                               dropout_rate=0.1, dropout_key=key)
         for name, fill in (('finite', attn_lib.NEG_INF), ('inf', -jnp.inf))}
  assert np.isfinite(out['inf']).all()
  np.testing.assert_array_equal(out['inf'], out['finite'])


@pytest.mark.parametrize('kernel', KERNELS)
def test_a_term_of_minus_infinity_masks_keys_as_in_the_plain_path(kernel):
  """A logit component of one's own may mask with -inf (a local window): over a row's whole
  first block of keys (Triton's 8, Mosaic's 128), exp(-inf - -inf) made the row NaN. Values
  and the gradients of q, k and v are the plain path's."""
  q, k, v, term, w, *_ = (jnp.asarray(x, jnp.float32) for x in _case(16, 136, (136,) * B, B))
  term = jnp.where(np.arange(136) < np.array([130, 0, 9])[:, None, None, None], -jnp.inf, term)
  key, no_bias = jax.random.PRNGKey(1), jnp.zeros((B, 136))

  def flash(q, k, v):
    return jnp.sum(KERNELS[kernel](q, k, v, no_bias, term=term, dropout_rate=0.1,
                                   dropout_key=key) * w)

  def plain(q, k, v):
    p = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D) + term, -1)
    keep, scale = dropout_lib.keep_mask(key, 0.1, p.shape)
    return jnp.sum(jnp.einsum('bhqk,bkhd->bqhd', jnp.where(keep, p * scale, 0.0), v) * w)

  np.testing.assert_allclose(flash(q, k, v), plain(q, k, v), rtol=1e-5)
  for g, r in zip(jax.grad(flash, (0, 1, 2))(q, k, v), jax.grad(plain, (0, 1, 2))(q, k, v)):
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.mark.parametrize('kernel', KERNELS)
def test_one_line_errors_of_the_term(kernel):
  q = jnp.zeros((2, 8, 2, 16))
  bias = jnp.zeros((2, 8))
  with pytest.raises(ValueError, match=r'term \(2, 2, 8, 4\) is not \[B or 1, H, Tq, Tk\]'):
    KERNELS[kernel](q, q, q, bias, term=jnp.zeros((2, 2, 8, 4)))
  with pytest.raises(ValueError, match='give both q and k, or neither'):
    KERNELS[kernel](q, None, q, bias, term=jnp.zeros((2, 2, 8, 8)))
  with pytest.raises(ValueError, match=r'without q and k takes its logits from a term \[B or '
                                       r'1, H, Tk, Tk\] \(Tk = 8\), not None'):
    KERNELS[kernel](None, None, q, bias)
  if kernel == 'mosaic':  # a tile beyond the TPU's VMEM (it failed deep in the schedule)
    for block in (640, 192):
      with pytest.raises(ValueError, match=f'block={block}; give a multiple of 128 up to 512'):
        flash_tpu_lib.flash_attention(q, q, q, bias, interpret=True, block=block)


@pytest.mark.parametrize('kernel', KERNELS)
def test_each_gradient_is_in_its_inputs_dtype(kernel):
  """dQ, dK and dV come back in q's, k's and v's own dtypes (a float32 v beside bfloat16
  q and k: its gradient is not rounded to k's bfloat16)."""
  q, k = (jnp.ones((1, 8, 2, 16), jnp.bfloat16) * 0.1 for _ in range(2))
  v = jnp.linspace(-1, 1, 8 * 2 * 16, dtype=jnp.float32).reshape(1, 8, 2, 16)
  grads = jax.grad(lambda q, k, v: KERNELS[kernel](q, k, v, jnp.zeros((1, 8))).astype(
      jnp.float32).sum(), (0, 1, 2))(q, k, v)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize('kernel', KERNELS)
def test_a_bfloat16_carry_is_within_rounding_of_the_plain_path(kernel):
  """bfloat16 q, k, v and carried scores, as a GPU trains RealFormer with
  model.residual_dtype=bfloat16: the scores rounded once, the gradients in bfloat16."""
  q, k, v, term, w, ws, bias = _case(32, 32, (32, 19, 6), B, seed=11)
  q, k, v, term = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, term))
  w, ws, bias = (jnp.asarray(x, jnp.float32) for x in (w, ws, bias))
  key = jax.random.PRNGKey(3)

  def plain(q, k, v, term):
    own = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    cur = own + term
    p = jax.nn.softmax(cur + bias[:, None, None], -1)
    keep, scale = dropout_lib.keep_mask(key, 0.1, p.shape)
    out = jnp.einsum('bhqk,bkhd->bqhd', jnp.where(keep, p * scale, 0.0).astype(q.dtype), v)
    return out, cur.astype(jnp.bfloat16)

  flash = lambda q, k, v, term: KERNELS[kernel](
      q, k, v, bias, term=term, scores_dtype=jnp.bfloat16, dropout_rate=0.1, dropout_key=key)
  (out, scores), (want_out, want_scores) = flash(q, k, v, term), plain(q, k, v, term)
  assert out.dtype == scores.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                             atol=3e-2)
  np.testing.assert_allclose(np.asarray(scores, np.float32),
                             np.asarray(want_scores, np.float32), atol=5e-2)
  loss = lambda f: lambda *a: sum(jnp.sum(x.astype(jnp.float32) * y)
                                  for x, y in zip(f(*a), (w, ws)))
  for g, r in zip(jax.grad(loss(flash), (0, 1, 2, 3))(q, k, v, term),
                  jax.grad(loss(plain), (0, 1, 2, 3))(q, k, v, term)):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               atol=0.1, rtol=2e-2)


# Every variant, in the model: those whose logits are a dot product plus additive terms,
# and the pure Synthesizers (the terms alone).
VARIANTS = [
    ('realformer', {}),
    ('realformer', dict(running_mean=True)),
    ('realformer', dict(residual_dtype='bfloat16')),
    ('synth_random_vanilla', {}),
    ('synth_dense_vanilla', {}),
    ('synth_random_vanilla', dict(synth_random_trainable=False)),
    ('postln', dict(attention='factorized_random+dot')),
    ('postln', dict(attention='factorized_dense+dot')),
    ('synth_random', {}),
    ('synth_dense', {}),
    ('synth_random_fixed', {}),
    ('synth_factorized_random', {}),
    ('synth_factorized_dense', {}),
    ('postln', dict(attention='random+dense')),  # a mixture without the dot product
    ('realformer', dict(attention='dense')),  # RealFormer's carry beside a term alone
]


def _pair(variant, **cfg):
  cfg = dict(attention_dropout_rate=0.3, dropout_rate=0.0, **cfg)
  return tuple(models.build(small_config(variant, fused_attention=f, **cfg), head='encoder')
               for f in ('off', 'flash'))


def _loss(model, batch, rngs):
  return lambda p: jnp.sum(model.apply({'params': p}, batch, deterministic=False,
                                       rngs=rngs).hidden ** 2)


def _use(kernel, monkeypatch):
  """The flash kernel the model takes on this CPU (Pallas's interpreter either way)."""
  if kernel == 'mosaic':
    monkeypatch.setattr(attn_lib, '_flash_kernel',
                        lambda spec: (flash_tpu_lib.flash_attention, True))


# Every variant through Triton's kernel; through Mosaic's, one of each kind of term
# (RealFormer's carry in both dtypes, a term shared by the batch, one per example, each
# alone).
IN_THE_MODEL = [(v, c, 'triton') for v, c in VARIANTS] + [
    (v, c, 'mosaic') for v, c in VARIANTS[:1] + VARIANTS[2:5] + VARIANTS[8:10]] + [
        # as a TPU trains it: the layers scanned (the running mean's scale a traced layer
        # index) and rematerialised
        ('realformer', dict(scan_layers=True, remat_policy='full', running_mean=True,
                            num_layers=2),
         'mosaic')]


@pytest.mark.parametrize('variant,cfg,kernel', IN_THE_MODEL)
def test_in_the_model_flash_gives_the_plain_paths_outputs_and_gradients(variant, cfg, kernel,
                                                                       monkeypatch):
  _use(kernel, monkeypatch)
  batch = make_batch()
  plain, flash = _pair(variant, **cfg)
  assert attn_lib._use_flash(flash.spec, False, False, None)
  params = perturbed_params(plain, batch)
  rngs = {'dropout': jax.random.PRNGKey(3)}
  mask = np.asarray(batch['attention_mask'], bool)
  a = plain.apply({'params': params}, batch, deterministic=False, rngs=rngs).hidden
  b = flash.apply({'params': params}, batch, deterministic=False, rngs=rngs).hidden
  np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], rtol=1e-4, atol=1e-4)
  ga, gb = jax.grad(_loss(plain, batch, rngs))(params), jax.grad(_loss(flash, batch, rngs))(
      params)
  # A bfloat16 carry rounds the scores once a layer: a last bit flipped there moves the
  # next layers' values by about 2^-9 of a score.
  tol = dict(rtol=1e-3, atol=1e-4) if 'residual_dtype' in cfg else dict(rtol=1e-4, atol=2e-5)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, **tol, err_msg=jax.tree_util.keystr(path))
  if not cfg.get('synth_random_trainable', True):  # a fixed table stays fixed
    fixed = [x for path, x in jax.tree_util.tree_leaves_with_path(gb)
             if 'random_logits' in jax.tree_util.keystr(path)]
    assert fixed and all(not np.any(np.asarray(x)) for x in fixed)


def _runs(program: jax.extend.core.ClosedJaxpr, primitive: str) -> int:
  """How many times `program` runs `primitive`: its equations counted through every nested
  program (each call site its own), once dead code is removed (as XLA removes a kernel or a
  draw whose outputs nothing reads: the jaxpr of a remat'd gradient keeps the forward
  kernels whose saved outputs replaced them)."""
  def count(jaxpr):
    return (sum(eqn.primitive.name == primitive for eqn in jaxpr.eqns)
            + sum(count(sub) for sub in jax.extend.core.subjaxprs(jaxpr)))
  live, _ = partial_eval.dce_jaxpr(program.jaxpr, [True] * len(program.jaxpr.outvars))
  return count(live)


@pytest.mark.parametrize('variant,scan,kernel,platform', [
    ('postln', False, 'triton', 'cpu'), ('realformer', True, 'mosaic', 'cpu'),
    # as a TPU builds it (which rematerialises LayerNorm, GELU and the hidden masks itself
    # without remat: encoder.recomputes_elementwise), the pretraining model's last layer
    # pruned to the masked rows (the plain path's attention dropout); counted, not run
    ('realformer', False, 'mosaic', 'tpu')])
def test_remat_dots_flash_recomputes_no_kernel_and_no_dropout_mask(variant, scan, kernel,
                                                                  platform, monkeypatch):
  """model.remat_policy='dots_flash' keeps the matmuls, the flash kernels' outputs and
  statistics, and the dropout masks: its gradient runs each kernel as often as without remat
  and draws each mask once (threefry2x32: the hidden dropout's and the plain path's; the
  kernels draw theirs inside), where `dots` runs the forward kernel again in every layer and
  draws the layers' masks a second time; the same outputs and gradients as without remat."""
  _use(kernel, monkeypatch)
  batch = make_batch()
  rngs = {'dropout': jax.random.PRNGKey(3)}
  pretraining = platform == 'tpu'
  if pretraining:
    batch['masked_lm_positions'] = jnp.asarray([[1, 2], [0, 3], [4, 0]], jnp.int32)
  counts, results = {}, {}
  for policy in ('none', 'dots', 'dots_flash'):
    spec = resolve(small_config(variant, fused_attention='flash', num_layers=2,
                                scan_layers=scan, remat_policy=policy,
                                attention_dropout_rate=0.2, dropout_rate=0.1),
                   platform=platform)
    model = models.build(spec, head='pretraining' if pretraining else 'encoder')
    if policy == 'none':
      params = perturbed_params(model, batch)
    pruned = dict(full_hidden=False) if pretraining else {}
    loss = lambda p: jnp.sum(jax.tree.leaves(model.apply(  # pylint: disable=cell-var-from-loop
        {'params': p}, batch, deterministic=False, rngs=rngs, **pruned))[0] ** 2)
    program = jax.make_jaxpr(jax.grad(loss))(params)
    counts[policy] = (_runs(program, 'pallas_call'), _runs(program, 'threefry2x32'))
    if policy != 'dots' and platform == 'cpu':
      results[policy] = jax.grad(loss)(params)
  masks = _runs(jax.make_jaxpr(loss)(params), 'threefry2x32')  # drawn in the forward pass
  layers = 1 if scan else 2 - pretraining  # a scanned program holds one layer's
  assert counts['dots_flash'] == (3 * layers, masks)  # forward, dK/dV, dQ; each mask once
  # `dots` draws the layers' masks again in their recomputed forward, and no more (a TPU's
  # hidden dropout does not also redraw them in its own backward: recomputes_elementwise)
  assert counts['dots'][0] == 4 * layers and masks < counts['dots'][1] <= 2 * masks
  if platform == 'cpu':
    assert counts['none'] == counts['dots_flash']
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(results.get('none', {})),
                          jax.tree.leaves(results.get('dots_flash', {}))):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('variant,cfg,kernel', [
    ('realformer', dict(residual_dtype='bfloat16'), 'triton'),
    ('realformer', {}, 'mosaic'),  # a TPU's RealFormer: bfloat16, the default float32 carry
    ('synth_random_vanilla', {}, 'mosaic')])
def test_a_bfloat16_model_through_flash_is_within_the_plain_paths_rounding(variant, cfg, kernel,
                                                                          monkeypatch):
  """The model in bfloat16, as accelerators train it (the mixture's dot weight folded into
  bfloat16 queries, RealFormer's carry in bfloat16 or float32): the kernel's outputs and
  gradients lie as close to the plain path's in bfloat16 as the plain path's lie to its own
  float32 values (parameter gradients of at least 1e-3 of the largest; the keys' biases get
  none in exact arithmetic)."""
  _use(kernel, monkeypatch)
  batch = make_batch()
  mask = np.asarray(batch['attention_mask'], bool)
  f32, plain, flash = (
      models.build(small_config(variant, fused_attention=f, dtype=dtype, num_layers=2,
                                attention_dropout_rate=0.3, dropout_rate=0.0, **cfg),
                   head='encoder')
      for f, dtype in (('off', 'float32'), ('off', 'bfloat16'), ('flash', 'bfloat16')))
  params = perturbed_params(f32, batch)
  rngs = {'dropout': jax.random.PRNGKey(5)}
  hidden = [np.asarray(m.apply({'params': params}, batch, deterministic=False,
                               rngs=rngs).hidden, np.float64)[mask] for m in (f32, plain, flash)]
  grads = [jax.tree.leaves(jax.grad(_loss(m, batch, rngs))(params)) for m in (f32, plain, flash)]
  norm = lambda x: np.linalg.norm(np.asarray(x, np.float64))
  rounding = norm(hidden[1] - hidden[0])
  assert 0 < norm(hidden[2] - hidden[1]) <= 2.5 * rounding
  largest = max(norm(g) for g in grads[0])
  for want, got_plain, got_flash in zip(*grads):
    if norm(want) >= 1e-3 * largest:
      assert norm(np.asarray(got_flash, np.float64) - got_plain) <= 2.5 * norm(
          np.asarray(got_plain, np.float64) - want)


@pytest.mark.parametrize('variant', ['postln', 'realformer', 'synth_random_vanilla',
                                     'synth_dense'])
def test_pretraining_model_with_the_pruned_last_layer_under_flash(variant):
  """The last layer computes only [CLS] and the masked rows on the plain path (RealFormer's
  reading the scores the flash kernel carried out of the layer before): the plain path's
  outputs."""
  batch = make_batch()
  plain, flash = (models.build(small_config(variant, fused_attention=f,
                                            attention_dropout_rate=0.3, dropout_rate=0.0))
                  for f in ('off', 'flash'))
  params = perturbed_params(plain, batch)
  batch = dict(batch, masked_lm_positions=jnp.asarray([[1, 2], [0, 3], [4, 0], [2, 2]][:len(
      batch['input_ids'])], jnp.int32))
  rngs = {'dropout': jax.random.PRNGKey(4)}
  a = plain.apply({'params': params}, batch, deterministic=False, rngs=rngs, full_hidden=False)
  b = flash.apply({'params': params}, batch, deterministic=False, rngs=rngs, full_hidden=False)
  assert a.hidden.shape[1] == 2 < batch['input_ids'].shape[1]  # the masked rows alone: pruned
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('variant,kernel', [
    ('postln', 'triton'), ('realformer', 'triton'), ('synth_random_vanilla', 'triton'),
    ('synth_dense', 'triton'), ('postln', 'mosaic'), ('realformer', 'mosaic'),
    ('synth_random', 'mosaic')])
def test_sharded_flash_drops_what_the_unsharded_plain_path_drops(variant, kernel, monkeypatch):
  """data x fsdp x tensor = 2 x 2 x 2: each shard computes its own sequences and heads, its
  mask rows offset to their global place; the scores and a per-example term split by batch
  and head, a term shared by the batch by head only. Values and parameter gradients."""
  _use(kernel, monkeypatch)
  batch = make_batch(lengths=(12, 7, 3, 9, 1, 12, 4, 8))
  plain, flash = _pair(variant)
  params = perturbed_params(plain, batch)
  rngs = {'dropout': jax.random.PRNGKey(8)}
  want = plain.apply({'params': params}, batch, deterministic=False, rngs=rngs).hidden
  want_grads = jax.grad(_loss(plain, batch, rngs))(params)
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  def loss_and_hidden(p):  # _loss's, with the hidden states: one program for both
    hidden = flash.apply({'params': p}, batch, deterministic=False, rngs=rngs).hidden
    return jnp.sum(hidden ** 2), hidden
  with partitioning.traced_on(mesh):
    step = jax.jit(jax.value_and_grad(loss_and_hidden, has_aux=True))
    text = step.lower(params).as_text()
    (_, got), grads = step(params)
  assert 'shard_map' in text or 'sdy.manual_computation' in text
  mask = np.asarray(batch['attention_mask'], bool)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], rtol=1e-5,
                             atol=1e-5)
  for x, y in zip(jax.tree.leaves(want_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize('block,tiles', [(128, 2), (256, 2), (384, 1), (512, 1)])
def test_each_mosaic_tile_draws_keep_masks_mask(block, tiles):
  """The mask a Mosaic kernel draws for each tile (its threefry blocks drawn once for four
  keys, their keep bits gathered lane by lane) is keep_mask's bit for bit, and so is the
  mask the backward kernels rebuild from the bits the forward keeps (packed into int32s),
  at every tile the kernels take (tile_for), over several query and key tiles, for a shard
  whose sequences and heads are offset (flash_attention_on_mesh's offsets), with lengths
  short of whole tiles."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  b, h, batch0, head0, heads = 2, 2, 1, 3, 5
  tq, tk = block * tiles - 5, block * tiles - 9
  rate, key = 0.3, jax.random.PRNGKey(11)
  d = flash_tpu_lib._Dims(block * tiles, block * tiles, 64, block, rate, tq, tk)

  def kernel(seed_ref, offsets_ref, out_ref):
    ids = [pl.program_id(a) for a in range(4)]
    nibbles = flash_tpu_lib._nibbles(d, seed_ref, offsets_ref, *ids)
    kept = flash_tpu_lib._unpacked(d, flash_tpu_lib._packed(d, nibbles))  # the backward's
    out_ref[...] = (flash_tpu_lib._keep(d, nibbles).astype(jnp.int32)
                    + 2 * flash_tpu_lib._keep(d, kept).astype(jnp.int32))

  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  got = pl.pallas_call(
      kernel, grid=(b, h, tiles, tiles), in_specs=[smem, smem],
      out_specs=pl.BlockSpec((None, None, block, block), lambda i, j, q, k: (i, j, q, k)),
      out_shape=jax.ShapeDtypeStruct((b, h, d.q_len, d.k_len), jnp.int32), interpret=True)(
          jnp.concatenate([jax.lax.bitcast_convert_type(key, jnp.int32),
                           jnp.zeros((1,), jnp.int32)]),
          jnp.asarray([batch0, head0, heads], jnp.int32))
  want, _ = dropout_lib.keep_mask(key, rate, (batch0 + b, heads, tq, tk))
  want = np.asarray(want)[batch0:, head0:head0 + h]
  got = np.asarray(got)[:, :, :tq, :tk]
  np.testing.assert_array_equal(got & 1, want)  # the forward's mask
  np.testing.assert_array_equal(got >> 1, want)  # the backward's, from the bits kept
  assert 0.6 < want.mean() < 0.8


def test_mosaic_tiles_pad_no_more_than_lanes_do_and_share_steps_among_heads():
  """tile_for: the largest tile up to 512 that divides both lengths rounded to 128;
  heads_per_step: the most heads (dividing them) whose tiles hold no more than a 512 tile."""
  for (tq, tk), tile in {(512, 512): 512, (13, 13): 128, (136, 136): 256, (300, 300): 384,
                         (1024, 1024): 512, (640, 640): 128, (512, 256): 256}.items():
    assert flash_tpu_lib.tile_for(tq, tk) == tile, (tq, tk)
  for (heads, tile), group in {(12, 128): 12, (16, 128): 16, (32, 128): 16, (12, 256): 4,
                               (12, 384): 1, (12, 512): 1, (7, 256): 1, (2, 128): 2}.items():
    assert flash_tpu_lib.heads_per_step(heads, tile) == group, (heads, tile)
  # and as many as VMEM holds of the dK/dV kernel's blocks: RealFormer's (a term, its
  # gradient and the scores' gradient, float32) with bfloat16 q, k, v, and float32 ones;
  # a bfloat16 carry's; on a core of 16 MiB of VMEM (v4), and off a TPU, fewer
  small = flash_tpu_lib.SMALL_VMEM_STEP_BYTES
  for itemsize, pairs, vmem, group in ((2, 12, flash_tpu_lib.STEP_VMEM_BYTES, 16),
                                       (4, 12, flash_tpu_lib.STEP_VMEM_BYTES, 8),
                                       (2, 6, flash_tpu_lib.STEP_VMEM_BYTES, 16),
                                       (2, 12, small, 8), (2, 6, small, 16)):
    assert flash_tpu_lib.heads_per_step(16, 128, 64, itemsize, pairs, vmem) == group
  assert flash_tpu_lib.step_vmem_bytes() == small  # (this CPU: Pallas's interpreter)


def _summed(kernel, logit_scale, scores_dtype, dot=True):
  """loss(q, k, v, term, bias, key): the kernel's output (and scores) summed, under dropout
  (without the dot product: q and k not given to the kernel)."""
  def loss(q, k, v, term, bias, key):
    result = kernel(*((q, k) if dot else (None, None)), v, bias, term=term,
                    logit_scale=logit_scale,
                    scores_dtype=scores_dtype, dropout_rate=0.1, dropout_key=key)
    out, scores = result if scores_dtype else (result, None)
    total = out.astype(jnp.float32).sum()
    return total + (scores.astype(jnp.float32).sum() if scores_dtype else 0.0)
  return loss


@pytest.mark.parametrize('term_batch,scores_dtype,logit_scale,dot', [
    (4, jnp.float32, None, True), (4, jnp.bfloat16, 0.5, True), (1, None, None, True),
    (1, None, None, False), (4, None, None, False), (0, jnp.float32, None, True)])
def test_term_kernels_lower_to_triton_for_cuda(term_batch, scores_dtype, logit_scale, dot):
  """BERT-base's heads at length 512 in bfloat16: RealFormer with a float32 and a bfloat16
  carry (and the running mean's scale), a Random term shared by the batch, the pure
  Synthesizers' term alone (Random's, Dense's: no dQ kernel), and RealFormer's first layer
  (scores written without a term)."""
  q = jax.ShapeDtypeStruct((4, 512, 12, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((4, 512), jnp.float32)
  term = None if not term_batch else jax.ShapeDtypeStruct((term_batch, 12, 512, 512),
                                                          scores_dtype or jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)

  loss = _summed(flash_lib.flash_attention, logit_scale, scores_dtype, dot)
  with _an_h100():
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(
        q, q, q, term, bias, key).lower(lowering_platforms=('cuda',))
  text = lowered.as_text()
  names = ('flash_attention_forward', 'flash_attention_dkv') + (
      ('flash_attention_dq',) if dot else ())
  assert text.count('xla.gpu.triton') == len(names)
  for name in names:
    assert f'name = "{name}' in text, name


def test_a_models_layers_of_one_configuration_lower_each_kernel_once():
  """Four unrolled layers' gradient, lowered for CUDA: the layers whose kernels take the same
  static configuration share one traced and lowered program (before: every layer traced and
  lowered its own three kernels, 12 a model; RealFormer-base's unrolled step for a TPU slice
  traced and lowered in twice the time). RealFormer has three: the first layer (scores
  without a carry), the middle ones, the last (no scores out)."""
  for variant, kernels in (('postln', 3), ('synth_random_vanilla', 3), ('realformer', 9)):
    spec = resolve(small_config(variant, fused_attention='flash', num_layers=4, hidden_size=64,
                                num_heads=2, attention_dropout_rate=0.1), platform='gpu')
    model = models.build(spec, head='encoder')
    batch = make_batch()
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch))['params']
    key = jax.random.PRNGKey(0)

    def loss(p, key):
      return jnp.sum(model.apply({'params': p}, batch, deterministic=False,
                                 rngs={'dropout': key}).hidden ** 2)
    with _an_h100():
      text = jax.jit(jax.grad(loss)).trace(params, key).lower(
          lowering_platforms=('cuda',)).as_text()
    assert text.count('xla.gpu.triton') == kernels, variant


@needs_libtpu
@pytest.mark.parametrize('topology', ['v5e:2x2', 'v5p:2x2x1'])
def test_mosaic_kernels_compile_for_tpu_slices(topology):
  """BERT-base's heads at length 512 in bfloat16, per shard of a data-parallel slice (as
  flash_attention_on_mesh calls them): plain attention, RealFormer with a float32 and a
  bfloat16 carry (and the running mean's scale) and its first layer (scores, no term), a
  Random term shared by the batch, and that term alone (pure Random: q and k left unread in
  HBM); forward and backward, compiled by libtpu for the named slice on this CPU."""
  with bypassing_the_runs_compilation_cache():
    _compile_the_mosaic_kernels_for(topology)


@needs_libtpu
@pytest.mark.parametrize('topology,dtype', [('v5p:2x2x1', jnp.float32),
                                            ('v4:2x2x1', jnp.bfloat16)])
def test_mosaic_kernels_fit_vmem_with_a_float32_term(topology, dtype):
  """RealFormer-large's 16 heads at length 128 with its float32 carry: in a float32 model
  (a TPU's default dtype) sixteen heads a step ran out of v5p's VMEM in the dK/dV kernel,
  in a bfloat16 one out of v4's (16 MiB a core: the launch check of realformer,large on v4
  failed); heads_per_step takes eight there (step_vmem_bytes reads the target's VMEM)."""
  target = launch.tpu_target(topology)
  mesh = jax.sharding.Mesh(np.array(target.devices), ('data',))
  data = NamedSharding(mesh, P('data'))

  def step(q, k, v, bias, key, term):
    loss = _summed(flash_tpu_lib.flash_attention, None, jnp.float32)
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, term, bias, key)
  local = jax.shard_map(step, mesh=mesh, in_specs=(P('data'),) * 4 + (P(), P('data')),
                        out_specs=(P('data'),) * 4, check_vma=False)
  n = 4 * len(target.devices)
  q = jax.ShapeDtypeStruct((n, 128, 16, 64), dtype, sharding=data)
  with bypassing_the_runs_compilation_cache():
    jax.jit(local).trace(
        q, q, q, jax.ShapeDtypeStruct((n, 128), jnp.float32, sharding=data),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())),
        jax.ShapeDtypeStruct((n, 16, 128, 128), jnp.float32, sharding=data)).lower().compile()


def _compile_the_mosaic_kernels_for(topology):
  target = launch.tpu_target(topology)
  mesh = jax.sharding.Mesh(np.array(target.devices), ('data',))
  n = len(target.devices)
  data = NamedSharding(mesh, P('data'))
  for term_batch, scores_dtype, scale, dot in (
      (0, None, None, True), (2 * n, jnp.float32, None, True),
      (2 * n, jnp.bfloat16, 0.5, True), (1, None, None, True), (1, None, None, False),
      (0, jnp.float32, None, True)):
    def step(q, k, v, bias, key, term, scale=scale, scores_dtype=scores_dtype, dot=dot):
      loss = _summed(flash_tpu_lib.flash_attention, scale, scores_dtype, dot)
      return jax.grad(loss, (0, 1, 2) + ((3,) if term is not None else ()))(
          q, k, v, term, bias, key)

    term_spec = None if not term_batch else P('data') if term_batch > 1 else P()
    local = jax.shard_map(step, mesh=mesh, in_specs=(P('data'),) * 4 + (P(), term_spec),
                          out_specs=(P('data'),) * 3 + ((term_spec,) if term_batch else ()),
                          check_vma=False)
    q = jax.ShapeDtypeStruct((2 * n, 512, 12, 64), jnp.bfloat16, sharding=data)
    term = None if not term_batch else jax.ShapeDtypeStruct(
        (term_batch, 12, 512, 512), scores_dtype or jnp.float32,
        sharding=NamedSharding(mesh, term_spec))
    compiled = jax.jit(local).trace(
        q, q, q, jax.ShapeDtypeStruct((2 * n, 512), jnp.float32, sharding=data),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())),
        term).lower().compile()
    stats = hlo_stats.analyze(compiled.as_text())
    # Per device: 2 sequences x 12 heads, 512 x 512 scores, 64 wide: forward 2 products,
    # dK/dV 4, dQ 1 from the logits' gradient (with a term or written scores) or 3 rebuilt
    # (without); the term alone: forward 1 (P V), dK/dV 2 (dV, dP), no dQ.
    products = (6 + (1 if term_batch or scores_dtype else 3)) if dot else 3
    assert stats.matmul_flops == 2 * 12 * 512 * 512 * 64 * 2 * products
    assert stats.opaque_kernels == 0
