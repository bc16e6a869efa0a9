"""Attention analysis: entropy and Jensen-Shannon divergence against hand-computed values, and
the whole analysis on a tiny checkpoint."""

import json
import math
import os
import shutil

import jax
import flax.linen as nn
import numpy as np
import pytest

import analyze
from configs import pretrain
from realformer import models
from realformer.model.spec import resolve
from realformer.tools import analysis
from realformer.train import checkpoints


def rows(*dists):
  """[1, 1, n, n] attention from a list of query rows (n = len(dists))."""
  return np.array(dists, np.float64)[None, None]


def test_entropy_hand_computed_and_padding_excluded():
  uniform = rows([1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0])
  ent = analysis.attention_entropy(uniform, np.array([[1, 1, 1]]))
  np.testing.assert_allclose(ent, [math.log(3), 0.0, math.log(2)])
  ent = analysis.attention_entropy(uniform, np.array([[1, 1, 0]]))  # third query is padding
  np.testing.assert_allclose(ent, [math.log(3), 0.0])


def test_head_entropies_are_per_head_and_ordered_by_median():
  """The paper's Figure 4: each head's entropies over the real queries, the heads of a layer
  ordered by their medians."""
  uniform, one_hot = [1 / 4] * 4, [1.0, 0.0, 0.0, 0.0]
  half = [0.5, 0.5, 0.0, 0.0]
  probs = np.array([[[uniform, uniform, uniform, half],       # head 0: medians ln 4
                     [one_hot, one_hot, half, one_hot],       # head 1: 0
                     [half, half, half, uniform]]], np.float64)  # head 2: ln 2
  heads = analysis.head_entropies(probs, np.array([[1, 1, 1, 0]]))  # last query is padding
  assert [len(h) for h in heads] == [3, 3, 3]
  np.testing.assert_allclose(heads[0], [0.0, 0.0, math.log(2)])
  np.testing.assert_allclose(heads[1], [math.log(2)] * 3)
  np.testing.assert_allclose(heads[2], [math.log(4)] * 3)
  pooled = analysis.attention_entropy(probs, np.array([[1, 1, 1, 0]]))
  np.testing.assert_allclose(np.sort(np.concatenate(heads)), np.sort(pooled))


def test_js_divergence_hand_computed():
  mask = np.array([[1, 1]])
  p = rows([0.5, 0.5], [1.0, 0.0])
  assert analysis.js_divergence(p, p, mask) == pytest.approx(0.0)
  q = rows([0.5, 0.5], [0.0, 1.0])  # second row: disjoint one-hots -> ln 2
  assert analysis.js_divergence(p, q, mask) == pytest.approx(math.log(2) / 2)
  r = rows([1.0, 0.0], [1.0, 0.0])
  # JS([.5,.5], [1,0]): m = [.75,.25]; (KL(p||m) + KL(r||m)) / 2
  expected = (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25) + math.log(1 / 0.75)) / 2
  assert analysis.js_divergence(p, r, mask) == pytest.approx(expected / 2)
  assert analysis.js_divergence(p, r, np.array([[1, 0]])) == pytest.approx(expected)
  m = analysis.js_matrix([p, q, r], mask)
  assert m.shape == (3, 3) and np.allclose(m, m.T) and np.allclose(np.diag(m), 0)
  assert m[0, 1] == pytest.approx(math.log(2) / 2)


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  config = pretrain.get_config('realformer,tiny')
  config.unlock()
  config.model.num_layers, config.model.hidden_size, config.model.num_heads = 3, 32, 2
  config.model.mlp_dim, config.model.max_len = 64, 32
  config.data.max_seq_length, config.data.max_predictions_per_seq = 32, 5
  model = models.build(config.model)
  batch = {k: np.zeros((1, 32), np.int32) for k in ('input_ids', 'segment_ids',
                                                    'attention_mask')}
  params = nn.unbox(model.init(jax.random.PRNGKey(0), batch)['params'])
  checkpoints.save_params(workdir, params, config, step=7)
  return workdir, config, params


def test_analysis_reads_the_saved_encoder(tiny_run):
  workdir, config, params = tiny_run
  batch = analysis.heldout_batch(workdir, config, 4)
  batch['attention_mask'][0, -5:] = 0  # a padded example: its last 5 queries are left out
  batch['input_ids'][0, -5:] = 0
  result = analysis.analyze_run(workdir, batch=batch)
  encoder = models.build(config.model, head='encoder')
  out = encoder.apply({'params': params['encoder']}, batch, capture_attention=True)
  assert result['entropies'][0].size == 2 * (4 * 32 - 5)  # heads x real queries
  for got, heads, medians, probs in zip(result['entropies'], result['head_entropies'],
                                       result['entropy_head_medians'], out.attention):
    np.testing.assert_allclose(got, analysis.attention_entropy(probs, batch['attention_mask']),
                               rtol=1e-5)
    want = analysis.head_entropies(probs, batch['attention_mask'])
    assert len(heads) == 2 and all(h.size == 4 * 32 - 5 for h in heads)
    for g, w in zip(heads, want):
      np.testing.assert_allclose(g, w, rtol=1e-5)
    assert medians == sorted(medians)
    np.testing.assert_allclose(medians, [np.median(h) for h in want], rtol=1e-5)


def test_analysis_end_to_end_on_a_tiny_checkpoint(tiny_run, tmp_path, capsys):
  tiny_run = tiny_run[0]
  result = analysis.analyze_run(tiny_run, num_examples=8)
  assert result['variant'] == 'realformer'
  assert len(result['entropies']) == 3 and len(result['js_adjacent']) == 2
  for e in result['entropies']:
    assert e.size > 8 * 2 * 5 and (e >= 0).all() and (e <= math.log(32) + 1e-9).all()
  m = np.array(result['js_all_pairs'])
  assert (m >= 0).all() and (m <= math.log(2) + 1e-9).all() and m[0, 1] > 0
  out = tmp_path / 'report'
  analyze.main(['--workdir', tiny_run, '--workdir', tiny_run, '--label', 'a', '--label', 'b',
                '--out', str(out), '--num_examples', '8'])
  for name in ('attention_entropy.png', 'attention_entropy_heads.png', 'attention_js.png',
               'attention.json', 'attention.md'):
    assert (out / name).stat().st_size > 100
  numbers = json.loads((out / 'attention.json').read_text())
  assert numbers['a']['js_adjacent'] == pytest.approx(result['js_adjacent'])
  np.testing.assert_allclose(numbers['b']['entropy_head_medians'], result['entropy_head_medians'])
  step = int(os.path.basename(checkpoints.resolve_step_dir(tiny_run)))
  assert numbers['a']['step'] == result['step'] == step  # the checkpoint analysed, named
  assert f'| a | {step} | ' in (out / 'attention.md').read_text()
  # Not a run: a path that is not there, a sweep's root (which names a run inside it).
  with pytest.raises(FileNotFoundError, match='--workdir /nowhere does not exist'):
    analyze.main(['--workdir', '/nowhere', '--out', str(tmp_path / 'r2')])
  parent = os.path.dirname(tiny_run)
  with pytest.raises(FileNotFoundError, match=rf"{parent} has no config.json \(a sweep's root\? "
                     rf'its runs are folders such as {parent}/'):
    analyze.main(['--workdir', parent, '--out', str(tmp_path / 'r2')])
  # A sweep's root: its runs that hold a checkpoint (one that holds none yet is said).
  root = tmp_path / 'sweep'
  for name in ('model.variant=realformer,seed=0', 'model.variant=realformer,seed=1'):
    shutil.copytree(tiny_run, root / name)
    (root / name / 'overrides.json').write_text('{}')
  (root / 'model.variant=realformer,seed=2').mkdir()
  (root / 'model.variant=realformer,seed=2' / 'overrides.json').write_text('{}')
  analyze.main(['--workdir', str(root), '--out', str(tmp_path / 'swept'), '--num_examples', '4'])
  assert sorted(json.loads((tmp_path / 'swept' / 'attention.json').read_text())) == [
      'realformer (seed=0)', 'realformer (seed=1)']
  assert f'{root}: 1 of its 3 runs hold no checkpoint yet, left out' in capsys.readouterr().err
  with pytest.raises(ValueError, match=r'give one --label per run \(or none\): 1 for 2 runs'):
    analyze.main(['--workdir', str(root), '--out', str(tmp_path / 'swept'), '--label', 'a'])
  with pytest.raises(ValueError, match=r'--num_examples=100000: the eval split of .* holds '
                     r'\d+ examples; give at most'):
    analysis.analyze_run(tiny_run, num_examples=100000)


def test_a_mixtures_learned_weights_are_reported_per_layer(tmp_path):
  """The Synthesizer paper's diagnostic: each layer's mixture weights (the softmax of its
  mixture logits, in model.attention's order), unrolled or scanned; none for an encoder
  that mixes nothing."""
  config = pretrain.get_config('synth_random_vanilla,tiny')
  spec = resolve(config.model)
  logits = np.array([[0.3, -0.2], [1.0, 0.0]])
  unrolled = {f'layers_{i}': {'attention': {'mixture_logits': row}}
              for i, row in enumerate(logits)}
  scanned = {'layers': {'attention': {'mixture_logits': logits}}}
  want = [dict(zip(spec.mixture, np.exp(row) / np.exp(row).sum())) for row in logits]
  for params in (unrolled, scanned):
    got = analysis.mixture_weights(params, spec)
    assert [list(layer) for layer in got] == [list(spec.mixture)] * 2
    for layer, expected in zip(got, want):
      assert layer == pytest.approx(expected)
  assert analysis.mixture_weights(unrolled, resolve(pretrain.get_config('postln,tiny').model)
                                  ) is None
  results = [{'variant': 'synth_random_vanilla', 'workdir': '/w', 'step': 3,
              'entropy_mean': [1.0, 1.0], 'js_adjacent': [0.1], 'js_all_pairs': [[0, 0.1],
                                                                                  [0.1, 0]],
              'entropies': [np.ones(4)] * 2, 'head_entropies': [[np.ones(4)] * 2] * 2,
              'mixture_weights': analysis.mixture_weights(unrolled, spec)}]
  numbers = analysis.write_report(results, str(tmp_path / 'report'))
  assert numbers['synth_random_vanilla']['mixture_weights'][1] == pytest.approx(want[1])
  report = (tmp_path / 'report' / 'attention.md').read_text()
  first = ', '.join(f'{c} {w:.3f}' for c, w in want[0].items())
  assert f'| synth_random_vanilla | 1 | {first} |' in report  # (layers from 1, as the figures')


@pytest.mark.parametrize('variant', ['synth_random', 'synth_factorized_random'])
def test_a_random_tables_attention_is_drawn_per_layer(variant, tmp_path):
  """The Synthesizer paper's figure of the learned Random weights: each layer's table (R, or
  R1 R2^T) as the softmax over its keys at the analysed length, the heads averaged, from
  unrolled or scanned params; drawn in attention_random.png and named in the report."""
  spec = resolve(pretrain.get_config(f'{variant},tiny').model)
  rng = np.random.default_rng(0)
  h, n = spec.num_heads, spec.max_len
  layers = []
  for _ in range(spec.num_layers):
    layers.append({'synth_random': {'random_logits': rng.normal(size=(h, n, n))}}
                  if variant == 'synth_random' else
                  {'synth_factorized_random': {'random_factor_1': rng.normal(size=(h, n, 3)),
                                               'random_factor_2': rng.normal(size=(h, n, 3))}})
  unrolled = {f'layers_{i}': {'attention': a} for i, a in enumerate(layers)}
  scanned = {'layers': {'attention': jax.tree.map(lambda *x: np.stack(x), *layers)}}
  for params in (unrolled, scanned):
    maps = analysis.random_maps(params, spec, 5)
    assert len(maps) == spec.num_layers
    for layer, got in zip(layers, maps):
      table = next(iter(layer.values()))
      logits = (table['random_logits'][:, :5, :5] if variant == 'synth_random' else
                table['random_factor_1'][:, :5] @ table['random_factor_2'][:, :5].transpose(
                    0, 2, 1))
      want = np.mean([np.exp(row) / np.exp(row).sum(-1, keepdims=True) for row in logits], 0)
      np.testing.assert_allclose(got, want, rtol=1e-12)
  assert analysis.random_maps(unrolled, resolve(pretrain.get_config('postln,tiny').model),
                              5) is None
  results = [{'variant': variant, 'workdir': '/w', 'step': 3, 'entropy_mean': [1.0, 1.0],
              'js_adjacent': [0.1], 'js_all_pairs': [[0, 0.1], [0.1, 0]],
              'entropies': [np.ones(4)] * 2, 'head_entropies': [[np.ones(4)] * 2] * 2,
              'random_maps': maps}]
  analysis.write_report(results, str(tmp_path / 'report'))
  assert (tmp_path / 'report' / 'attention_random.png').stat().st_size > 1000
  assert "learned Random table as attention" in (tmp_path / 'report' / 'attention.md'
                                                  ).read_text()


def test_runs_of_one_variant_get_labels_of_their_own():
  """Without --label, each run is named by its variant; runs of one variant (seeds of a
  sweep) by their workdir's folder too, so that attention.json keeps every run."""
  runs = [{'variant': 'realformer', 'workdir': '/r/seed=0'},
          {'variant': 'realformer', 'workdir': 'gs://b/r/seed=1/'},
          {'variant': 'postln', 'workdir': '/r/postln'},
          {'variant': 'preln', 'workdir': '/a/run'}, {'variant': 'preln', 'workdir': '/b/run'},
          {'variant': 'synth_dense', 'workdir': '/s/model.variant=synth_dense,'
                                                'optimizer.learning_rate=0.0001,seed=0'},
          {'variant': 'synth_dense', 'workdir': '/s/model.variant=synth_dense,'
                                                'optimizer.learning_rate=0.0002,seed=0'}]
  assert analysis.default_labels(runs) == [
      'realformer (seed=0)', 'realformer (seed=1)', 'postln', 'preln (run) #4', 'preln (run) #5',
      'synth_dense (learning_rate=0.0001,seed=0)', 'synth_dense (learning_rate=0.0002,seed=0)']
  with pytest.raises(ValueError, match='repeat one; give each --workdir its own --label'):
    analysis.write_report(runs[:2], '/tmp/unused', ['a', 'a'])


def test_runs_of_other_seeds_are_analysed_on_one_text_and_the_folder_stays_as_it_was(
    tiny_run, tmp_path):
  """Each run's own preparation holds out other documents when its seed differs: runs of
  one tokenizer and length are analysed on the first one's held-out examples, and the
  report says which text each was; a run of another length gets its own, said as such.
  An encoder folder (best/, final/, an import) gets no data/ folder written into it, and
  a run's checkpoint step folder is taken too."""
  workdir, config, params = tiny_run
  other = str(tmp_path / 'seed1')
  config_1 = config.copy_and_resolve_references()
  config_1.seed = 1
  checkpoints.save_params(other, params, config_1, step=7)
  short = str(tmp_path / 'short')
  config_s = config.copy_and_resolve_references()
  config_s.data.max_seq_length = 16
  checkpoints.save_params(short, params, config_s, step=7)
  mlm = str(tmp_path / 'mlm')  # RoBERTa's objective: one segment, not sentence pairs
  config_m = config.copy_and_resolve_references()
  config_m.objective = 'mlm'
  checkpoints.save_params(mlm, params, config_m, step=7)
  results = analysis.analyze_runs([workdir, other, short, mlm], num_examples=4)
  texts = [r['text'] for r in results]
  assert texts[0] == texts[1] and texts[0]['from'] == workdir and texts[1]['from'] == workdir
  assert texts[2]['max_seq_length'] == 16 and texts[2]['from'] == short
  assert texts[3]['from'] == mlm and texts[3]['crc'] != texts[0]['crc']
  results = results[:3]
  assert analysis.text_of(analysis.heldout_batch(other, config_1, 4))['crc'] != texts[0]['crc']
  for folder in (workdir, other, short):
    assert not os.path.exists(os.path.join(folder, 'data')), folder
  numbers = analysis.write_report(results, str(tmp_path / 'report'), ['a', 'b', 'c'])
  assert numbers['b']['text'] == texts[0] and len(numbers['c']['entropy_median_by_head']) == 3
  assert sorted(numbers['a']['entropy_median_by_head'][0]) == numbers['a'][
      'entropy_head_medians'][0]  # the same medians, in head order
  md = (tmp_path / 'report' / 'attention.md').read_text()
  assert f'Text of a, b: 4 held-out examples of {workdir} at length 32' in md
  assert 'analysed on different texts' in md
  assert 'different steps' not in md  # (every one at step 7)
  results[1]['step'] = 5  # a run analysed while it trains, say
  analysis.write_report(results, str(tmp_path / 'report'), ['a', 'b', 'c'])
  md = (tmp_path / 'report' / 'attention.md').read_text()
  assert ('The runs were analysed at different steps (a 7, b 5, c 7): their numbers differ by '
          'training too.') in md
  step_dir = str(checkpoints.resolve_step_dir(workdir))  # one of its checkpoints
  analyze.main(['--workdir', step_dir, '--out', str(tmp_path / 'step'), '--num_examples', '4'])
  assert json.loads((tmp_path / 'step' / 'attention.json').read_text())['realformer']['step'] == 7


def test_the_analysis_in_chunks_gives_the_whole_batchs_figures(tiny_run, monkeypatch):
  """The model sees the examples a chunk at a time (memory: one chunk's attention); the
  entropies, the medians and the JS divergences are those of one pass over all of them."""
  workdir, config, _ = tiny_run
  batch = analysis.heldout_batch(workdir, config, 8)
  batch['attention_mask'][5, -7:] = 0  # a padded example, in the second chunk
  whole = analysis.analyze_run(workdir, batch=batch)
  monkeypatch.setattr(analysis, 'CHUNK', 3)  # chunks of 3, 3 and 2
  chunked = analysis.analyze_run(workdir, batch=batch)
  for a, b in zip(whole['entropies'], chunked['entropies']):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  np.testing.assert_allclose(whole['js_all_pairs'], chunked['js_all_pairs'], rtol=1e-5)
  np.testing.assert_allclose(whole['entropy_median_by_head'],
                             chunked['entropy_median_by_head'], rtol=1e-5)
  assert whole['entropies'][0].size == 2 * (8 * 32 - 7)
