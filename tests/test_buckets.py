"""Length buckets for fine-tuning: the chosen lengths are optimal, the training plan is a
deterministic, resumable cover of the epoch, evaluation sees every example once, and the
bucketed model predicts what the model padded to max_seq_length predicts, for every variant."""

import itertools
import types

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from configs import pretrain
from data import buckets
from realformer import models
from realformer.finetune import task as finetune_task
from realformer.train import partitioning
from realformer.train.run_dir import RunDir


def _padded(lengths, chosen):
  return buckets.padded_tokens(np.asarray(lengths), chosen)


@pytest.mark.parametrize('seed', range(6))
def test_chosen_lengths_pad_least_of_every_choice(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, 97, size=rng.integers(1, 60))  # at most max_len
  k, multiple, max_len, cover = int(rng.integers(1, 4)), 8, 96, int(rng.integers(0, 97))
  chosen = buckets.choose_lengths(lengths, k, multiple, max_len, cover=cover)
  top = min(-(-max(lengths.max(), cover) // multiple) * multiple, max_len)
  assert chosen[-1] == top and len(chosen) <= k
  assert all(c % multiple == 0 or c == max_len for c in chosen)
  # Brute force: every set of at most k lengths (multiples, or max_len) ending at `top`.
  grid = sorted({min(m, max_len) for m in range(multiple, top + multiple, multiple)})
  best = min(_padded(lengths, tuple(sorted(set(rest) | {top})))
             for r in range(k) for rest in itertools.combinations(grid[:-1], r))
  assert _padded(lengths, chosen) == best


def test_chosen_lengths_edge_cases():
  assert buckets.choose_lengths([5, 5, 5], 4, 16, 128) == (16,)  # one length is enough
  assert buckets.choose_lengths([200], 2, 16, 128) == (128,)  # capped at max_seq_length
  assert buckets.choose_lengths([10, 100], 2, 16, 100) == (16, 100)
  with pytest.raises(ValueError, match='num_buckets >= 1'):
    buckets.choose_lengths([5], 0, 16, 128)
  with pytest.raises(ValueError, match='longer than the longest length bucket'):
    buckets.bucket_index(np.array([40]), (16, 32))


def test_the_buckets_log_line_counts_examples_and_padding():
  assert buckets.describe(np.array([3, 5, 9, 10]), (8, 16), 16) == (
      'length buckets 8 (2 examples), 16 (2 examples): 2 compiled lengths, whose batches hold '
      '75% of the tokens that padding every batch to 16 would, 56% of them real')
  assert buckets.describe(np.array([3, 5]), (8,), 16).startswith(
      'length buckets 8 (2 examples): 1 compiled length, whose batches hold 50% ')


def test_training_plan_is_a_deterministic_cover_of_the_epoch():
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, 64, size=203)
  chosen = buckets.choose_lengths(lengths, 3, 16, 64)
  plan = buckets.train_batches(lengths, chosen, 8, seed=1, epoch=0)
  assert len(plan) == 203 // 8
  seen = np.concatenate([idx for _, idx in plan])
  assert len(seen) == len(set(seen.tolist())) == 25 * 8  # no example twice
  assert all(len(idx) == 8 and lengths[idx].max() <= length and length in chosen
             for length, idx in plan)
  assert len({length for length, _ in plan}) > 1  # batches of several lengths, interleaved
  again = buckets.train_batches(lengths, chosen, 8, seed=1, epoch=0)  # what a resume sees
  assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(plan, again))
  other = buckets.train_batches(lengths, chosen, 8, seed=1, epoch=1)
  assert not all(np.array_equal(a[1], b[1]) for a, b in zip(plan, other))
  # One bucket: the plain shuffled batches of max_seq_length.
  single = buckets.train_batches(lengths, (64,), 8, seed=1, epoch=0)
  assert len(single) == 25 and {length for length, _ in single} == {64}


def test_random_batches_are_the_shuffled_epochs_each_padded_to_fit_its_longest():
  """group_by_length=False: the batches of padded training (one bucket), each at the
  shortest bucket that holds its longest example; batch_longest is what they are padded
  from."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, 64, size=203)
  chosen = (24, 48, 64)
  for epoch in range(3):
    plan = buckets.train_batches(lengths, chosen, 8, seed=1, epoch=epoch, by_length=False)
    padded = buckets.train_batches(lengths, (64,), 8, seed=1, epoch=epoch)
    assert [idx.tolist() for _, idx in plan] == [idx.tolist() for _, idx in padded]
    assert [length for length, _ in plan] == [
        min(c for c in chosen if c >= lengths[idx].max()) for _, idx in plan]
    again = buckets.train_batches(lengths, (64,), 8, seed=1, epoch=epoch, by_length=False)
    assert [idx.tolist() for _, idx in again] == [idx.tolist() for _, idx in padded]
  assert len({length for length, _ in plan}) > 1
  grouped = buckets.train_batches(lengths, chosen, 8, seed=1, epoch=2)
  spans = lambda p: sum(lengths[idx].min() <= length - 24 for length, idx in p)
  # (grouped: only a bucket's few left over move up, a batch at most per bucket)
  assert spans(grouped) < len(chosen) < spans(plan)  # batches of several buckets' lengths
  longest = buckets.batch_longest(lengths, 8, seed=1, epochs=3)
  assert sorted(longest.tolist()) == sorted(
      int(lengths[idx].max()) for epoch in range(3)
      for _, idx in buckets.train_batches(lengths, chosen, 8, 1, epoch, by_length=False))
  assert buckets.batch_longest(lengths[:5], 8, seed=1, epochs=2).shape == (0,)
  assert buckets.describe(np.array([3, 5, 9, 10]), (8, 16), 16, np.array([5, 10])) == (
      'random batches padded to length buckets 8 (1 batch), 16 (1 batch): 2 compiled '
      'lengths, whose batches hold 75% of the tokens that padding every batch to 16 would, '
      'about 56% of them real')


@pytest.mark.parametrize('seed,compile_tokens', [(0, 0), (1, 0), (2, 0), (0, 300), (1, 300)])
def test_random_batches_lengths_cost_the_run_least(seed, compile_tokens, tmp_path):
  """With group_by_length=False the plan's lengths are the ones that cost the run least: the
  padded tokens of its own batches (every epoch's, each batch_size rows at its longest
  example's bucket) plus each length's compilation, stated in padded tokens
  (compile_cost_in_tokens): brute force over every choice."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, 95, size=rng.integers(20, 80))
  features = {'attention_mask': (np.arange(96) < lengths[:, None]).astype(np.int32)}
  task = types.SimpleNamespace(train=features, eval_features=lambda: [features],
                               flops_per_example=lambda length: 1.0 * length)
  config = ml_collections.ConfigDict(
      {'length_buckets': 3, 'group_by_length': False, 'bucket_multiple': 8,
       'max_seq_length': 96, 'num_epochs': 2, 'batch_size': 4, 'seed': seed,
       'bucket_compile_seconds': float(compile_tokens), 'bucket_flops_per_second': 1.0})
  assert finetune_task.compile_cost_in_tokens(config, task.flops_per_example)[1] == \
      compile_tokens  # (a padded token costs a second at one FLOP a second)
  chosen = finetune_task.length_buckets(config, task, RunDir(tmp_path), resuming=False)
  cost = lambda buckets_: compile_tokens * len(buckets_) + sum(
      4 * length for epoch in range(2) for length, _ in buckets.train_batches(
          lengths, buckets_, 4, seed, epoch, by_length=False))
  longest = buckets.batch_longest(lengths, 4, seed, 2)
  top = -(-int(longest.max()) // 8) * 8  # (an example in no batch needs no length)
  assert chosen[-1] == top and len(chosen) <= 3
  grid = list(range(8, top, 8))
  assert cost(chosen) == min(cost(tuple(rest) + (top,)) for r in range(3)
                             for rest in itertools.combinations(grid, r))
  if not compile_tokens:
    (tmp_path / 'grouped').mkdir()
    grouped = finetune_task.length_buckets(
        ml_collections.ConfigDict(dict(config.to_dict(), group_by_length=True)), task,
        RunDir(tmp_path / 'grouped'), resuming=False)
    assert cost(chosen) <= cost(grouped)


def test_evaluation_batches_cover_every_example_once():
  """Every example in exactly one batch of a bucket that holds it (run_model puts the outputs
  back in input order: test_bucketed_predictions_equal_the_padded_ones compares them row by
  row)."""
  lengths = np.array([3, 40, 17, 5, 64, 33, 9, 2, 50, 18, 7])
  chosen = (16, 32, 64)
  seen = []
  for length, idx, valid in buckets.eval_batches(lengths, chosen, 4):
    assert len(idx) == len(valid) == 4 and lengths[idx].max() <= length
    seen += idx[valid].tolist()
  assert sorted(seen) == list(range(len(lengths)))
  assert len(seen) == len(lengths)


# Plain attention, the carried scores, a dense synthesizer's length-wide projection and a
# random table mixed with dot products: each variant's own slicing to a shorter length is
# tested for every variant by tests/test_models.py's test_padding_does_not_change_real_positions;
# what is tested here is run_model's bucketing of the batches, its order and its heads.
@pytest.mark.parametrize('variant', ['postln', 'realformer', 'synth_dense',
                                     'synth_random_vanilla'])
@pytest.mark.parametrize('head', ['classification', 'span'])
def test_bucketed_predictions_equal_the_padded_ones(variant, head):
  """The outputs of run_model with buckets equal those padded to max_seq_length."""
  config = pretrain.get_config(f'{variant},tiny')
  config.unlock()
  m = config.model
  m.num_layers, m.hidden_size, m.num_heads, m.mlp_dim, m.max_len = 2, 32, 2, 64, 64
  m.vocab_size = 50
  model = models.build(m, head=head, **({'num_labels': 3} if head == 'classification' else {}))
  rng = np.random.default_rng(0)
  n, max_len = 13, 64
  lengths = rng.integers(3, 40, size=n)
  features = {'input_ids': np.zeros((n, max_len), np.int32),
              'segment_ids': np.zeros((n, max_len), np.int32),
              'attention_mask': (np.arange(max_len) < lengths[:, None]).astype(np.int32)}
  features['input_ids'][:] = np.where(features['attention_mask'],
                                      rng.integers(5, 50, (n, max_len)), 0)
  features['segment_ids'][:] = (np.arange(max_len) > lengths[:, None] // 2) * \
      features['attention_mask']
  params = nn.unbox(model.init(jax.random.PRNGKey(1),
                               {k: v[:2] for k, v in features.items()})['params'])
  predict = jax.jit(lambda p, b: model.apply({'params': p}, b)[1:])
  mesh = partitioning.make_mesh(ml_mesh(data=2))
  run = lambda chosen: finetune_task.run_model(predict, params, features, batch_size=4,
                                          buckets=chosen, mesh=mesh,
                                          token_outputs=head == 'span')
  chosen = buckets.choose_lengths(lengths, 3, 8, max_len)
  assert chosen[-1] < max_len  # the buckets are shorter than the padded length
  with jax.set_mesh(mesh):
    fixed, bucketed = run((max_len,)), run(chosen)
  for a, b in zip(fixed, bucketed):
    if head == 'span':  # real positions equal; the bucket's padding beyond is -inf
      real = features['attention_mask'] == 1
      np.testing.assert_allclose(b[real], a[real], rtol=1e-5, atol=1e-5)
      assert np.all(np.isneginf(b[:, chosen[-1]:]))
    else:
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
      assert np.array_equal(b.argmax(-1), a.argmax(-1))


def test_per_token_outputs_with_classes_and_per_token_labels_are_bucketed():
  """A tagging task's pieces: per-token outputs [B, length, C] come back padded to
  max_seq_length on the length axis alone, and labels per token (a task's sequence_keys) are
  cut to the batch's length with the inputs."""
  n, max_len = 6, 16
  lengths = np.array([3, 5, 16, 7, 2, 9])
  mask = (np.arange(max_len) < lengths[:, None]).astype(np.int32)
  features = {'input_ids': mask * 4, 'segment_ids': 0 * mask, 'attention_mask': mask}
  predict = jax.jit(lambda p, b: (jax.nn.one_hot(b['input_ids'], 5) + p,))
  mesh = partitioning.make_mesh(ml_mesh(data=2), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    out, = finetune_task.run_model(predict, 1.0, features, batch_size=2, buckets=(8, 16),
                                   mesh=mesh, token_outputs=True)
  assert out.shape == (n, max_len, 5)
  real = mask == 1
  np.testing.assert_array_equal(out[real], np.tile([1., 1., 1., 1., 2.], (real.sum(), 1)))
  short = lengths <= 8  # batched at length 8: the positions past it are -inf
  assert np.all(np.isneginf(out[short][:, 8:])) and np.all(np.isfinite(out[~short]))
  labels = {'attention_mask': mask, 'tags': np.arange(n * max_len).reshape(n, max_len),
            'label': np.arange(n)}
  taken = buckets.take(labels, np.array([0, 1]), 8, buckets.SEQUENCE_KEYS + ('tags',))
  assert taken['tags'].shape == (2, 8) and taken['label'].shape == (2,)
  # A model with a per-token input of its own (a task's input_keys, in its sequence_keys)
  # gets it in evaluation too, cut with the others; labels stay out of the model's batch.
  features = dict(features, word_starts=mask * 2, tags=mask * 7)
  extra = buckets.SEQUENCE_KEYS + ('word_starts',)
  predict = jax.jit(lambda p, b: (jax.nn.one_hot(b['word_starts'], 5) + p,))
  with jax.set_mesh(mesh):
    out, = finetune_task.run_model(predict, 1.0, features, batch_size=2, buckets=(8, 16),
                                   mesh=mesh, token_outputs=True, input_keys=extra,
                                   sequence_keys=extra + ('tags',))
  np.testing.assert_array_equal(out[real], np.tile([1., 1., 2., 1., 1.], (real.sum(), 1)))
  seen = []
  spy = lambda p, b: seen.append(sorted(b)) or predict(p, b)
  with jax.set_mesh(mesh):
    finetune_task.run_model(spy, 1.0, features, batch_size=2, buckets=(16,), mesh=mesh,
                            token_outputs=True, input_keys=extra)
  assert seen[0] == sorted(extra)
  assert buckets.take(labels, np.array([0, 1]), 8)['tags'].shape == (2, 16)


def ml_mesh(**axes):
  mesh = pretrain.mesh_config()
  mesh.unlock()
  for k, v in axes.items():
    mesh[k] = v
  mesh.fsdp, mesh.tensor = 1, -1
  return mesh


def test_each_length_must_pay_for_its_compilation_over_the_run():
  """choose_lengths with a compile cost: the number of lengths minimises epochs x padded
  tokens + lengths x tokens_per_compile (brute force over the count); a short run gets few
  lengths, a long one as many as allowed, and a free compile pads least."""
  rng = np.random.default_rng(0)
  lengths = np.minimum(rng.lognormal(3.0, 0.6, size=3200).astype(int) + 2, 128)
  least = {k: _padded(lengths, buckets.choose_lengths(lengths, k, 8, 128)) for k in range(1, 6)}
  cost = 20_000
  for epochs in (0.1, 1, 3, 30, 300):
    chosen = buckets.choose_lengths(lengths, 5, 8, 128, repeats=epochs, tokens_per_compile=cost)
    best = min(epochs * least[k] + k * cost for k in least)
    assert epochs * _padded(lengths, chosen) + len(chosen) * cost == pytest.approx(best)
  counts = [len(buckets.choose_lengths(lengths, 5, 8, 128, repeats=e, tokens_per_compile=cost))
            for e in (0.01, 1, 300)]
  assert counts[0] == 1 and counts[0] < counts[1] < counts[2] == 5
  assert buckets.choose_lengths(lengths, 5, 8, 128, repeats=0.01, tokens_per_compile=0) == \
      buckets.choose_lengths(lengths, 5, 8, 128)
