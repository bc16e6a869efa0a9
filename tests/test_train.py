"""train.py and realformer/train/train_lib.py: sharding invariance, accumulation, optimizer masks,
FLOP count, clear errors, nan stop, and a short real run on the embedded corpus."""

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train
from configs import pretrain
from realformer import config_checks
from realformer import models
from realformer.model.spec import VARIANTS, resolve
from realformer.train import checkpoints
from realformer.train import metrics as metrics_lib
from realformer.train import metrics_jsonl
from realformer.train import partitioning
from realformer.train import pretraining
from realformer.train import train_lib
from realformer.train import trainer
from realformer.train.run_dir import RunDir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(variant='postln', **train_overrides):
  """A 2-layer, 32-wide model on synthetic batches of 8 x 32 tokens; constant learning rate
  (so runs of different num_steps share a trajectory); logs every step."""
  c = pretrain.get_config(f'{variant},tiny')
  m = c.model
  m.hidden_size, m.num_heads, m.mlp_dim, m.max_len, m.vocab_size = 32, 2, 64, 32, 120
  c.data.sources = 'synthetic'
  c.data.max_seq_length, c.data.max_predictions_per_seq = 32, 5
  t = c.train
  t.batch_size, t.num_steps, t.log_every_steps = 8, 6, 1
  t.eval_every_steps, t.eval_steps, t.checkpoint_every_steps = 1000, 0, 1000  # no eval
  c.optimizer.schedule, c.optimizer.warmup_steps, c.optimizer.learning_rate = 'constant', 0, 3e-3
  for k, v in train_overrides.items():
    t[k] = v
  return c


def losses(workdir, split='train', key='loss'):
  records = metrics_jsonl.read_jsonl(os.path.join(workdir, 'metrics.jsonl'), split)
  return {s: r[key] for s, r in sorted(records.items()) if key in r}


def trained(config, workdir) -> dict:
  """train.train_and_evaluate on one device, for the tests of the trainer's own behaviour
  (logs, resumes, budgets, errors, learning): over the 8 fake devices its runs compile longer and step
  several times slower on the CPU. Sharded runs are tested by the mesh tests here and in
  tests/test_checkpoints.py."""
  return train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


def test_a_finished_run_started_again_reports_what_it_logged(tmp_path, caplog):
  c = tiny_config(num_steps=4, log_every_steps=2, eval_every_steps=2, eval_steps=1)
  with caplog.at_level(logging.INFO):
    first = trained(c, str(tmp_path))
  # One line of the log for each logged step and each evaluation, with every scalar that
  # metrics.jsonl records for it (the loss and the speed in words, the others as name=value).
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('step ')]
  assert [line.split(':')[0] for line in lines] == [
      'step 2/4', 'step 2 eval', 'step 4/4', 'step 4 eval']
  with open(tmp_path / 'metrics.jsonl') as f:
    train_record = next(r for r in map(json.loads, f) if r['split'] == 'train')
  train_names = set(train_record) - {'step', 'split', 'loss', 'steps_per_sec', 'examples_per_s',
                                   'tokens_per_s', 'tflops_per_device', 'uptime'}
  assert 'grad_norm' in train_names and 'learning_rate' in train_names
  for name in train_names:
    assert f'{name}=' in lines[2]
  assert f'loss {first["train"]["loss"]:.4f},' in lines[2]
  assert lines[3].startswith(f'step 4 eval: loss={first["eval"]["loss"]:.6g}, ')
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 4, "split": "tra')  # a last line cut short by a hard stop
  again = trained(c, str(tmp_path))  # nothing left to train or evaluate
  assert again['step'] == first['step'] == 4 and again['eval'] == first['eval'] != {}
  assert again['train'] == {k: v for k, v in first['train'].items()} != {}
  # A run that goes on after the cut line starts a new line: every record stays readable.
  c.train.num_steps = 6
  trained(c, str(tmp_path))
  assert sorted(losses(str(tmp_path))) == [2, 4, 6]


def test_an_evaluation_between_logs_keeps_the_steps_before_it_in_the_next_log(tmp_path):
  """Logging every 4 steps and evaluating at step 6: the log at step 8 averages steps 5 to 8,
  as in a run that evaluates only at its logs (evaluation changes no training)."""
  logs = {}
  for name, every in (('eval6', 6), ('eval8', 8)):
    c = tiny_config(num_steps=8, log_every_steps=4, eval_every_steps=every, eval_steps=1)
    trained(c, str(tmp_path / name))
    logs[name] = losses(str(tmp_path / name))
    assert set(logs[name]) == {4, 8}
  assert logs['eval6'] == logs['eval8']


def test_sharded_and_accumulated_runs_equal_single_device(tmp_path):
  """1 device == 8 devices as data x fsdp (with 2 microbatches) == data x tensor."""
  runs = {'single': ({'data': 1, 'fsdp': 1, 'tensor': 1}, 1, jax.devices()[:1]),
          'fsdp': ({'data': 2, 'fsdp': 4, 'tensor': 1}, 2, None),
          'tensor': ({'data': 4, 'fsdp': 1, 'tensor': 2}, 1, None)}
  got = {}
  for name, (mesh, accum, devices) in runs.items():
    c = tiny_config(num_steps=4, grad_accum_steps=accum, batch_size=16)
    c.model.dropout_rate = c.model.attention_dropout_rate = 0.0  # microbatches draw own masks
    for axis, size in mesh.items():
      c.mesh[axis] = size
    train.train_and_evaluate(c, str(tmp_path / name), devices=devices)
    got[name] = losses(tmp_path / name)
    assert sorted(got[name]) == [1, 2, 3, 4]
  assert 'tokens_per_s' in metrics_jsonl.read_jsonl(tmp_path / 'single' / 'metrics.jsonl')[4]
  single = list(got['single'].values())
  for name in ('fsdp', 'tensor'):
    np.testing.assert_allclose(list(got[name].values()), single, rtol=2e-5, err_msg=name)


def _head_case(head, variant='postln'):
  """(model, numpy batch of 8, loss(params, batch)) for a head, as train.py / finetune.py."""
  c = tiny_config(variant)
  c.model.dropout_rate = c.model.attention_dropout_rate = 0.0
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=8, seed=1))
  ce = optax.softmax_cross_entropy_with_integer_labels
  if head == 'pretraining':
    model = models.build(c.model)
    loss_fn = pretraining.loss_fn(model)
    return model, batch, lambda p, b: loss_fn(p, b, None, pretraining.totals(b))[0]
  rng = np.random.default_rng(0)
  batch = {k: batch[k] for k in ('input_ids', 'segment_ids', 'attention_mask')}
  if head == 'classification':
    model = models.build(c.model, head='classification', num_labels=3)
    batch['label'] = rng.integers(0, 3, 8).astype(np.int32)
    return model, batch, lambda p, b: jnp.mean(ce(model.apply({'params': p}, b)[1], b['label']))
  model = models.build(c.model, head='span')
  batch['start_positions'] = rng.integers(0, 32, 8).astype(np.int32)
  batch['end_positions'] = rng.integers(0, 32, 8).astype(np.int32)

  def span_loss(p, b):
    _, start, end = model.apply({'params': p}, b)
    return jnp.mean(ce(start, b['start_positions']) + ce(end, b['end_positions']))
  return model, batch, span_loss


def grads_on_mesh(model, loss, batch, mesh_config, devices=None):
  """jax.grad(loss)(params, batch) with params and batch sharded as train.py shards them."""
  mesh = partitioning.make_mesh(mesh_config, devices)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  state, shardings = train_lib.create_train_state(model, optax.sgd(1.0), shapes, mesh, 0)
  b = train_lib.global_batch(batch, mesh)

  def g(p, b):
    with nn.logical_axis_rules(partitioning.LOGICAL_AXIS_RULES):
      return jax.grad(loss)(p, b)
  with jax.set_mesh(mesh):
    return jax.jit(g, out_shardings=shardings.params)(state.params, b)


@functools.lru_cache(maxsize=None)
def _one_device_grads(head, variant):
  """The 1-device gradients the meshes' are compared with (one per head and variant)."""
  model, batch, loss = _head_case(head, variant)
  return grads_on_mesh(model, loss, batch, {'data': 1, 'fsdp': 1, 'tensor': 1},
                       jax.devices()[:1])


@pytest.mark.parametrize('head,mesh_shape,variant', [
    ('pretraining', (2, 2, 2), 'postln'), ('pretraining', (1, 4, 2), 'postln'),
    ('pretraining', (2, 2, 2), 'realformer'), ('pretraining', (2, 2, 2), 'synth_random_vanilla'),
    ('classification', (2, 2, 2), 'postln'), ('span', (2, 2, 2), 'postln')])
def test_gradients_on_three_axis_meshes_with_two_rows_per_shard(head, mesh_shape, variant):
  """data x fsdp x tensor with 2 rows per batch shard: every gradient equals the 1-device
  one (XLA's SPMD partitioner got the MLM head's wrong with a take_along_axis gather and a
  decoder table sharded over fsdp; rows.take_rows / MlmHead avoid both). RealFormer and the
  random synthesizer add the pruned last layer's gathers of [.., T, T] rows."""
  model, batch, loss = _head_case(head, variant)
  one = _one_device_grads(head, variant)
  many = grads_on_mesh(model, loss, batch, dict(zip(('data', 'fsdp', 'tensor'), mesh_shape)))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(many)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_fsdp_shards_every_matrix_and_tensor_parallel_splits_heads(variant):
  """On an fsdp x tensor mesh every parameter of two or more axes is sharded over fsdp (a
  replicated one is held whole by every device, with its gradient and both moments), and a
  synthesizer's per-head outputs are split over tensor at head boundaries, as the heads of
  the dot-product logits are."""
  c = tiny_config(variant)
  model = models.build(c.model)
  mesh = partitioning.make_mesh({'data': 1, 'fsdp': 4, 'tensor': 2})
  example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in next(
      pretraining.SyntheticData(vocab_size=120, seq_len=32, num_predictions=5,
                                         global_batch_size=8, seed=1)).items()}
  abstract, shardings = train_lib.state_shardings(model, optax.adamw(1e-3), example, mesh)
  heads = c.model.num_heads
  for (path, shape), sharding in zip(
      jax.tree_util.tree_leaves_with_path(abstract.params), jax.tree.leaves(shardings.params)):
    name, spec = jax.tree_util.keystr(path), tuple(sharding.spec)
    if len(shape.shape) >= 2 and not name.startswith("['nsp_head']"):  # [D, 2]: too small
      assert 'fsdp' in spec, (name, shape.shape, spec)
    if 'synth' in name and name.endswith("'kernel']"):  # [D, H * n]: heads-major output
      assert spec[-1] == 'tensor' and shape.shape[-1] % heads == 0, (name, spec)
    if 'random' in name:  # [H, max_len, ...]
      assert spec[0] == 'tensor', (name, spec)


def test_an_optimizer_whose_state_is_not_shaped_as_the_params_is_sharded_where_it_fits():
  """An optimizer of factored second moments (optax's Adafactor: a row and a column vector
  per matrix, (1,) placeholders elsewhere, each kept in its parameter's box) trains on an
  fsdp mesh: what the parameter's split does not fit is replicated (it was a raw sharding
  error of rank, or of a (1,) split over fsdp), and a moment shaped as its parameter is
  split as the parameter is."""
  c = tiny_config('postln')
  model = models.build(c.model)
  mesh = partitioning.make_mesh({'data': 4, 'fsdp': 2, 'tensor': 1})
  tx = optax.adafactor(1e-2, momentum=0.9, factored=True, min_dim_size_to_factor=32)
  example = pretraining.abstract_batch(4, 16, 5)
  abstract, shardings = train_lib.state_shardings(model, tx, example, mesh)
  specs = {jax.tree_util.keystr(p): (a.shape, tuple(s.spec)) for (p, a), s in zip(
      jax.tree_util.tree_leaves_with_path(abstract.opt_state), jax.tree.leaves(shardings.opt_state))}
  kernel = "['encoder']['layers_0']['mlp']['intermediate']['kernel']"
  assert specs[f'[4].ema{kernel}'] == ((32, 64), ('fsdp', 'tensor'))  # as the kernel is
  assert specs[f'[0].v_row{kernel}'] == ((32,), ())  # (its names are the kernel's two)
  assert specs[f'[0].v{kernel}'] == ((1,), ())  # (a placeholder: fsdp does not split it)
  state, _ = train_lib.create_train_state(model, tx, example, mesh, seed=0)
  assert jax.tree.leaves(state.opt_state)


def test_a_mesh_that_does_not_divide_the_heads_or_a_random_table(caplog):
  """Refused before compiling where a parameter is split by head (every synthesizer) or
  where a mesh axis does not divide a parameter's dimension (a Random table along max_len,
  over fsdp; partitioning.check_divides reads it from the logical axes): inside jit these
  were IndivisibleErrors. Warned about for dot-product attention alone."""
  mesh = partitioning.make_mesh({'data': 1, 'fsdp': 2, 'tensor': 4})  # 2 heads
  example = pretraining.abstract_batch(8, 32, 5)
  for variant in ('synth_random_vanilla', 'synth_dense'):
    with pytest.raises(ValueError, match=r"mesh.tensor=4 does not divide model.num_heads=2, "
                                         r"and the synthesizer's weights are split"):
      train_lib.state_shardings(models.build(tiny_config(variant).model), optax.sgd(1.0),
                                example, mesh)
  odd = tiny_config('synth_random')  # max_len 32
  odd.model.max_len = 31
  with pytest.raises(ValueError, match=r"mesh.fsdp=2 does not divide model.max_len=31, along "
                                       r"which encoder/layers_0/attention/synth_random/"
                                       r"random_logits is split \(synth_len, its dimension 1\)"):
    train_lib.state_shardings(models.build(odd.model), optax.sgd(1.0),
                              pretraining.abstract_batch(8, 30, 5),
                              partitioning.make_mesh({'data': 4, 'fsdp': 2, 'tensor': 1}))
  train_lib.state_shardings(models.build(tiny_config('postln').model), optax.sgd(1.0),
                            example, mesh)
  assert 'heads are cut across devices' in caplog.text


def test_accumulation_gradient_equals_one_big_batch():
  """Masked-token weighting: accumulated microbatches give the big batch's exact gradient,
  even when the microbatches hold different numbers of masked tokens."""
  c = tiny_config()
  c.model.dropout_rate = c.model.attention_dropout_rate = 0.0
  model = models.build(c.model)
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=8, seed=3))
  batch['masked_lm_weights'][:4, 2:] = 0.0  # uneven masked-token counts
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), batch)['params'])
  loss_fn = pretraining.loss_fn(model)
  grad = jax.jit(lambda b, totals: jax.grad(lambda p: loss_fn(p, b, None, totals)[0])(params))
  whole = grad(batch, pretraining.totals(batch))
  totals = pretraining.totals(batch)
  halves = [jax.tree.map(lambda x: x[i::2], batch) for i in range(2)]
  summed = jax.tree.map(jnp.add, *[grad(h, totals) for h in halves])
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(summed)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_synthetic_batches_have_the_compiled_shapes_with_more_predictions_than_positions():
  """20 predictions of 16 tokens (15 positions past [CLS]): padded with weight 0, as
  prepared data is, so the step compiled for abstract_batch's shapes runs them."""
  draw = lambda p: next(pretraining.SyntheticData(vocab_size=120, seq_len=16, num_predictions=p,
                                                  global_batch_size=4, seed=1))
  batch, whole = draw(20), draw(15)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      k: (v.shape, v.dtype) for k, v in pretraining.abstract_batch(4, 16, 20).items()}
  for k, v in whole.items():
    if k.startswith('masked_lm'):
      np.testing.assert_array_equal(batch[k][:, :15], v)
      assert not batch[k][:, 15:].any()
    else:
      np.testing.assert_array_equal(batch[k], v)  # (position 0 is not masked by the padding)


def _fixed_random_synthesizer():
  """(config, spec, params) of the tiny fixed-random Synthesizer (parameters the optimizer must
  leave alone)."""
  c = tiny_config('synth_random_fixed')
  spec = resolve(c.model)
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=2, seed=0))
  params = nn.unbox(jax.jit(models.build(spec).init)(jax.random.PRNGKey(0), batch)['params'])
  return c, spec, params


def test_weight_decay_mask_and_fixed_random_synthesizer():
  c, spec, params = _fixed_random_synthesizer()
  mask = train_lib.decay_mask(params)
  enc = mask['encoder']['layers_0']
  assert enc['attention']['value']['kernel'] and not enc['attention']['value']['bias']
  assert not enc['attention_layer_norm']['scale'] and not enc['mlp_layer_norm']['bias']
  assert mask['encoder']['embeddings']['word_embeddings']['embedding']
  assert not mask['mlm_head']['output_bias'] and not mask['mlm_head']['layer_norm']['scale']
  c.optimizer.weight_decay = 0.5  # large, so a decayed parameter would visibly move
  tx = train_lib.make_optimizer(c.optimizer, spec)
  grads = jax.tree.map(jnp.ones_like, params)  # even a nonzero gradient must not move R
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
  att = updates['encoder']['layers_0']['attention']
  assert float(jnp.abs(att['synth_random']['random_logits']).max()) == 0.0
  assert float(jnp.abs(att['value']['kernel']).max()) > 0.0


def test_weight_decay_mask_is_the_same_for_stacked_layers_and_every_variant():
  """model.scan_layers stacks each layer's parameters under encoder/layers: the mask decides
  by the same names, so a stacked tensor decays as each of its layers did. Every variant's
  own parameters follow BERT's rule: the mixture weights and the Synthesizers' tables and
  projections decay, Pre-LN's final LayerNorm does not."""
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=2, seed=0))

  def by_name(variant, scan):
    c = tiny_config(variant)
    c.model.scan_layers = scan
    shapes = jax.eval_shape(models.build(resolve(c.model)).init, jax.random.PRNGKey(0), batch)
    mask = {}
    for path, decays in jax.tree_util.tree_leaves_with_path(
        train_lib.decay_mask(nn.unbox(shapes['params']))):
      names = tuple('layers' if n.startswith('layers_') else n for n in train_lib.param_names(path))
      mask.setdefault(names, set()).add(decays)
    return mask

  for variant in VARIANTS:
    mask = by_name(variant, False)
    assert by_name(variant, True) == mask, variant
    assert all(len(v) == 1 for v in mask.values()), variant  # each layer alike
    # BERT's exclusions: a bias (its optimizer matches 'bias' in the name: the MLM
    # decoder's output_bias too) and a LayerNorm's gain (flax's LayerNorm: 'scale'),
    # whatever the LayerNorm module is named
    for names, (decays,) in mask.items():
      assert decays == (not names[-1].endswith('bias') and names[-1] != 'scale'), (
          variant, names)
    if variant == 'preln':
      assert mask[('encoder', 'final_layer_norm', 'scale')] == {False}
    if variant == 'synth_random_vanilla':
      assert mask[('encoder', 'layers', 'attention', 'mixture_logits')] == {True}


@pytest.mark.parametrize('grad_accum_steps', [1, 2])
def test_each_step_and_microbatch_draws_its_own_dropout_key(grad_accum_steps):
  """The train step hands loss_fn fold_in(fold_in(rng, step), microbatch): another key at
  every step and in each microbatch of a step, the same on a rerun of that step (a resume).
  A loss whose gradient is its key's noise shows it; the logged grad_norm is the summed
  gradient's before clipping, and the update is the clipped one."""
  mesh = partitioning.make_mesh(pretrain.get_config('postln,tiny').mesh, jax.devices()[:1])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx = train_lib.clip_by_global_norm(1.0)
  params = {'w': jnp.zeros((6,), jnp.float32)}
  state = train_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  zero = metrics_lib.average(0.0, 1.0)

  def loss_fn(p, batch, key, totals):
    del batch, totals
    loss = 10.0 * jnp.sum(p['w'] * jax.random.normal(key, p['w'].shape))
    return loss, dict(mlm_loss=zero, nsp_loss=zero, mlm_accuracy=zero, nsp_accuracy=zero)

  step = train_lib.make_train_step(
      loss_fn, tx, mesh=mesh, shardings=jax.tree.map(lambda _: replicated, state),
      metrics_cls=metrics_lib.PretrainingTrainMetrics, totals_fn=lambda batch: {},
      grad_accum_steps=grad_accum_steps)
  batch = train_lib.global_batch({'x': np.zeros((4, 2), np.float32)}, mesh)
  rng = train_lib.dropout_key(0, mesh)
  updates = []
  for n in (0, 1, 0):
    start = state.replace(step=jnp.asarray(n, jnp.int32), params=params,
                          opt_state=tx.init(params))
    new, metrics = step(jax.tree.map(jnp.copy, start), batch, np.float32(1.0), rng)
    key = jax.random.fold_in(rng, n)
    grad = sum(10.0 * np.asarray(jax.random.normal(jax.random.fold_in(key, i), (6,)))
               for i in range(grad_accum_steps))
    norm = np.linalg.norm(grad)
    assert norm > 1.0  # clipped
    np.testing.assert_allclose(metrics_lib.to_floats(metrics)['grad_norm'], norm, rtol=1e-5)
    np.testing.assert_allclose(new.params['w'], grad / norm, rtol=1e-5, atol=1e-6)
    updates.append(np.asarray(new.params['w']))
  assert not np.allclose(updates[0], updates[1])  # another step, another key
  np.testing.assert_array_equal(updates[0], updates[2])  # the same step, the same key


@pytest.mark.parametrize('max_norm', [0.5, 1e3])  # clipped, and left alone
def test_clip_by_global_norm_matches_numpy_and_optax(max_norm):
  rng = np.random.default_rng(0)
  grads = {'w': rng.normal(size=(7, 5)), 'b': rng.normal(size=(5,)), 'z': np.zeros((3,))}
  norm = np.sqrt(sum((g ** 2).sum() for g in grads.values()))
  want = {k: g * min(1.0, max_norm / norm) for k, g in grads.items()}
  g32 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
  ours, state = train_lib.clip_by_global_norm(max_norm).update(g32, optax.EmptyState())
  theirs, _ = optax.clip_by_global_norm(max_norm).update(g32, optax.EmptyState())
  for k in grads:
    np.testing.assert_allclose(ours[k], want[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-7)
  assert state == optax.clip_by_global_norm(max_norm).init(g32)  # checkpoints interchange
  zero, _ = train_lib.clip_by_global_norm(max_norm).update(
      {'z': jnp.zeros(3)}, optax.EmptyState())
  np.testing.assert_array_equal(zero['z'], 0.0)  # a zero gradient is not 0/0
  bad, _ = train_lib.clip_by_global_norm(max_norm).update(
      {'w': jnp.array([1.0, jnp.nan])}, optax.EmptyState())
  assert np.isnan(bad['w']).all()  # a NaN norm poisons the update, as optax's does


def test_bert_adamw_with_berts_schedule_is_berts_optimization_step_for_step():
  """optimizer.name=bert_adamw, schedule=bert against google-research/bert's optimization.py
  written out in NumPy: clipping at 1.0, AdamWeightDecayOptimizer's moments without bias
  correction, the decay added to the step except for LayerNorm parameters and biases, and
  the warm-up replacing a decay counted from step 0."""
  opt = pretrain.get_config('postln,tiny').optimizer
  opt.name, opt.schedule, opt.learning_rate, opt.warmup_steps = 'bert_adamw', 'bert', 0.01, 2
  opt.weight_decay, num_steps = 0.1, 6
  tx = train_lib.make_optimizer(opt, resolve(tiny_config('postln').model))
  schedule = train_lib.make_schedule(opt, num_steps)
  rng = np.random.default_rng(1)
  want = {'dense': {'kernel': rng.normal(size=(6, 4)), 'bias': rng.normal(size=(4,))},
          'attention_layer_norm': {'scale': 1 + rng.normal(size=(4,))}}
  ours = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), want)
  state, update = tx.init(ours), jax.jit(tx.update)
  m, v = jax.tree.map(np.zeros_like, want), jax.tree.map(np.zeros_like, want)
  for t in range(num_steps):
    grads = jax.tree.map(lambda w: 3 * rng.normal(size=w.shape), want)
    updates, state = update(jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads), state,
                            ours)
    ours = optax.apply_updates(ours, train_lib.apply_learning_rate(updates, schedule(t)))
    norm = np.sqrt(sum((g ** 2).sum() for g in jax.tree.leaves(grads)))
    lr = 0.01 * (t / 2 if t < 2 else 1 - t / num_steps)
    for a, b in [('dense', 'kernel'), ('dense', 'bias'), ('attention_layer_norm', 'scale')]:
      g = grads[a][b] * min(1.0, 1.0 / norm)
      m[a][b] = opt.b1 * m[a][b] + (1 - opt.b1) * g
      v[a][b] = opt.b2 * v[a][b] + (1 - opt.b2) * g * g
      step = m[a][b] / (np.sqrt(v[a][b]) + opt.eps)
      if not ('layer_norm' in a or b.endswith('bias')):  # BERT's exclude_from_weight_decay
        step = step + opt.weight_decay * want[a][b]
      want[a][b] = want[a][b] - lr * step
      np.testing.assert_allclose(np.asarray(ours[a][b]), want[a][b], rtol=2e-5, atol=1e-7,
                                 err_msg=f'{a}/{b} step {t}')
  assert tuple(train_lib.OPTIMIZERS) == config_checks.OPTIMIZERS  # every name is built
  assert tuple(train_lib.SCHEDULES) == config_checks.SCHEDULES


def test_lamb_matches_a_float64_numpy_reference():
  """optimizer.name=lamb, clipping and the warm-up schedule included, against LAMB written
  out in NumPy (You et al. 2020, Algorithm 2, with the BERT runs' exclusions): a decayed
  kernel, a zero kernel (trust ratio 1), and a bias and LayerNorm scale that take Adam's step
  with neither decay nor trust ratio."""
  opt = pretrain.get_config('postln,tiny').optimizer
  opt.name, opt.learning_rate, opt.warmup_steps, opt.weight_decay = 'lamb', 0.01, 2, 0.1
  num_steps, spec = 6, resolve(tiny_config('postln').model)
  rng = np.random.default_rng(0)
  params = {'dense': {'kernel': rng.normal(size=(6, 4)), 'bias': rng.normal(size=(4,))},
            'attention_layer_norm': {'scale': 1 + rng.normal(size=(4,))},
            'zero': {'kernel': np.zeros((3, 3))}}
  decays = {'dense': {'kernel': True, 'bias': False}, 'attention_layer_norm': {'scale': False},
            'zero': {'kernel': True}}
  assert train_lib.decay_mask(params) == decays
  tx, schedule = train_lib.make_optimizer(opt, spec), train_lib.make_schedule(opt, num_steps)
  update = jax.jit(tx.update)
  ours = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params)
  state = tx.init(ours)
  want = jax.tree.map(np.array, params)
  m, v = jax.tree.map(np.zeros_like, params), jax.tree.map(np.zeros_like, params)
  for t in range(5):
    grads = jax.tree.map(lambda w: 3 * rng.normal(size=w.shape), params)
    updates, state = update(jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads), state,
                            ours)
    ours = optax.apply_updates(ours, train_lib.apply_learning_rate(updates, schedule(t)))
    norm = np.sqrt(sum((g ** 2).sum() for g in jax.tree.leaves(grads)))
    lr = 0.01 * (t / 2 if t < 2 else 1 - (t - 2) / (num_steps - 2))
    for path in [('dense', 'kernel'), ('dense', 'bias'), ('attention_layer_norm', 'scale'),
                 ('zero', 'kernel')]:
      g = grads[path[0]][path[1]] * min(1.0, opt.clip_norm / norm)
      mm = m[path[0]][path[1]] = opt.b1 * m[path[0]][path[1]] + (1 - opt.b1) * g
      vv = v[path[0]][path[1]] = opt.b2 * v[path[0]][path[1]] + (1 - opt.b2) * g * g
      w = want[path[0]][path[1]]
      step = (mm / (1 - opt.b1 ** (t + 1))) / (np.sqrt(vv / (1 - opt.b2 ** (t + 1))) + opt.eps)
      ratio = 1.0
      if decays[path[0]][path[1]]:
        step = step + opt.weight_decay * w
        w_norm, s_norm = np.linalg.norm(w), np.linalg.norm(step)
        ratio = w_norm / s_norm if w_norm > 0 and s_norm > 0 else 1.0
      want[path[0]][path[1]] = w - lr * ratio * step
    for path, w in jax.tree_util.tree_leaves_with_path(want):
      got = np.asarray(ours[path[0].key][path[1].key])
      np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-7, err_msg=f'{path} step {t}')
  assert np.abs(want['zero']['kernel']).max() > 0  # the zero kernel moved (ratio 1)
  opt.warmup_steps = 0  # a first step that moves
  lamb = train_lib.make_optimizer(opt, spec)
  opt.name = 'adamw'
  adamw = train_lib.make_optimizer(opt, spec)
  params, grads = (jax.tree.map(lambda x: np.asarray(x, np.float32), t) for t in (params, grads))
  kernel = lambda tx: np.asarray(optax.apply_updates(params, tx.update(
      grads, tx.init(params), params)[0])['dense']['kernel'])
  assert not np.allclose(kernel(adamw), kernel(lamb), rtol=1e-3)  # not AdamW renamed
  opt.name = 'sgd'
  with pytest.raises(ValueError, match="optimizer.name='sgd'; choose adamw, bert_adamw or lamb"):
    train_lib.make_optimizer(opt, spec)


def test_lamb_takes_one_trust_ratio_per_layer_of_scanned_layers():
  """nn.scan stacks the layers' tensors on axis 0: LAMB's update of the stack equals the
  updates of the same tensors unscanned (layers_0, layers_1), layer by layer."""
  opt = pretrain.get_config('postln,tiny').optimizer
  opt.name, opt.warmup_steps = 'lamb', 0
  tx = train_lib.make_optimizer(opt, resolve(tiny_config('postln').model))
  rng = np.random.default_rng(1)
  draw = lambda *shape: jnp.asarray(rng.normal(size=shape) * rng.uniform(0.1, 3), jnp.float32)
  layers = [{'mlp': {'kernel': draw(4, 6), 'bias': draw(6)}} for _ in range(3)]
  grads = [{'mlp': {'kernel': draw(4, 6), 'bias': draw(6)}} for _ in range(3)]
  stack = lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees)
  unscanned = {'encoder': {f'layers_{i}': layer for i, layer in enumerate(layers)}}
  scanned = {'encoder': {'layers': stack(layers)}}
  step = lambda params, g: tx.update(g, tx.init(params), params)[0]
  want = step(unscanned, {'encoder': {f'layers_{i}': g for i, g in enumerate(grads)}})
  got = step(scanned, {'encoder': {'layers': stack(grads)}})
  np.testing.assert_allclose(got['encoder']['layers']['mlp']['kernel'],
                             stack([want['encoder'][f'layers_{i}'] for i in range(3)]
                                   )['mlp']['kernel'], rtol=1e-6)


def test_schedules():
  opt = pretrain.get_config('postln,tiny').optimizer
  opt.learning_rate, opt.warmup_steps = 1.0, 10
  lin = train_lib.make_schedule(opt, 100)
  np.testing.assert_allclose([lin(0), lin(5), lin(10), lin(55), lin(100)],
                             [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
  opt.schedule = 'cosine'
  cos = train_lib.make_schedule(opt, 100)
  np.testing.assert_allclose([cos(10), cos(55), cos(100)], [1.0, 0.5, 0.0], atol=1e-6)
  opt.schedule = 'constant'
  np.testing.assert_allclose(train_lib.make_schedule(opt, 100)(90), 1.0)
  # BERT's optimization.py: polynomial_decay(peak, step, num_steps) from step 0, replaced by
  # peak * step / warmup while step < warmup.
  opt.schedule = 'bert'
  bert = train_lib.make_schedule(opt, 100)
  np.testing.assert_allclose([bert(0), bert(5), bert(9), bert(10), bert(55), bert(100)],
                             [0.0, 0.5, 0.9, 0.9, 0.45, 0.0], atol=1e-6)
  with pytest.raises(ValueError, match='warmup_steps=10 must lie'):
    train_lib.make_schedule(opt, 5)
  opt.warmup_steps = 0
  np.testing.assert_allclose(train_lib.make_schedule(opt, 100)(0), 1.0)


def test_a_warm_up_as_long_as_the_run_is_said(caplog):
  """A second phase given the preset's warm-up as its whole length (base: 10,000 of 10,000
  steps) trains at a rising rate throughout: a warning at the start."""
  config = pretrain.get_config('postln,tiny')
  config.train.num_steps, config.optimizer.warmup_steps = 50, 49
  with caplog.at_level(logging.WARNING):
    config_checks.check_config(config)
  assert 'the whole run warms up' not in caplog.text
  config.optimizer.warmup_steps = 50
  with caplog.at_level(logging.WARNING):
    config_checks.check_config(config)
  assert 'optimizer.warmup_steps=50: the whole run of 50 steps warms up' in caplog.text


@pytest.mark.parametrize('variant', ['postln', 'synth_dense'])
def test_flops_per_example_matches_xla_count(variant):
  """The stated formula against XLA's own count of the forward pass (x 3 for training)."""
  c = tiny_config(variant)
  c.model.vocab_pad_multiple = 1
  c.model.hidden_size, c.model.mlp_dim, c.model.num_heads = 128, 512, 4
  c.model.last_layer = 'all'  # apply's default output: every row of the last layer
  model = models.build(c.model)
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=4, seed=0))
  variables = model.init(jax.random.PRNGKey(0), batch)
  cost = jax.jit(lambda v, b: model.apply(v, b).mlm_logits).lower(
      variables, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  want = train_lib.flops_per_example(c.model, 32, 5) / 3 * 4
  # XLA also counts softmax, GELU and LayerNorm: about 9% more at this size.
  assert 1.0 * want < cost['flops'] < 1.2 * want
  base = pretrain.get_config('postln,base').model
  base.vocab_size = 30522
  # BERT-base at T=128, P=20: about 3 x 2 x 86M non-embedding parameters x 128 tokens.
  assert 60e9 < train_lib.flops_per_example(base, 128, 20) < 75e9


def test_a_metric_of_no_field_of_its_class_is_named_with_the_fix():
  """A statistic of the loss that its metrics class has no field for (one added to
  pretraining's class alone, and fine-tuning's then meets it) is one line naming the class,
  the field to add and where the docs say how; clu's own error was a TypeError."""
  zero = metrics_lib.average(0.0, 1.0)
  stats = dict(mlm_loss=zero, nsp_loss=zero, mlm_accuracy=zero, nsp_accuracy=zero)
  assert metrics_lib.collection(metrics_lib.PretrainingEvalMetrics, **stats)
  with pytest.raises(ValueError, match=r"PretrainingEvalMetrics \(realformer.train.metrics\) "
                                       r"has no field for the metric 'param_norm'; add "
                                       r'`param_norm: clu.metrics.Average`.*"Adding a metric"'):
    metrics_lib.collection(metrics_lib.PretrainingEvalMetrics, param_norm=zero, **stats)


def test_layout_errors_come_before_compile(tmp_path):
  c = tiny_config()
  c.mesh.data, c.mesh.fsdp = 3, 1
  with pytest.raises(ValueError, match=r'does not divide the 8 devices; make the product of '
                                       r'the axes 8 \(or set one axis to -1'):
    train.train_and_evaluate(c, str(tmp_path / 'a'))
  c.mesh.data, c.mesh.fsdp = -1, 3
  with pytest.raises(ValueError, match='does not divide the 8 devices; make the product of '
                                       'the others divide it'):
    train.train_and_evaluate(c, str(tmp_path / 'a'))
  c.mesh.fsdp = 1
  c.mesh.data = 0
  with pytest.raises(ValueError, match='config.mesh.data=0: give a positive size, or -1'):
    train.train_and_evaluate(c, str(tmp_path / 'a'))
  c = tiny_config(batch_size=12)
  with pytest.raises(ValueError, match='is not a multiple of the data-parallel size 8 '
                                       r'\(mesh.data \* mesh.fsdp\); make train.batch_size a '
                                       'multiple of 8$'):
    train.train_and_evaluate(c, str(tmp_path / 'b'))
  # Over several hosts: the first refusal names the batch every check takes (a multiple of
  # the hosts that is not one of the mesh was refused next, naming another number).
  mesh = partitioning.make_mesh({'data': 8, 'fsdp': 1, 'tensor': 1})
  with pytest.raises(ValueError, match=r'train.batch_size=6 does not divide over 4 processes '
                                       r"\(jax's, each feeding its share\); make it a multiple of 8,"):
    train_lib.check_batch_layout(6, 1, mesh, 4)
  c = tiny_config(grad_accum_steps=3)
  with pytest.raises(ValueError, match='grad_accum_steps=3 does not divide'):
    train.train_and_evaluate(c, str(tmp_path / 'c'))
  c = tiny_config()
  c.model.type_vocab_size = 1
  with pytest.raises(ValueError, match=r'type_vocab_size=1: pretraining pairs .* use segment '
                                       'ids 0 to 1; set it to 2'):
    train.train_and_evaluate(c, str(tmp_path / 'd'))
  assert not (tmp_path / 'd').exists()


def test_nan_loss_stops_and_is_not_saved(tmp_path):
  """Logs rarer than checkpoints: the check before each save is what stops the bad step's
  save (a log's own check would otherwise stop it first)."""
  c = tiny_config(num_steps=30, checkpoint_every_steps=2, log_every_steps=1000)
  c.optimizer.learning_rate, c.optimizer.clip_norm = 1e12, 0.0
  with pytest.raises(trainer.NonFiniteLossError,
                     match=r'(loss|gradient norm) became (nan|inf) at step \d+') as e:
    trained(c, str(tmp_path))
  bad_step = int(str(e.value).split(' at step ')[1].split(';')[0])
  assert str(e.value).endswith('; the peak learning rate is 1e+12: lower '
                               'optimizer.learning_rate or raise optimizer.warmup_steps')
  # Training in float32 is advised to a run in half precision alone.
  c.model.dtype = 'bfloat16'
  hint = pretraining.PretrainingTask.nonfinite_hint.fget(types.SimpleNamespace(config=c))
  assert hint == ('lower optimizer.learning_rate, raise optimizer.warmup_steps or train in '
                  'float32 (model.dtype)')
  saved = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert all(s < bad_step for s in saved)
  if saved:
    assert f'last good checkpoint is step {saved[-1]}' in str(e.value)


def test_tensorboard_events_hold_the_logged_values_and_tensorflow_is_not_imported(tmp_path):
  """The trainer writes TensorBoard's event format itself: the events hold metrics.jsonl's
  values under train/ and eval/, and a run imports no TensorFlow (it costs seconds)."""
  from tensorboard.backend.event_processing import event_file_loader
  trained(tiny_config(num_steps=2, eval_every_steps=2, eval_steps=1), tmp_path)
  (name,) = [n for n in os.listdir(tmp_path) if n.startswith('events.out.tfevents.')]
  events = {(e.step, v.tag): v.tensor.float_val[0]
            for e in event_file_loader.EventFileLoader(str(tmp_path / name)).Load()
            for v in e.summary.value}
  for step, loss in losses(tmp_path).items():
    assert events[step, 'train/loss'] == pytest.approx(loss, rel=1e-7)
  assert events[2, 'eval/loss'] == pytest.approx(losses(tmp_path, 'eval')[2], rel=1e-7)
  probe = ('import sys, train; from realformer.train import trainer; '
           'sys.exit(int(any(m.split(".")[0] == "tensorflow" for m in sys.modules)))')
  assert subprocess.run([sys.executable, '-c', probe], cwd=REPO).returncode == 0


def test_a_resume_forgets_the_logs_of_the_stretch_it_left(tmp_path):
  """A run killed after step 8 whose last whole checkpoint is step 4, resumed with another
  length and log cadence: metrics.jsonl (read by the sweep and the study) and TensorBoard
  hold steps 1-4 of the first start and what the second logged, not steps 5, 7 and 8 of the
  abandoned stretch. A start from nothing forgets every earlier line."""
  from tensorboard.backend.event_processing import event_accumulator
  from realformer.tools import sweep
  trained(tiny_config(num_steps=8, checkpoint_every_steps=4), str(tmp_path))
  shutil.rmtree(tmp_path / 'checkpoints' / '8')  # the kill: step 8 never completed
  trained(tiny_config(num_steps=6, log_every_steps=3), str(tmp_path))
  assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 6]
  assert sweep.last_step(str(tmp_path)) == 6
  events = event_accumulator.EventAccumulator(str(tmp_path))
  events.Reload()
  assert [e.step for e in events.Scalars('train/loss')] == [1, 2, 3, 4, 6]
  shutil.rmtree(tmp_path / 'checkpoints')  # a run that starts over
  trained(tiny_config(num_steps=2, log_every_steps=2), str(tmp_path))
  assert sorted(losses(tmp_path)) == [2]


def test_closing_the_writers_closes_each_then_raises_the_first_error():
  """A writer that fails to close (a TensorBoard upload) keeps neither the others (the log's
  last lines) from closing nor its error from being raised."""
  closed = []

  class Writer:
    def __init__(self, name, fails):
      self.name, self.fails = name, fails

    def close(self):
      closed.append(self.name)
      if self.fails:
        raise OSError(f'{self.name} failed')

  writer = metrics_lib.MultiWriter([Writer('events', True), Writer('jsonl', False),
                                    Writer('other', True)])
  with pytest.raises(OSError, match='events failed'):
    writer.close()
  assert closed == ['events', 'jsonl', 'other']


def test_metrics_jsonl_reads_as_the_history_of_the_last_start(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  lines = [{'step': 0, 'split': 'start'}] + [{'step': i, 'split': 'train', 'loss': i}
                                              for i in (1, 2, 3)]
  lines += [{'step': 2, 'split': 'start'}, {'step': 3, 'split': 'train', 'loss': 30},
            {'step': 3, 'split': 'eval', 'loss': 31}]
  path.write_text('\n'.join(json.dumps(l) for l in lines) + '\n{"step": 4, "spl')
  assert {s: r['loss'] for s, r in metrics_jsonl.read_jsonl(path).items()} == {1: 1, 2: 2, 3: 30}
  assert metrics_jsonl.logged_at(path, 3) == {'train': {'loss': 30}, 'eval': {'loss': 31}}
  assert metrics_jsonl.records(tmp_path / 'none.jsonl') == []


def test_metrics_jsonl_merges_the_lines_of_one_step(tmp_path):
  """A flush between two writes of one step writes two lines: read as one record."""
  path = tmp_path / 'metrics.jsonl'
  writer = metrics_jsonl.JsonlWriter(path, start_step=0)
  writer.write_scalars(10, {'train/loss': 1.0, 'eval/loss': 2.0})
  writer.flush()
  writer.write_scalars(10, {'train/steps_per_sec': 3.0, 'eval/loss': 4.0})
  writer.close()
  assert len(path.read_text().splitlines()) == 1 + 4
  assert metrics_jsonl.read_jsonl(path)[10] == {'step': 10, 'split': 'train', 'loss': 1.0,
                                                'steps_per_sec': 3.0}
  assert metrics_jsonl.logged_at(path, 10) == {'train': {'loss': 1.0, 'steps_per_sec': 3.0},
                                               'eval': {'loss': 4.0}}


def test_a_missing_workdir_is_refused():
  # (an unknown config key on the command line: tests/test_workdir.py's one-line errors)
  with pytest.raises(ValueError, match='--workdir is required'):
    train.train_and_evaluate(tiny_config(), '')


def test_an_eval_split_too_small_is_refused_before_the_first_step(tmp_path, caplog):
  """Checked when the data is prepared, not at the first evaluation (the steps before it
  were lost, and no checkpoint was written)."""
  pytest.importorskip('data.pipeline')
  from data import pipeline  # pylint: disable=g-import-not-at-top
  c = pretrain.get_config('postln,tiny')
  c.data.max_seq_length, c.data.max_predictions_per_seq = 64, 10
  c.data.eval_fraction = 0.0
  with pytest.raises(ValueError, match=r'the eval split of \S+ has 0 examples, fewer than one '
                                       r'batch .* or train.eval_steps=0 to train without'):
    train.train_and_evaluate(c, str(tmp_path))
  assert not (tmp_path / 'config.json').exists() and not (tmp_path / 'metrics.jsonl').exists()
  # An evaluation longer than its split reads examples twice: said when the run starts.
  pipeline.check_split({}, 'data', 'eval', 100, 16, 2, batches=6)  # 48 of 50: fine
  assert not caplog.text
  pipeline.check_split({}, 'data', 'eval', 100, 16, 2, batches=7)
  assert ('train.eval_steps=7 batches of 8 read 56 examples per process, but the eval split '
          'holds 50: the evaluation counts some more than once; train.eval_steps=6 reads 48 of '
          'them once (a larger data.eval_fraction, prepared again in a new data.prepared_dir, '
          'holds more)') in caplog.text
  caplog.clear()
  pipeline.check_split({}, 'data', 'eval', 96, 16, 2, batches=7)  # 48 examples: 6 steps
  assert caplog.text.rstrip().endswith('train.eval_steps=6 reads 48 of them once')


def test_embedded_corpus_short_run_lowers_mlm_loss(tmp_path, caplog):
  """Learning on the prepared embedded corpus (grain's pipeline, not synthetic batches), and
  a resume from its step-50 checkpoint logging the uninterrupted run's losses to the bit:
  the input stream's position restored through the trainer, and the evaluation's batches
  the same in a resumed process, and drawn with the preparation's seed (data.seed), which
  the runs of every seed over one prepared corpus share."""
  pytest.importorskip('data.pipeline')
  from data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  c = pretrain.get_config('postln,tiny')
  m = c.model
  m.hidden_size, m.num_heads, m.mlp_dim, m.max_len = 64, 2, 128, 64
  c.data.max_seq_length, c.data.max_predictions_per_seq = 64, 10
  t = c.train
  t.batch_size, t.num_steps, t.log_every_steps = 16, 60, 10
  t.eval_every_steps, t.eval_steps, t.checkpoint_every_steps = 60, 2, 50
  c.optimizer.warmup_steps = 6
  c.data.seed = 7  # (not the run's seed, 0)
  with caplog.at_level(logging.INFO):
    summary = trained(c, tmp_path)  # learning on the embedded corpus, not sharding
  passes = re.search(r'train.num_steps=60 batches of 16 read 960 instances: ([\d.]+) passes '
                     r'over the ([\d,]+) prepared \(each masked anew\)', caplog.text)
  instances = prepare_lib.read_metadata(str(tmp_path / 'data'))['counts']['train']
  assert passes and passes[2] == f'{instances:,}', caplog.text[-2000:]
  assert float(passes[1]) == pytest.approx(960 / instances, rel=1e-2)
  mlm = losses(tmp_path, key='mlm_loss')
  assert mlm[60] < mlm[10] - 1.0, mlm
  assert summary['eval']['mlm_loss'] < np.log(c.model.vocab_size) - 1.0
  assert os.path.isdir(tmp_path / 'checkpoints' / '60')
  resumed = tmp_path.parent / f'{tmp_path.name}_resumed'
  shutil.copytree(tmp_path, resumed,  # (not the prepared data: read where it is)
                  ignore=lambda folder, names: ['data'] if folder == str(tmp_path) else [])
  shutil.rmtree(resumed / 'checkpoints' / '60')  # as if killed after step 59
  c.data.prepared_dir = str(tmp_path / 'data')  # (the same prepared data: not copied)
  trained(c, resumed)
  assert losses(resumed) == losses(tmp_path) and len(losses(resumed)) == 6
  assert losses(resumed, 'eval') == losses(tmp_path, 'eval')  # the same held-out batches
  # The majority baselines on the same evaluation batches, recounted in NumPy.
  eval_iter = pretraining.make_input_fn(c, str(tmp_path))('eval', c.data.seed)
  batches = [next(eval_iter) for _ in range(t.eval_steps)]
  ids = np.concatenate([b['masked_lm_ids'].ravel() for b in batches])
  weights = np.concatenate([b['masked_lm_weights'].ravel() for b in batches])
  counts = np.bincount(ids, weights=weights, minlength=c.model.vocab_size)
  labels = np.concatenate([b['next_sentence_labels'].ravel() for b in batches])
  np.testing.assert_allclose(summary['eval']['mlm_majority_accuracy'],
                             counts.max() / weights.sum(), rtol=1e-6)
  np.testing.assert_allclose(summary['eval']['nsp_majority_accuracy'],
                             max(labels.mean(), 1 - labels.mean()), rtol=1e-6)


def test_mlm_alone_on_full_sentences_learns_and_leaves_the_pooler_as_initialised(tmp_path):
  """config.objective=mlm (RoBERTa): the embedded corpus prepared as one-segment
  FULL-SENTENCES inputs, a model without the NSP head whose loss is its MLM loss, learning;
  the pooler, which no loss reaches, left at its init (weight decay would shrink it); data
  prepared for the other objective, and a resume under it, refused in one line."""
  pytest.importorskip('data.pipeline')
  c = pretrain.get_config('postln,tiny')
  c.objective = 'mlm'
  m = c.model
  m.hidden_size, m.num_heads, m.mlp_dim, m.max_len = 64, 2, 128, 64
  c.data.max_seq_length, c.data.max_predictions_per_seq = 64, 10
  t = c.train
  t.batch_size, t.num_steps, t.log_every_steps = 16, 40, 10
  t.eval_every_steps, t.eval_steps = 40, 2
  c.optimizer.warmup_steps, c.optimizer.weight_decay = 4, 0.1
  summary = trained(c, tmp_path)
  mlm = losses(tmp_path, key='mlm_loss')
  assert mlm[40] < mlm[10] - 0.5, mlm
  assert summary['eval']['loss'] == summary['eval']['mlm_loss']  # the loss is the MLM loss
  assert not any(k.startswith('nsp') for k in summary['eval'])
  batch = next(pretraining.make_input_fn(c, str(tmp_path))('eval', c.seed))
  assert 'next_sentence_labels' not in batch and not batch['segment_ids'].any()
  resolved = pretraining.resolved_config(c)
  mesh = partitioning.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  init = pretraining.program(resolved, mesh).init().params
  assert set(init) == {'encoder', 'mlm_head'}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
  final, _ = checkpoints.restore_params(str(tmp_path), abstract)
  moved = {jax.tree_util.keystr(path): not np.array_equal(leaf, _subtree_at(init, path))
           for path, leaf in jax.tree_util.tree_leaves_with_path(final)}
  pooler = {k for k in moved if "'pooler'" in k}
  assert len(pooler) == 2 and not any(moved[k] for k in pooler)
  assert all(v for k, v in moved.items() if k not in pooler), moved  # every other one trained
  from realformer.tools import analysis  # pylint: disable=g-import-not-at-top
  assert analysis.analyze_run(str(tmp_path), num_examples=8)['variant'] == 'postln (mlm)'
  pairs = c.copy_and_resolve_references()
  pairs.objective = 'mlm_nsp'
  pairs.data.prepared_dir = str(tmp_path / 'data')
  with pytest.raises(ValueError, match="made with other settings.*'instances'.*; set "
                     r'config.objective=mlm \(what it was prepared for\)'):
    trained(pairs, tmp_path.parent / f'{tmp_path.name}_pairs')
  pairs.data.prepared_dir = None
  with pytest.raises(ValueError, match="objective: 'mlm' -> 'mlm_nsp'"):
    trained(pairs, tmp_path)


def _subtree_at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def test_eval_loss_is_the_evaluations_mlm_and_nsp_losses():
  """Over batches holding different numbers of masked tokens, the eval loss is mlm_loss +
  nsp_loss of the whole evaluation (each weighted by its own counts), not a mean of the
  batches' losses."""
  model, batch, _ = _head_case('pretraining')
  mesh = partitioning.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  state, shardings = train_lib.create_train_state(model, optax.sgd(1.0), shapes, mesh, 0)
  step = train_lib.make_eval_step(
      train_lib.loss_metrics(pretraining.loss_fn(model),
                             metrics_lib.PretrainingEvalMetrics, pretraining.totals),
      mesh=mesh, params_sharding=shardings.params)
  few = dict(batch, masked_lm_weights=np.zeros_like(batch['masked_lm_weights']))
  few['masked_lm_weights'][0, 0] = 1.0  # one masked token against the full batch's many
  batches = [train_lib.global_batch(b, mesh) for b in (batch, few)]
  with jax.set_mesh(mesh):
    merged = step(state.params, batches[0]).merge(step(state.params, batches[1]))
  values = metrics_lib.to_floats(merged)
  assert values['loss'] == pytest.approx(values['mlm_loss'] + values['nsp_loss'], rel=1e-6)
  # mlm_loss from the two batches' sums over all their masked tokens.
  loss_fn = pretraining.loss_fn(model)
  parts = [loss_fn(state.params, b, None, pretraining.totals(b))[1] for b in batches]
  tokens = batch['masked_lm_weights'].sum() + 1
  mlm = sum(float(p['mlm_loss'].total) for p in parts) / tokens
  assert values['mlm_loss'] == pytest.approx(mlm, rel=1e-5)
  assert tokens > 10  # the two batches' losses differ in weight


def test_an_evaluation_in_the_train_steps_microbatches_equals_the_whole_batchs():
  """With gradient accumulation the evaluation takes the batch in the train step's
  microbatches, one after the other (a batch that needs accumulation to train would not fit
  whole): the same sums, and fewer bytes of temporaries."""
  model, batch, _ = _head_case('pretraining')
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 1, 'tensor': 1}, jax.devices()[:2])
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  state, shardings = train_lib.create_train_state(model, optax.sgd(1.0), shapes, mesh, 0)
  steps = {k: train_lib.make_eval_step(
      train_lib.loss_metrics(pretraining.loss_fn(model), metrics_lib.PretrainingEvalMetrics,
                             pretraining.totals, microbatches=k, mesh=mesh),
      mesh=mesh, params_sharding=shardings.params) for k in (1, 4)}
  whole = train_lib.global_batch(batch, mesh)
  with jax.set_mesh(mesh):
    values = {k: metrics_lib.to_floats(step(state.params, whole)) for k, step in steps.items()}
    temps = {k: step.lower(state.params, whole).compile().memory_analysis().temp_size_in_bytes
             for k, step in steps.items()}
  assert values[4] == pytest.approx(values[1], rel=1e-5)
  assert temps[4] < temps[1], temps


def test_label_counts_sum_over_a_sharded_batch():
  mesh = partitioning.make_mesh(pretrain.mesh_config())  # 8 devices on the data axis
  rng = np.random.default_rng(0)
  batch = {'masked_lm_ids': rng.integers(0, 11, (16, 5)).astype(np.int32),
           'masked_lm_weights': (rng.random((16, 5)) < 0.7).astype(np.float32),
           'next_sentence_labels': rng.integers(0, 2, (16,)).astype(np.int32)}
  counts = pretraining.make_label_counts(mesh, 11)(train_lib.global_batch(batch, mesh))
  want = np.bincount(batch['masked_lm_ids'].ravel(), batch['masked_lm_weights'].ravel(), 11)
  np.testing.assert_allclose(np.asarray(counts['mlm']), want)
  np.testing.assert_allclose(np.asarray(counts['nsp']),
                             np.bincount(batch['next_sentence_labels'], minlength=2))
  base = pretraining.majority_baselines(counts)
  assert base['mlm_majority_accuracy'] == pytest.approx(want.max() / want.sum())


def test_steps_match_hf_bert_for_pretraining_trained_in_pytorch(tmp_path):
  """The whole train step against the peer a user would otherwise run: transformers'
  BertForPreTraining under the usual PyTorch recipe (torch AdamW with no decay on biases and
  LayerNorm weights, clip_grad_norm_, linear warm-up then decay). From the same weights on
  the same padded batches, without dropout, every step's loss and the final parameters agree.
  This pins the loss (masked-token weighting, NSP mean), the decay mask, clipping, Adam's
  bias correction and the schedule's step indexing, beyond the forward pass."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from realformer.tools import interop  # pylint: disable=g-import-not-at-top
  hc = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
  torch.manual_seed(0)
  hf = transformers.BertForPreTraining(hc).float()
  with torch.no_grad():  # nonzero biases and LayerNorm weights, so that decaying them shows
    for name, p in hf.named_parameters():
      if name.endswith('bias') or 'LayerNorm' in name:
        p.add_(0.1 * torch.randn_like(p))
  hf.save_pretrained(str(tmp_path))
  params, config, _ = interop.load_hf(str(tmp_path))
  initial = interop.convert_from_params(params, config.model, fmt='hf')

  num_steps, lr, warmup, wd = 5, 1e-2, 2, 0.1
  opt = config.optimizer
  opt.learning_rate, opt.warmup_steps, opt.weight_decay, opt.clip_norm = lr, warmup, wd, 1.0
  spec = resolve(config.model)
  model = models.build(spec)
  tx, rates = train_lib.make_optimizer(opt, spec), train_lib.LearningRates(
      train_lib.make_schedule(opt, num_steps))
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  _, shardings = train_lib.state_shardings(model, tx, pretraining.abstract_batch(4, 16, 5), mesh)
  params = jax.device_put(jax.tree.map(jnp.asarray, params), shardings.params)
  state = train_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=jax.jit(tx.init)(params))
  step = train_lib.make_train_step(pretraining.loss_fn(model), tx,
                                   mesh=mesh, shardings=shardings,
                                   metrics_cls=metrics_lib.PretrainingTrainMetrics,
                                   totals_fn=pretraining.totals)
  rng = train_lib.dropout_key(0, mesh)

  no_decay = lambda name: name.endswith('bias') or 'LayerNorm' in name
  named = list(hf.named_parameters())
  torch_opt = torch.optim.AdamW(
      [{'params': [p for n, p in named if not no_decay(n)], 'weight_decay': wd},
       {'params': [p for n, p in named if no_decay(n)], 'weight_decay': 0.0}],
      lr=lr, betas=(opt.b1, opt.b2), eps=opt.eps)
  torch_schedule = transformers.get_linear_schedule_with_warmup(torch_opt, warmup, num_steps)
  long = lambda x: torch.tensor(x, dtype=torch.long)

  def torch_loss(b):
    out = hf(input_ids=long(b['input_ids']), token_type_ids=long(b['segment_ids']),
             attention_mask=long(b['attention_mask']))
    pos = long(b['masked_lm_positions'])
    logits = torch.gather(out.prediction_logits, 1,
                          pos[..., None].expand(-1, -1, hc.vocab_size))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                           long(b['masked_lm_ids']).flatten(), reduction='none')
    w = torch.tensor(b['masked_lm_weights']).flatten()
    nsp = torch.nn.functional.cross_entropy(out.seq_relationship_logits,
                                            long(b['next_sentence_labels']))
    return (ce * w).sum() / w.sum() + nsp

  data = pretraining.SyntheticData(vocab_size=120, seq_len=16, num_predictions=5,
                                            global_batch_size=4, seed=1)
  for i in range(num_steps):
    b = next(data)
    assert b['attention_mask'].min() == 0  # padding present
    state, stats = step(state, train_lib.global_batch(b, mesh), rates(i), rng)
    hf.train()
    torch_opt.zero_grad()
    loss = torch_loss(b)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    torch_opt.step()
    torch_schedule.step()
    np.testing.assert_allclose(metrics_lib.to_floats(stats)['loss'], loss.item(), rtol=2e-5,
                               err_msg=f'step {i}')

  ours = interop.convert_from_params(jax.device_get(state.params), config.model, fmt='hf')
  theirs = {n.removeprefix('bert.'): p.detach().numpy() for n, p in hf.state_dict().items()}
  moved, atol = 0.0, 2e-5
  for name, x in ours.items():
    np.testing.assert_allclose(x, theirs[name], rtol=0, atol=atol, err_msg=name)
    moved = max(moved, float(np.abs(theirs[name] - initial[name]).max()))
  assert moved > 500 * atol  # Adam moved weights by about the summed learning rates, 0.025


def test_the_step_at_a_learning_rate_argument_is_the_optimizer_at_that_rate_to_the_bit():
  """make_optimizer runs at a rate of 1 and the step scales its updates by the rate it is
  given: every optimizer's updates (clipping, decay mask, fixed parameters included) equal
  those of the optimizer built at that rate, bit for bit, so taking the rate out of the
  compiled program changes no run (AdamW and LAMB built here as optax and train_lib.lamb
  give them; an optimizer added to train_lib.OPTIMIZERS is held to it as its entry builds it
  at the rate)."""
  config, spec, params = _fixed_random_synthesizer()
  grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                       params)
  opt = config.optimizer
  opt.clip_norm, opt.weight_decay = 1.0, 0.01
  assert {'adamw', 'lamb'} <= set(train_lib.OPTIMIZERS)
  for name in sorted(train_lib.OPTIMIZERS):
    opt.name = name
    unit = train_lib.make_optimizer(opt, spec)
    rate = np.float32(3e-4)
    built = {'adamw': lambda: optax.adamw(lambda _: rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                          weight_decay=opt.weight_decay,
                                          mask=train_lib.decay_mask),
             'lamb': lambda: train_lib.lamb(lambda _: rate, opt.b1, opt.b2, opt.eps,
                                            opt.weight_decay)}.get(
                 name, lambda: train_lib.OPTIMIZERS[name](lambda _: rate, opt))
    at_rate = optax.chain(  # what make_optimizer built with the rate inside it
        train_lib.clip_by_global_norm(1.0), built())
    frozen = train_lib.fixed_params_fn(spec)
    at_rate = optax.multi_transform(
        {'trained': at_rate, 'frozen': optax.set_to_zero()},
        lambda p: jax.tree.map(lambda f: 'frozen' if f else 'trained', frozen(p)))
    ours = jax.jit(lambda g, p: train_lib.apply_learning_rate(
        unit.update(g, unit.init(p), p)[0], jnp.float32(rate)))(grads, params)
    theirs = jax.jit(lambda g, p: at_rate.update(g, at_rate.init(p), p)[0])(grads, params)
    assert jax.tree.structure(unit.init(params)) == jax.tree.structure(at_rate.init(params))
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    assert float(jnp.abs(ours['encoder']['layers_0']['attention']['synth_random'][
        'random_logits']).max()) == 0.0


def test_an_init_with_known_params_draws_only_the_rest():
  """Program.init(params), as a start from a checkpoint calls it: the known arrays kept to
  the bit, every other leaf the whole init's value, the optimizer's init of the result,
  all in the whole init's shardings (on a data x fsdp x tensor mesh)."""
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  program = pretraining.program(tiny_config(), mesh)
  whole = program.init()
  drawn = lambda path: 'layers_1' in jax.tree_util.keystr(path)  # (a head's place)
  known = jax.tree_util.tree_map_with_path(
      lambda path, a: None if drawn(path) else a + 1, whole.params)
  part = program.init(known)
  leaves = jax.tree_util.tree_leaves_with_path(whole.params)
  assert any(drawn(path) for path, _ in leaves) and not all(drawn(path) for path, _ in leaves)
  assert jax.tree.structure(part) == jax.tree.structure(whole)
  for (path, w), p in zip(leaves, jax.tree.leaves(part.params)):
    want = w if drawn(path) else w + 1
    assert p.sharding == w.sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))
  fresh = jax.tree.leaves(program.tx.init(part.params))
  assert len(fresh) == len(jax.tree.leaves(part.opt_state))
  for a, b, w in zip(fresh, jax.tree.leaves(part.opt_state), jax.tree.leaves(whole.opt_state)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert b.sharding == w.sharding
  assert int(part.step) == 0


def test_runs_of_other_rates_schedules_lengths_and_seeds_compile_one_program():
  """The learning rate and the dropout key are the step's arguments: configs that differ in
  them (rate, schedule, warm-up, num_steps, seed) lower to the same program text, which the
  persistent cache keys on, and so does the trainer's call with its arrays (a step compiled
  ahead of time, by the launch check or fine-tuning's lengths, is the program the trainer
  runs); the rate reaches the step's metrics as given."""
  mesh = partitioning.make_mesh(tiny_config().mesh, jax.devices()[:1])
  texts = []
  for lr, schedule, steps, seed in ((3e-3, 'constant', 6, 0), (1e-4, 'linear', 600, 7),
                                    (5e-5, 'bert', 40, 1)):
    config = tiny_config(num_steps=steps)
    config.optimizer.learning_rate, config.optimizer.schedule = lr, schedule
    config.optimizer.warmup_steps, config.seed = 0 if schedule == 'constant' else 4, seed
    program = pretraining.program(config, mesh)
    with jax.set_mesh(mesh):
      texts.append(program.train_step.lower(program.abstract, program.batch_shapes,
                                            *train_lib.abstract_step_arguments(mesh)).as_text())
  assert texts[0] == texts[1] == texts[2]
  state = program.init()
  batch = train_lib.global_batch(next(pretraining.SyntheticData(
      vocab_size=120, seq_len=32, num_predictions=5, global_batch_size=8, seed=0)), mesh)
  rates = train_lib.LearningRates(program.schedule)
  with jax.set_mesh(mesh):
    assert program.train_step.lower(state, batch, rates(0), program.dropout_key()).as_text() == (
        texts[0])
    for step in range(5):
      state, metrics = program.train_step(state, batch, rates(step),
                                          train_lib.dropout_key(config.seed, mesh))
      assert float(metrics.learning_rate.compute()) == rates(step) == np.float32(
          program.schedule(step))
  assert np.isclose(rates(4), 5e-5 * (1 - 4 / 40), rtol=1e-6, atol=0) and rates(0) == 0.0


def test_a_time_budget_reads_the_schedule_exactly_where_the_warm_up_ends(tmp_path):
  """A budget's progress reads the configured schedule at its position: the peak at the end
  of a warm-up far shorter than the run's bound (500 of a million steps), BERT's drop there,
  and the decay after it."""
  cadence = types.SimpleNamespace(time_budget_minutes=1e6 / 60, num_steps=1_000_000)
  for name in ('linear', 'bert'):
    opt = tiny_config().optimizer
    opt.schedule, opt.warmup_steps, opt.learning_rate = name, 500, 1e-3
    schedule = train_lib.make_schedule(opt, cadence.num_steps)
    budget = trainer.TimeBudget(cadence, schedule, RunDir(str(tmp_path)), 0)
    for position in (250, 499, 500, 501, 400_000):
      budget.spent = float(position)  # of a budget of 1e6 s: the position's share
      np.testing.assert_allclose(budget.learning_rate(0), schedule(position), rtol=1e-5,
                                 err_msg=f'{name} at {position}')


def test_a_resume_under_another_budget_or_length_says_how_the_rate_moves(caplog):
  """Under a budget the schedule is read at max(step, the spent share of num_steps): a larger
  budget, a budget dropped, or another num_steps under one moves the rate at the resumed
  step (back up, for a linear decay), said as a change of num_steps alone is; another
  peak rate, as what it is."""
  def config(num_steps, minutes):
    c = tiny_config(num_steps=num_steps, time_budget_minutes=minutes)
    c.optimizer.schedule, c.optimizer.warmup_steps, c.optimizer.learning_rate = (
        'linear', 0, 1e-3)
    return c

  def said(before, after, step=100, spent=27.0):
    stored = json.loads(before.to_json_best_effort())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      trainer._say_if_the_rate_moves(stored, types.SimpleNamespace(config=after), step, spent)  # pylint: disable=protected-access
    return caplog.text
  # 27 s of half a minute: 90% of 1000 steps; of a minute: 45%.
  assert ('resumed at step 100 with train.time_budget_minutes 0.5 -> 1.0: the learning rate '
          'there moves from 0.0001 to 0.00055 (the schedule, warm-up included, follows the '
          'new budget)') in said(config(1000, 0.5), config(1000, 1.0))
  assert 'time_budget_minutes 0.5 -> 0: the learning rate there moves from 0.0001 to 0.0009' \
      in said(config(1000, 0.5), config(1000, 0.0))  # the budget dropped: step 100 of 1000
  # The same budget, a longer bound: where the steps lead the clock (1 s of 30), they move it.
  assert 'train.num_steps 1000 -> 2000: the learning rate there moves from 0.0009 to 0.00095' \
      in said(config(1000, 0.5), config(2000, 0.5), spent=1.0)
  assert not said(config(1000, 0.5), config(2000, 0.5))  # (the clock leads: 90% either way)
  assert not said(config(1000, 1.0), config(1000, 1.0))  # nothing changed: nothing moves
  halved = config(1000, 0.0)
  halved.optimizer.learning_rate = 5e-4  # the length and budget as they were
  assert ('resumed at step 100 with other optimizer settings: the learning rate there moves '
          'from 0.0009 to 0.00045\n') in said(config(1000, 0.0), halved)


def test_time_budget_stops_the_run_and_decays_the_schedule_to_zero(tmp_path, caplog):
  config = tiny_config(num_steps=100_000, time_budget_minutes=0.1, log_every_steps=5,
                       checkpoint_every_steps=40)  # 6 s: past step 40 on a slow machine
  config.optimizer.schedule, config.optimizer.warmup_steps = 'linear', 10
  workdir = str(tmp_path / 'budget')
  summary = trained(config, workdir)
  budget = summary['time_budget']
  assert budget['spent_minutes'] * 60 >= 6.0 and 10 < budget['steps'] < 100_000
  # The schedule follows the clock: after the warm-up, BERT's linear decay at the fraction
  # of the budget spent (peak x (1 - fraction), the fraction read before the step).
  rates = losses(workdir, key='learning_rate')
  fractions = losses(workdir, key='budget_spent_fraction')
  steps = sorted(rates)
  assert fractions[steps[-1]] >= 1.0
  for before, step in zip(steps[1:], steps[2:]):
    share = rates[step] / 3e-3
    assert 1 - fractions[step] - 0.02 <= share <= 1 - fractions[before] + 0.02, (step, share)
  spent = json.load(open(os.path.join(workdir, RunDir.TIME_SPENT)))
  assert str(budget['steps']) in spent
  # Resuming a spent budget trains no further, and says so.
  caplog.set_level('INFO', logger='absl')
  again = trained(config, workdir)
  assert again['time_budget']['steps'] == budget['steps']
  assert (f'the run finished at step {budget["steps"]} (' in caplog.text and 'nothing is left '
          'to train (a larger train.time_budget_minutes trains it further)' in caplog.text)
  assert 'resuming from' not in caplog.text
  # A checkpoint whose record is missing counts the budget from the newest record before
  # it (not from zero: a whole budget more).
  last = int(budget['steps'])
  before = max(int(k) for k in spent if int(k) < last)
  del spent[str(last)]
  with open(os.path.join(workdir, RunDir.TIME_SPENT), 'w') as f:
    json.dump(spent, f)
  cadence = types.SimpleNamespace(time_budget_minutes=0.05, num_steps=100_000)
  resumed = trainer.TimeBudget(cadence, optax.constant_schedule(1.0), RunDir(workdir), last)
  assert resumed.before == spent[str(before)] > 0


def test_a_checkpoint_is_never_committed_without_its_time_record(tmp_path, monkeypatch):
  """The time record is written before the checkpoint: a failed write leaves no checkpoint
  that a resumed run would count the budget of from zero. (The budget is ample: the run
  reaches step 40 however slow the machine.)"""
  config = tiny_config(num_steps=60, time_budget_minutes=60, checkpoint_every_steps=20)
  workdir = str(tmp_path / 'budget')
  write_json = RunDir.write_json

  def failing(self, name, *args, **kwargs):
    if name == RunDir.TIME_SPENT and json.loads(json.dumps(args[0])).keys() >= {'20', '40'}:
      raise OSError(28, 'No space left on device', str(self.path(name)))
    return write_json(self, name, *args, **kwargs)
  monkeypatch.setattr(RunDir, 'write_json', failing)
  with pytest.raises(OSError, match='No space left'):
    trained(config, workdir)
  assert checkpoints.complete_steps(workdir) == [20]


@pytest.mark.parametrize('kind,peak', [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12),
    ('NVIDIA H200', 989e12), ('NVIDIA H200 NVL', 835e12), ('NVIDIA A100-SXM4-80GB', 312e12),
    ('TPU v5 lite', 197e12),
    ('TPU v5p', 459e12), ('TPU v6 lite', 918e12), ('cpu', None)])
def test_mfu_reads_each_device_against_its_own_peak(kind, peak):
  """The vendors' dense bfloat16 figures; an H100 PCIe or NVL (or an H200 NVL) is not the SXM
  card."""
  device = types.SimpleNamespace(device_kind=kind)
  assert metrics_lib.peak_flops_per_device(device) == peak
  assert metrics_lib.peak_flops_per_device(device, override=1e12) == 1e12


@pytest.mark.parametrize('key,value,message', [
    ('model.synth_factorized_rank', 0, 'give a positive rank'),
    ('model.synth_factorized_a', -4, 'give a positive divisor of model.max_len=32'),
    ('model.dropout_rate', 1.5, r'model.dropout_rate=1.5: give a rate in \[0, 1\)'),
    ('model.attention_dropout_rate', 1.0, r'give a rate in \[0, 1\)'),
    ('model.layer_norm_eps', 0.0, 'model.layer_norm_eps=0.0: give a positive number'),
    ('model.initializer_range', -0.02, 'give a positive number'),
    ('optimizer.b1', 1.0, r'optimizer.b1=1.0: give a decay in \[0, 1\)'),
    ('optimizer.b2', 1.5, r'give a decay in \[0, 1\)'),
    ('optimizer.eps', 0.0, 'optimizer.eps=0.0: give a positive epsilon'),
    ('optimizer.weight_decay', -0.01, 'give a rate >= 0'),
    ('optimizer.clip_norm', -1.0, 'give a positive norm .*, or 0 to turn clipping off'),
    ('data.short_seq_prob', 2.0, r'give a share in \[0, 1\]'),
    ('data.eval_fraction', 1.0, r'give a share in \[0, 1\) \(the documents held out'),
    ('data.dupe_factor', 0, 'give at least 1'),
])
def test_a_setting_out_of_its_range_is_one_line_before_anything_runs(key, value, message):
  """Values that would train something else than asked (a rank of 0: uniform attention; a
  negative clip_norm: no clipping) or fail deep inside a program: refused by check_config."""
  c = tiny_config('synth_factorized_random' if 'rank' in key else
                  'synth_factorized_dense' if key.endswith('_a') else 'postln')
  section, name = key.split('.')
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    config_checks.check_config(c)
  c[section][name] = pretrain.get_config('postln,tiny')[section].get(name) or (
      8 if 'rank' in key else 0)
  config_checks.check_config(c)  # the default passes


def test_a_setting_the_variant_does_not_read_is_a_warning(caplog):
  for variant, key, value, said in (
      ('postln', 'running_mean', True, 'model.running_mean=True does nothing'),
      ('preln', 'synth_random_trainable', False, 'synth_random_trainable=False does nothing'),
      ('realformer', 'running_mean', True, None),
      ('synth_factorized_random', 'synth_random_trainable', False, None),
      # Factorized variants that factor nothing: a factor of 1, a rank of the full length.
      ('synth_factorized_dense', 'synth_factorized_a', 32, 'factors it as 32 x 1: one factor '
       'of 1 makes it Dense'),
      ('synth_factorized_dense', 'synth_factorized_a', 4, None),
      ('synth_factorized_random', 'synth_factorized_rank', 32, 'synth_factorized_rank=32 is '
       'not below model.max_len=32')):
    c = tiny_config(variant)
    c.model[key] = value
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      config_checks.check_config(c)
    assert (said in caplog.text) if said else not caplog.text, (variant, caplog.text)


def test_a_warmup_in_steps_under_a_time_budget_is_a_warning(caplog):
  """Under a time budget the schedule runs on the spent share of num_steps: a warm-up given
  in steps is that share of the budget, whatever steps the time allows; as a fraction it is
  the budget's own share."""
  c = tiny_config(num_steps=1000, time_budget_minutes=0.5)
  c.optimizer.warmup_steps = 10
  with caplog.at_level(logging.WARNING):
    config_checks.check_config(c)
  assert ('optimizer.warmup_steps=10 with train.time_budget_minutes=0.5: the schedule follows '
          "the budget's share of train.num_steps=1000, so the warm-up lasts 1% of the budget"
          in caplog.text)
  caplog.clear()
  c.optimizer.warmup_steps = -1  # optimizer.warmup_fraction
  with caplog.at_level(logging.WARNING):
    config_checks.check_config(c)
  assert 'warm-up lasts' not in caplog.text


def test_the_start_says_how_the_run_reads_its_data():
  """The passes over the prepared instances, the microbatches of a step, and 'at most'
  under a time budget (a run on prepared data logs it: the embedded corpus's test)."""
  c = tiny_config(num_steps=300, grad_accum_steps=2, time_budget_minutes=1.0)
  c.train.batch_size = 32
  assert pretraining.passes_over_the_data(c, 1130) == (
      'train.num_steps=300 batches of 32 (each 2 microbatches of 16) read at most 9,600 '
      'instances: 8.5 passes over the 1,130 prepared (each masked anew)')


def test_a_run_cut_to_its_checkpoint_on_resume_is_evaluated_at_its_end(tmp_path):
  """Killed after its step-5 checkpoint (not an evaluation step), then resumed with
  num_steps=5: nothing is left to train, and the end is evaluated as the loop evaluates a
  run's last step (pretraining has no outputs that would otherwise ask for it)."""
  c = tiny_config(num_steps=8, checkpoint_every_steps=5, eval_every_steps=4, eval_steps=1)
  trained(c, tmp_path)
  shutil.rmtree(tmp_path / 'checkpoints' / '8')
  c.train.num_steps = 5
  summary = trained(c, tmp_path)
  assert summary['step'] == 5 and summary['eval'] != {}
  assert 5 in losses(tmp_path, 'eval')


def test_the_first_logged_window_compiles_nothing(tmp_path, monkeypatch):
  """The host's metric ops (adding two steps' metrics, computing their values) compile
  before the first window's clock starts, not inside it, so the first logged steps/s is the
  steps' own (on an accelerator an eager op's compile is the larger part of a short window).
  Trained on a device no other test trains on alone: its eager ops compile afresh here."""
  compiles, marks = [], []

  def listener(event, duration, **_):
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(time.perf_counter() - duration)
  restart, log = trainer.Window.restart_clock, trainer.Trainer._log

  def logged(self, *args, **kwargs):
    log(self, *args, **kwargs)
    marks.append(time.perf_counter())
  monkeypatch.setattr(trainer.Window, 'restart_clock',
                      lambda self: (marks.append(time.perf_counter()), restart(self))[1])
  monkeypatch.setattr(trainer.Trainer, '_log', logged)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    train.train_and_evaluate(tiny_config(num_steps=4, log_every_steps=2), str(tmp_path),
                             devices=jax.devices()[5:6])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  # marks: the loop's first window made, its clock restarted after the first step, its log
  first_window = (marks[1], marks[2])
  assert compiles and not [t for t in compiles if first_window[0] < t < first_window[1]]


def test_checkpoint_saves_are_not_counted_as_training_time(tmp_path, monkeypatch, caplog):
  """A save that blocks (here 1 s) is left out of the logged steps/s, as evaluation and
  compilation are: the same training reads the same speed whatever the checkpoint cadence.
  The ETA counts the saves still to come at the last one's time (from the second on)."""
  save = checkpoints.save

  def slow(*args, **kwargs):
    time.sleep(1.0)
    return save(*args, **kwargs)
  monkeypatch.setattr(checkpoints, 'save', slow)
  with caplog.at_level(logging.INFO):
    trained(tiny_config(num_steps=8, log_every_steps=2, checkpoint_every_steps=2), tmp_path)
  rates = losses(tmp_path, key='steps_per_sec')
  assert min(rate for step, rate in rates.items() if step > 2) > 5.0, rates  # (with: < 2)
  etas = {int(step): int(h) * 3600 + int(m) * 60 + int(sec) for step, h, m, sec in re.findall(
      r'step (\d+)/8: .* ETA (\d+):(\d+):(\d+)', caplog.text)}
  # from the second save on (the first's time, with its set-up, is not counted): at step 6
  # the saves of steps 6 and 8 (over a second each) and 2 quick steps; at 8, its own
  assert etas[4] == 0 and etas[6] >= 2 and etas[8] >= 1, etas  # (the steps alone: 0 s)


def test_the_evaluations_and_saves_still_to_come_count_the_last_step():
  cadence = trainer.Cadence(num_steps=12, log_every=1, eval_every=5, checkpoint_every=4)
  assert [cadence.still_to_come(step, 5) for step in (1, 5, 6, 10, 11, 12)] == [3, 3, 2, 2, 1, 1]
  assert [cadence.still_to_come(step, 4) for step in (1, 4, 5, 12)] == [3, 3, 2, 1]
  assert cadence.still_to_come(3, 0) == 0  # no evaluation


def test_a_stop_right_after_an_evaluation_logs_the_training_time_alone(tmp_path,
                                                                      monkeypatch):
  """A stop signal seen at an evaluation step (not a logging one) logs the steps since the
  last log before leaving: their steps/s leaves the evaluation (here 1 s) out."""
  from realformer.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  evaluate = trainer.Trainer._evaluate  # pylint: disable=protected-access

  def slow(self, step):
    time.sleep(1.0)
    return evaluate(self, step)
  monkeypatch.setattr(trainer.Trainer, '_evaluate', slow)
  checks = iter(range(1, 100))  # the loop checks once a step, from step 1
  monkeypatch.setattr(workdir_lib.StopSignal, 'reached', lambda self: next(checks) == 4)
  summary = trained(tiny_config(num_steps=8, log_every_steps=100, eval_every_steps=4,
                                eval_steps=1), tmp_path)
  assert summary['preempted'] == 4
  rate = losses(tmp_path, key='steps_per_sec')[4]
  assert rate > 5.0, rate  # (with the evaluation counted: below 3)


def test_a_time_budget_on_several_hosts_records_the_time_at_each_save(tmp_path, monkeypatch):
  """Process 0's clock is agreed every SYNC_EVERY steps and at every checkpoint step (the
  loop asks for it there): a checkpoint between two agreements records the time spent at
  its own step, not the last agreed one (which a resume would count from, losing the steps
  between), and the same figure the loop read to decide whether the step was the last."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  with monkeypatch.context() as m:
    m.setattr(jax, 'process_count', lambda: 2)
    m.setattr(multihost_utils, 'broadcast_one_to_all', lambda x: x)  # process 0's
    cadence = types.SimpleNamespace(time_budget_minutes=1.0, num_steps=100)
    budget = trainer.TimeBudget(cadence, optax.constant_schedule(1.0), RunDir(str(tmp_path)),
                                0)
    budget.start()
    budget.update(10)  # agreed
    time.sleep(0.3)
    assert budget.update(15) == budget.spent < 0.3  # between agreements: the agreed figure
    assert budget.update(15, sync=True) == budget.spent >= 0.3  # a checkpoint step's own
    budget.save(15)
    assert json.loads((tmp_path / RunDir.TIME_SPENT).read_text())['15'] == budget.spent
  # The loop syncs exactly at its checkpoint steps, the last one included.
  asked, update = [], trainer.TimeBudget.update

  def recorded(self, step, sync=False):
    asked.append((step, sync))
    return update(self, step, sync)
  monkeypatch.setattr(trainer.TimeBudget, 'update', recorded)
  trained(tiny_config(num_steps=6, checkpoint_every_steps=4, time_budget_minutes=60),
          tmp_path / 'run')
  assert [step for step, sync in asked if sync] == [4, 6] and len(asked) == 6
