"""GLUE fine-tuning: the task files, the metrics' definitions, and the whole path from a
pretraining checkpoint to dev metrics and submission files (resume and mismatch included)."""

import dataclasses
import json
import os
import re
import shutil
import types
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import finetune
from configs import finetune as finetune_configs
from configs import pretrain
from data import glue
from data import sources
from data import tokenizer as tokenizer_lib
from realformer import models
from realformer import storage
from realformer.finetune import metrics as finetune_metrics
from realformer.finetune import registry
from realformer.finetune import task as finetune_task
from realformer.model.spec import resolve
from realformer.train import checkpoints
from realformer.train import metrics_jsonl
from realformer.train import partitioning
from realformer.train import train_lib
from realformer.train import trainer
from realformer.train import workdir as workdir_lib
from realformer.train.run_dir import RunDir
from tests import test_wordpiece

GLUE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'glue')


@pytest.mark.parametrize('task', sorted(glue.TASKS))
def test_every_task_reads_its_official_tsvs(task):
  spec = glue.TASKS[task]
  for split in spec.splits:
    examples = glue.read_tsv(task, GLUE_DIR, split)
    assert examples and all(e.text_a for e in examples)
    assert all((e.text_b is not None) == (len(spec.text) == 2) for e in examples)
    if split == 'test':
      assert all(e.label is None for e in examples)
    elif spec.labels:
      assert all(e.label in range(len(spec.labels)) for e in examples)
    else:
      assert all(0.0 <= e.label <= 5.0 for e in examples)
  with pytest.raises(FileNotFoundError, match='config.data_dir'):
    glue.read_tsv('cola', '/nonexistent', 'train')
  with pytest.raises(ValueError, match='unknown GLUE task'):
    glue.get_task('sst-5')


def test_malformed_glue_rows_name_file_and_line(tmp_path, caplog):
  rte = tmp_path / 'RTE'
  rte.mkdir()
  (rte / 'train.tsv').write_text('index\tsentence1\tsentence2\tlabel\n'
                                 '0\tA man.\tA person.\tentailment\n'
                                 '1\tcut short\n'
                                 '2\tA dog.\tA cat.\tnot_entailment\n')
  with pytest.raises(ValueError, match=r'RTE/train.tsv:3: 2 columns where 4 are expected.*'
                                       r'skip_malformed_rows'):
    glue.read_tsv('rte', str(tmp_path), 'train')
  examples = glue.read_tsv('rte', str(tmp_path), 'train', skip_malformed=True)
  assert [e.guid for e in examples] == ['0', '2']
  assert 'skipped 1 malformed rows' in caplog.text and 'lines 3' in caplog.text
  # Blank lines (a file's last ones, often) are no rows, as Hugging Face's loader reads them.
  (rte / 'dev.tsv').write_text('index\tsentence1\tsentence2\tlabel\n'
                               '0\tA man.\tA person.\tentailment\n\n\n')
  assert [e.guid for e in glue.read_tsv('rte', str(tmp_path), 'dev')] == ['0']
  cola = tmp_path / 'CoLA'
  cola.mkdir()
  (cola / 'train.tsv').write_text('gj04\t1\t\tGood.\ngj04\t0\n')  # CoLA: was IndexError
  with pytest.raises(ValueError, match=r'CoLA/train.tsv:2: 2 columns where 4'):
    glue.read_tsv('cola', str(tmp_path), 'train')
  (cola / 'train.tsv').write_text('gj04\t1\t\tGood.\ngj04\tmaybe\t\tBad.\n')
  with pytest.raises(ValueError, match=r"CoLA/train.tsv:2: CoLA: label 'maybe'"):
    glue.read_tsv('cola', str(tmp_path), 'train')
  (cola / 'train.tsv').write_bytes(b'gj04\t1\t\t\xff\xfe bad bytes\n')
  with pytest.raises(ValueError, match='not UTF-8'):
    glue.read_tsv('cola', str(tmp_path), 'train')
  (rte / 'test.tsv').write_text('index\tsentence1\tsentence2\n')  # a header only: it used
  with pytest.raises(ValueError, match=r'RTE/test.tsv holds no examples \(no rows below the '
                                       r'header\).*remove the file'):  # to fail after training
    glue.read_tsv('rte', str(tmp_path), 'test')
  (rte / 'dev.tsv').write_text('index\tsentence1\tsentence2\tlabels\n1\tA.\tB.\tentailment\n')
  with pytest.raises(ValueError, match=r"RTE/dev.tsv: columns \['label'\] missing"):
    glue.read_tsv('rte', str(tmp_path), 'dev')  # was a KeyError
  (rte / 'dev.tsv').write_text('index\tsentence1\tsentence2\tlabel\n1\tcut short\n')
  with pytest.raises(ValueError, match='RTE/dev.tsv holds no examples \\(every row was'):
    glue.read_tsv('rte', str(tmp_path), 'dev', skip_malformed=True)
  with pytest.raises(ValueError, match=r'RTE/dev.tsv:2: 2 columns.*skips training rows only'):
    glue.read_tsv('rte', str(tmp_path), 'dev')


def test_featurize_pairs_truncates_the_longer_side():
  tok = tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)
  ex = [glue.Example('0', 'the union is strong ' * 10, 'peace', 1)]
  f = glue.featurize(ex, tok, 16)
  ids = f['input_ids'][0]
  sep = np.flatnonzero(ids == tok.sep_id)
  assert ids[0] == tok.cls_id and len(sep) == 2 and sep[1] == 15
  assert tok.decode(ids[sep[0] + 1:sep[1]]) == 'peace'  # the short side is kept whole
  np.testing.assert_array_equal(f['segment_ids'][0], [0] * (sep[0] + 1) + [1] * (15 - sep[0]))
  assert f['attention_mask'][0].sum() == 16 and f['label'][0] == 1
  # An empty (or all-whitespace) second text is a single sentence, as in BERT's
  # run_classifier (`if tokens_b:`), not [CLS] A [SEP] [SEP] with a segment of B.
  single = glue.featurize([glue.Example('0', 'peace', None, 0)], tok, 8)
  for empty in ('', ' \t '):
    f = glue.featurize([glue.Example('0', 'peace', empty, 0)], tok, 8)
    for key in ('input_ids', 'segment_ids', 'attention_mask'):
      np.testing.assert_array_equal(f[key], single[key])


def test_submission_rows_carry_their_test_file_s_index(tmp_path):
  """GLUE's server matches a prediction to its row by the test file's index column (QQP's
  id), not by order: each row keeps its example's, the label is the task's string, STS-B's
  score has three decimals."""
  folder = tmp_path / 'MNLI'
  folder.mkdir()
  (folder / 'test_matched.tsv').write_text(
      'index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\n'
      '1043\t1\t1e\tfiction\tA man sleeps.\tA man is awake.\n'
      '7\t2\t2n\tfiction\tIt rains.\tThe street is wet.\n')
  examples = glue.read_tsv('mnli', str(tmp_path), 'test')
  assert [ex.guid for ex in examples] == ['1043', '7']
  path = glue.write_predictions('mnli', examples, np.array([2, 0]), str(tmp_path / 'out'))
  assert open(path).read() == 'index\tprediction\n1043\tcontradiction\n7\tentailment\n'
  path = glue.write_predictions('stsb', examples, np.array([3.14159, 0.5]),
                                str(tmp_path / 'out'))
  assert open(path).read() == 'index\tprediction\n1043\t3.142\n7\t0.500\n'
  # A task of one's own whose ids are words keeps them (and without an id column, the rows).
  mine = glue.local_task('mine', ('text',), 'label', ('no', 'yes'), 'accuracy')
  (tmp_path / 'mine').mkdir()
  (tmp_path / 'mine' / 'test.tsv').write_text('id\ttext\nrev-b\tGood.\nrev-a\tBad.\n')
  path = glue.write_predictions(mine, glue.read_tsv(mine, str(tmp_path / 'mine'), 'test'),
                                np.array([1, 0]), str(tmp_path / 'out'))
  assert open(path).read() == 'index\tprediction\nrev-b\tyes\nrev-a\tno\n'
  (tmp_path / 'mine' / 'test.tsv').write_text('text\nGood.\nBad.\n')
  path = glue.write_predictions(mine, glue.read_tsv(mine, str(tmp_path / 'mine'), 'test'),
                                np.array([1, 0]), str(tmp_path / 'out'))
  assert open(path).read() == 'index\tprediction\n0\tyes\n1\tno\n'


def test_label_ids_and_text_fields_are_tfds_s():
  """Label i of a task read from tfds or Hugging Face (nyu-mll/glue: tfds's configs) is
  tfds's class i, and its text fields are tfds's in order, for every GLUE task."""
  from tensorflow_datasets.text import glue as tfds_glue  # pylint: disable=g-import-not-at-top
  configs = {c.name: c for c in tfds_glue.Glue.BUILDER_CONFIGS}
  for name, task in glue.TASKS.items():
    theirs = configs[name]
    assert task.tfds_text == tuple(theirs.text_features), name
    if not task.labels:
      assert theirs.label_classes is None, name
    elif task.labels[0].isdigit():  # GLUE's files write the class index itself
      assert task.labels == tuple(str(i) for i in range(len(theirs.label_classes))), name
    else:
      assert task.labels == tuple(theirs.label_classes), name


def test_metrics_match_their_definitions():
  # MCC = (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)): TP=2, TN=1, FP=1, FN=1.
  preds, labels = [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]
  m = finetune_metrics.glue_metrics('cola', preds, labels)
  assert m['mcc'] == pytest.approx((2 * 1 - 1 * 1) / np.sqrt(3 * 3 * 2 * 2))
  m = finetune_metrics.glue_metrics('mrpc', preds, labels)
  assert m['f1'] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1)) and m['accuracy'] == 0.6
  # The majority predictor's (always 1) in each metric: MRPC's F1 of always 1 is not 0.
  assert m['majority_accuracy'] == 0.6  # three of the five labels are 1
  assert m['majority_f1'] == pytest.approx(2 * 3 / (2 * 3 + 2))
  assert finetune_metrics.glue_metrics('cola', preds, labels)['majority_mcc'] == 0.0
  m = finetune_metrics.glue_metrics('stsb', [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 4.0, 3.0])
  assert m['pearson'] == pytest.approx(0.8) and m['spearman'] == pytest.approx(0.8)
  # Ties take their average rank: ranks (1.5, 1.5, 3, 4) and (1, 2.5, 2.5, 4), r = 3.75 / 4.5.
  m = finetune_metrics.glue_metrics('stsb', [1.0, 1.0, 2.0, 3.0], [1.0, 2.0, 2.0, 3.0])
  assert m['spearman'] == pytest.approx(3.75 / 4.5)
  assert finetune_metrics.headline('rte', {'accuracy': 0.7}) == 0.7
  assert tuple(finetune_metrics.CLASSIFICATION) == glue.CLASSIFICATION_METRICS  # one list
  assert finetune_metrics.headline('cola', {'accuracy': 0.7, 'mcc': 0.2}) == 0.2
  # the BERT paper's Table 1: Spearman for STS-B, F1 for MRPC and QQP
  assert finetune_metrics.headline('stsb', {'pearson': 0.9, 'spearman': 0.8}) == 0.8
  assert finetune_metrics.headline('qqp', {'accuracy': 0.9, 'f1': 0.8}) == 0.8
  # The headline is the task's own metric (data/glue.TASKS), one place for a fork to change.
  for name, task in glue.TASKS.items():
    allowed = finetune_metrics.CLASSIFICATION if task.labels else glue.REGRESSION_METRICS
    assert task.metric in allowed, name
  rte = glue.TASKS['rte']
  with mock.patch.dict(glue.TASKS, rte=rte._replace(metric='f1')):
    m = finetune_metrics.glue_metrics('rte', preds, labels)
    assert finetune_metrics.headline('rte', m) == m['f1'] == pytest.approx(2 / 3)
  assert tuple(finetune_metrics.CLASSIFICATION) == glue.CLASSIFICATION_METRICS
  # A task of one's own: macro F1 over three classes (the mean of per-class F1).
  topics = glue.local_task('topics', ['text'], 'topic', ['a', 'b', 'c'], 'macro_f1')
  m = finetune_metrics.glue_metrics(topics, [0, 1, 2, 2], [0, 1, 1, 2])
  assert finetune_metrics.headline(topics, m) == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
  for args, error in (((['a', 'b', 'c'], 'label', ['x', 'y']), 'one or two text columns'),
                      ((['a'], 'label', ['x', 'x']), 'two or more distinct values'),
                      ((['a'], 'label', ['x', 'y', 'z'], 'f1'), 'f1 is of two labels'),
                      ((['a'], 'label', [], 'accuracy'), 'choose one of pearson, spearman')):
    with pytest.raises(ValueError, match=error):
      glue.local_task('t', *args, *(() if len(args) == 4 else ('accuracy',)))


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """A tiny pretraining workdir: a BertForPretraining checkpoint + config.json."""
  workdir = str(tmp_path_factory.mktemp('pretrained'))
  save_tiny_encoder(workdir, 'postln', num_layers=2, num_heads=2, step=10)
  return workdir


def save_tiny_encoder(workdir: str, variant: str, num_layers: int, num_heads: int,
                      step: int, moved: bool = False):
  """A params-only pretraining checkpoint of a freshly initialized tiny encoder (moved: every
  value scaled by 1.5, as if trained: no fresh init equals it); its params."""
  config = pretrain.get_config(f'{variant},tiny')
  config.unlock()
  config.model.num_layers, config.model.hidden_size = num_layers, 32
  config.model.num_heads, config.model.mlp_dim = num_heads, 64
  batch = {k: np.zeros((1, 8), np.int32) for k in ('input_ids', 'segment_ids',
                                                   'attention_mask')}
  params = nn.unbox(models.build(config.model).init(jax.random.PRNGKey(0), batch)['params'])
  if moved:
    params = jax.tree.map(lambda x: x * 1.5, params)
  checkpoints.save_params(workdir, params, config, step=step)
  return params


def ft_config(task, init, **overrides):
  """A tiny run on 8 fake devices' tensor mesh. Its length buckets are the default cost
  model's (one length for so small a run: one train step and one prediction program to
  compile); the tests of several lengths pass bucket_compile_seconds=0, which pads least."""
  c = finetune_configs.get_config(f'glue/{task}')
  c.unlock()
  c.init_checkpoint, c.data_dir = init, GLUE_DIR
  c.batch_size, c.eval_batch_size, c.num_epochs, c.max_seq_length = 2, 4, 2, 64
  c.optimizer.learning_rate = 1e-4
  c.mesh.data, c.mesh.tensor = 1, -1  # 8 fake devices, tensor parallel: any batch size
  for k, v in overrides.items():
    c[k] = v
  return c


def test_a_nan_loss_advises_float32_to_a_run_in_half_precision_alone():
  """(the dtype the encoder computes in: the pretrained one, or config.model.dtype)"""
  hint = lambda dtype: finetune_task.FinetuneTask.nonfinite_hint.fget(types.SimpleNamespace(
      spec=types.SimpleNamespace(dtype=dtype)))
  assert hint(jnp.float32) == (
      'lower config.optimizer.learning_rate or raise config.optimizer.warmup_fraction')
  assert hint(jnp.bfloat16) == ('lower config.optimizer.learning_rate, raise '
                                'config.optimizer.warmup_fraction or train in float32 '
                                '(config.model.dtype)')


def run(config, workdir: str, sharded: bool = False) -> dict:
  """finetune.finetune on one device where what is tested is fine-tuning's own behaviour, not
  its sharding (over the 8 fake devices' mesh it compiles longer and steps several times
  slower on the CPU); sharded=True: over all 8, tensor parallel (ft_config's mesh), in the
  tests that stand for sharded fine-tuning."""
  return finetune.finetune(config, workdir, devices=None if sharded else jax.devices()[:1])


def test_glue_end_to_end_resume_and_submission_files(pretrained, tmp_path, monkeypatch):
  workdir = str(tmp_path / 'mnli')
  config = lambda: ft_config('mnli', pretrained, bucket_compile_seconds=0.0,  # several
                            length_buckets=2)                                # lengths: two
  summary = run(config(), workdir, sharded=True)
  assert set(summary['dev']) == {'mnli', 'mnli_mismatched'}
  assert 0.0 <= summary['dev']['mnli']['accuracy'] <= 1.0
  for name in ('MNLI-m.tsv', 'MNLI-mm.tsv', 'AX.tsv'):
    lines = open(os.path.join(workdir, 'predictions', name)).read().splitlines()
    assert lines[0] == 'index\tprediction'
    assert all(l.split('\t')[1] in ('entailment', 'neutral', 'contradiction')
               for l in lines[1:])
  assert len(open(os.path.join(workdir, 'predictions', 'AX.tsv')).readlines()) == 4
  # Each dev set's predictions with their scores: the dev accuracy the run reported.
  for name, split in (('MNLI-m', 'mnli'), ('MNLI-mm', 'mnli_mismatched')):
    head, *rows = [l.split('\t') for l in open(os.path.join(
        workdir, 'predictions', 'dev', f'{name}.tsv')).read().splitlines()]
    assert head == ['index', 'label', 'prediction', 'logit_entailment', 'logit_neutral',
                    'logit_contradiction']
    labels = head[3:]
    assert rows and all(r[2] == labels[int(np.argmax([float(x) for x in r[3:]]))][6:]
                        for r in rows)
    assert np.mean([r[1] == r[2] for r in rows]) == pytest.approx(
        summary['dev'][split]['accuracy'])
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert [r['step'] for r in records if r['split'] == 'dev_mnli'] == [1, 2]
  train_records = [r for r in records if r['split'] == 'train']
  assert sum('epoch_seconds' in r for r in train_records) == 2  # one per epoch
  assert any(0 < r.get('tokens_per_s', 0) <= r['padded_tokens_per_s'] for r in train_records)
  stored = json.load(open(os.path.join(workdir, 'config.json')))
  assert stored['length_buckets'] == 2
  assert finetune_configs.get_config('glue/mnli').length_buckets == 5  # on by default
  # Several lengths (the ones that pad least), on the 8 devices' mesh: batches within a length,
  # each dev set and AX.tsv predicted over them; a rerun below keeps them.
  lengths = json.load(open(os.path.join(workdir, RunDir.LENGTH_BUCKETS)))['lengths']
  assert len(lengths) == 2
  # TensorBoard as well as metrics.jsonl: the trainer's writer, for both programs.
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(workdir))
  started = json.loads(open(os.path.join(workdir, 'machine.jsonl')).readline())
  assert started['backend'] == jax.default_backend() and started['cores'] == os.cpu_count()
  # Lean: the finished run keeps its params (final/) and the best dev epoch's (best/), no
  # optimizer state; both are params-only checkpoints another fine-tuning can start from.
  assert not checkpoints.has_complete_step(workdir)
  for kept in ('final', 'best'):
    step_dir = checkpoints.resolve_step_dir(os.path.join(workdir, kept))
    assert set(checkpoints.stored_tree(step_dir)) == {'step', 'params'}
    kept_config = finetune_task.pretrained_config(os.path.join(workdir, kept))
    assert kept_config.model.hidden_size == 32
    # The length its positions are trained to (the pretraining's 128 here: longer than any
    # training example; test_the_length_kept_is_the_longest_trained_one).
    pretrained_length = json.load(open(os.path.join(pretrained, 'config.json')))['data'][
        'max_seq_length']
    assert kept_config.data.max_seq_length == pretrained_length > 64
  best = json.load(open(os.path.join(workdir, 'best', 'results.json')))
  # The last epoch's params are stored once: final/ links to best/ when it was the best.
  assert os.path.islink(os.path.join(workdir, 'final')) == (best['step'] == summary['step'])
  assert best['epoch'] in (1, 2) and summary['best']['step'] == best['step']
  dev = [r['accuracy'] for r in records if r['split'] == 'dev_mnli']
  assert best['headline'] == max(dev) and best['epoch'] == dev.index(max(dev)) + 1
  # Running again evaluates the final params: no new training, the same results.
  again = run(config(), workdir, sharded=True)
  assert again['step'] == summary['step'] and again['dev'] == summary['dev']
  assert json.load(open(os.path.join(workdir, RunDir.LENGTH_BUCKETS)))['lengths'] == lengths
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert [r['step'] for r in records if r['split'] == 'dev_mnli'] == [1, 2]  # not logged twice
  # A final/ without a parameter the model has (a checkpoint changed under the run): one
  # line, nothing drawn in its place.
  restore = checkpoints.restore_params

  def without_one(path, abstract, **kwargs):
    params, _ = restore(path, abstract, **kwargs)
    return params, ['classifier/kernel']
  monkeypatch.setattr(checkpoints, 'restore_params', without_one)
  with pytest.raises(ValueError, match='final does not match the model: it has no '
                                       'classifier/kernel'):
    run(config(), workdir, sharded=True)


def test_a_task_of_ones_own_from_tsv_files(pretrained, tmp_path):
  """tsv/<name>: three classes of single sentences from train/dev/test.tsv with a header; the
  headline is the configured metric, the predictions carry the label names."""
  data = tmp_path / 'topics'
  data.mkdir()
  words = {'world': 'the nation held an election', 'sports': 'the team won the match',
           'science': 'the cell divides under the lens'}
  rows = [(f'{text} {i}', topic) for i in range(6) for topic, text in words.items()]
  for split, part in (('train', rows), ('dev', rows[:9])):
    (data / f'{split}.tsv').write_text('id\ttext\ttopic\n' + ''.join(
        f'{i}\t{t}\t{y}\n' for i, (t, y) in enumerate(part)))
  (data / 'test.tsv').write_text('id\ttext\n' + ''.join(
      f'{i}\t{t}\n' for i, (t, _) in enumerate(rows[:5])))
  config = finetune_configs.get_config('tsv/topics')
  config.unlock()
  config.init_checkpoint, config.data_dir = pretrained, str(data)
  config.batch_size, config.eval_batch_size, config.num_epochs, config.max_seq_length = (
      4, 4, 1, 32)
  config.mesh.data, config.mesh.tensor = 1, -1
  config.tsv.text, config.tsv.label = 'text', 'topic'
  config.tsv.labels, config.tsv.metric = 'world, sports, science', 'macro_f1'  # (as written)
  summary = run(config, str(tmp_path / 'ft'))
  assert set(summary['dev']['topics']) == {'accuracy', 'macro_f1', 'majority_accuracy',
                                           'majority_macro_f1'}
  assert summary['headline'] == summary['dev']['topics']['macro_f1']
  results = json.loads((tmp_path / 'ft' / 'results.json').read_text())
  assert results['headline_metric'] == 'macro_f1'  # named, for the grid's table
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  (tmp_path / 'grid' / 'tsv_topics').mkdir(parents=True)
  (tmp_path / 'ft').rename(tmp_path / 'grid' / 'tsv_topics' / 'seed=0')
  assert finetune_grid.headline_metric(str(tmp_path / 'grid'), 'tsv/topics') == 'macro_f1'
  lines = (tmp_path / 'grid' / 'tsv_topics' / 'seed=0' / 'predictions' / 'topics.tsv'
           ).read_text().splitlines()
  assert lines[0] == 'index\tprediction' and len(lines) == 6
  assert all(l.split('\t')[1] in words for l in lines[1:])
  config.tsv.metric = 'f1'  # of two labels only: refused before anything is written
  with pytest.raises(ValueError, match="task 'topics': metric 'f1'"):
    run(config, str(tmp_path / 'ft2'))
  config.tsv.metric, config.tsv.labels = 'accuracy', '0,1'  # the kind's default labels
  with pytest.raises(ValueError, match=r"train.tsv:2: topics: label 'world' is not one of "
                     r"\('0', '1'\); give the task its file's label values in id order "
                     r'\(its labels: config.tsv.labels for a tsv/<name> task\), or fix the '
                     r'row$'):
    run(config, str(tmp_path / 'ft4'))
  config.tsv.labels, config.data_dir = 'world,sports,science', ''
  with pytest.raises(ValueError, match='tsv/topics: set config.data_dir to the folder'):
    run(config, str(tmp_path / 'ft3'))
  assert not (tmp_path / 'ft2').exists() and not (tmp_path / 'ft3').exists()


def test_best_dev_checkpoint_of_an_earlier_run_is_not_taken_for_this_one(tmp_path):
  """best/ left by an earlier run (its final/ and resume checkpoint deleted, a new config):
  a run starting at step 0 removes it instead of comparing its epochs with the old best;
  a run resuming before the best's step (killed after it, before the next checkpoint)
  removes it too: that stretch is trained again, maybe under a changed schedule. A best/
  whose record is not of its params (killed between the two writes) is removed. A kept
  record's headline is recomputed by today's rule (STS-B's was Pearson, now Spearman)."""
  best_dir = tmp_path / RunDir.BEST
  stsb = types.SimpleNamespace(dev_headline=lambda dev: finetune_metrics.headline(
      'stsb', dev['stsb']))
  task = types.SimpleNamespace(record_headline=lambda record: (
      finetune_task.FinetuneTask.record_headline(stsb, record)))

  def plant(step=9, record=9):
    checkpoints.save_params(str(best_dir), {'w': np.zeros(2, np.float32)},
                            ml_collections.ConfigDict(), step=step)
    if record is not None:
      (best_dir / 'results.json').write_text(json.dumps(
          {'step': record, 'epoch': 3, 'headline': 0.99,
           'dev': {'stsb': {'pearson': 0.99, 'spearman': 0.97}}}))
  for step, record in ((9, 6), (9, None)):
    plant(step, record)
    assert trainer.BestParams(RunDir(tmp_path), task, True, start=12).record is None
    assert not best_dir.exists()
  plant()
  resumed = trainer.BestParams(RunDir(tmp_path), task, True, start=9)
  assert resumed.record['headline'] == 0.97  # a resumed run keeps its own best (Spearman)
  record = json.loads((best_dir / 'results.json').read_text())
  (best_dir / 'results.json').write_text(json.dumps(dict(record, dev={})))
  # a record without the dev metrics the rule reads: its headline as recorded
  assert trainer.BestParams(RunDir(tmp_path), task, True, start=9).record['headline'] == 0.99
  (best_dir / 'results.json').write_text(json.dumps(record))
  assert trainer.BestParams(RunDir(tmp_path), task, True, start=12).record['step'] == 9
  earlier = trainer.BestParams(RunDir(tmp_path), task, True, start=6)
  assert earlier.record is None and not best_dir.exists()
  plant()
  fresh = trainer.BestParams(RunDir(tmp_path), task, True, start=0)
  assert fresh.record is None and not best_dir.exists()


def test_fixed_synthesizer_parameters_do_not_move_in_fine_tuning(tmp_path):
  """synth_random_fixed: the random attention logits are fixed (gradient stopped, and the
  optimizer must leave them alone: AdamW's weight decay alone would shrink them). After a
  fine-tuning run with a large weight decay they are bit-identical to the pretrained ones,
  while the encoder's other weights moved."""
  pretrained = str(tmp_path / 'pretrained')
  # 8 heads: the fixed logits [heads, T, T] shard over the 8 fake devices' tensor axis.
  params = save_tiny_encoder(pretrained, 'synth_random_fixed', num_layers=1, num_heads=8,
                             step=1)
  c = ft_config('rte', pretrained, num_epochs=1, keep_best=False)
  c.optimizer.weight_decay, c.optimizer.learning_rate = 0.5, 1e-2
  run(c, str(tmp_path / 'ft'), sharded=True)
  before = jax.tree_util.tree_flatten_with_path(params['encoder'])[0]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params['encoder'])
  after, _ = checkpoints.restore_params(str(tmp_path / 'ft' / 'final'), abstract,
                                        subtree=('encoder',))
  after = dict((jax.tree_util.keystr(p), x) for p, x in
               jax.tree_util.tree_flatten_with_path(after)[0])
  fixed = [k for k, _ in before if 'random_logits' in jax.tree_util.keystr(k)]
  assert fixed, 'synth_random_fixed has random_logits'
  for path, value in before:
    same = np.array_equal(np.asarray(after[jax.tree_util.keystr(path)]), np.asarray(value))
    assert same == (path in fixed), jax.tree_util.keystr(path)


def test_a_nan_loss_stops_fine_tuning_with_one_line_naming_the_fix(pretrained, tmp_path):
  """The trainer's check, as in pretraining: nothing of the bad step is saved, and the
  message names fine-tuning's own setting."""
  c = ft_config('mrpc', pretrained, num_epochs=1, keep_best=False)  # 5 steps an epoch
  c.optimizer.learning_rate = float('inf')  # LayerNorm keeps a merely huge one finite
  with pytest.raises(trainer.NonFiniteLossError, match=r'became (nan|inf) at step \d+; .*'
                                                       r'lower config.optimizer.learning_rate'):
    run(c, str(tmp_path / 'ft'))
  assert not checkpoints.has_complete_step(str(tmp_path / 'ft'))


def test_a_stop_while_final_is_written_leaves_a_run_the_same_command_finishes(
    pretrained, tmp_path, monkeypatch):
  """results.json comes last: a run stopped while its final/ params are written has none,
  so a sweep does not take it for finished, and running it again finishes it."""
  from realformer.tools import sweep  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'rte')
  config = lambda: ft_config('rte', pretrained, keep_best=False, num_epochs=1)

  def stopped(*args, **kwargs):
    raise RuntimeError('stopped while final/ was written')
  with monkeypatch.context() as m:
    m.setattr(checkpoints, 'save_params', stopped)
    with pytest.raises(RuntimeError, match='stopped while final/'):
      run(config(), workdir)
  assert not os.path.exists(os.path.join(workdir, RunDir.RESULTS))
  assert checkpoints.has_complete_step(workdir) and not sweep.is_done(workdir)
  summary = run(config(), workdir)
  assert json.load(open(os.path.join(workdir, RunDir.RESULTS)))['dev'] == summary['dev']
  assert checkpoints.has_complete_step(os.path.join(workdir, RunDir.FINAL))
  assert not checkpoints.has_complete_step(workdir) and sweep.is_done(workdir)


def test_keep_optimizer_state_keeps_the_resume_checkpoint(pretrained, tmp_path):
  workdir = str(tmp_path / 'rte')
  run(ft_config('rte', pretrained, keep_optimizer_state=True, keep_best=False,
                              num_epochs=1), workdir)
  assert checkpoints.has_complete_step(workdir)
  assert not os.path.exists(os.path.join(workdir, 'final'))
  assert not os.path.exists(os.path.join(workdir, 'best'))


def test_preemption_saves_mid_epoch_and_the_resumed_run_matches(pretrained, tmp_path):
  """SIGTERM (here: the stop signal reached at step 2 of 3 in an epoch) saves that step and
  returns 'preempted'; running again resumes there and ends where an uninterrupted run
  ends."""
  config = lambda: ft_config('rte', pretrained, keep_best=False, batch_size=1,
                             bucket_compile_seconds=0.0, log_every_steps=1)
  whole = run(config(), str(tmp_path / 'whole'))
  workdir = str(tmp_path / 'cut')
  checks = iter(range(1, 100))  # the loop checks once a step, from step 1
  with mock.patch.object(workdir_lib.StopSignal, 'reached', lambda self: next(checks) == 2):
    cut = run(config(), workdir)
  assert cut == {'task': 'rte', 'step': 2, 'preempted': 2}
  assert checkpoints.latest_complete_step(checkpoints.make_manager(workdir)) == 2
  assert not os.path.exists(os.path.join(workdir, 'results.json'))
  described = [open(os.path.join(workdir, name)).read()
               for name in (RunDir.CONFIG, RunDir.MACHINE)]
  with pytest.raises(ValueError, match='stopped in mid-epoch with length buckets'):
    run(ft_config('rte', pretrained, keep_best=False, batch_size=1,
                                length_buckets=0), workdir)
  assert [open(os.path.join(workdir, name)).read()  # refused before they were written
          for name in (RunDir.CONFIG, RunDir.MACHINE)] == described
  resumed = run(config(), workdir)
  assert resumed['step'] == whole['step'] and resumed['dev'] == whole['dev']
  # Step for step: the resumed run trained on the batches the uninterrupted one did, from
  # the one after the saved step, with the same dropout masks.
  train_losses = lambda w: {s: r['loss'] for s, r in metrics_jsonl.read_jsonl(
      os.path.join(w, 'metrics.jsonl'), 'train').items()}
  want = train_losses(str(tmp_path / 'whole'))
  assert len(want) == whole['step'] > 3
  np.testing.assert_allclose([train_losses(workdir)[s] for s in sorted(want)],
                             [want[s] for s in sorted(want)], rtol=1e-6)


@pytest.fixture(scope='module')
def mrpc_bucketed(pretrained, tmp_path_factory):
  """An MRPC run with the lengths that pad least, compiled in the background (the default):
  (its summary, its workdir). The tests that change it work on a copy."""
  workdir = tmp_path_factory.mktemp('mrpc') / 'run'
  summary = run(ft_config('mrpc', pretrained, compile_in_background=True,
                          bucket_compile_seconds=0.0), str(workdir))
  return summary, workdir


def _train_losses(workdir):
  return [r['loss'] for r in map(json.loads, open(workdir / 'metrics.jsonl'))
          if r['split'] == 'train']


def test_length_buckets_off_gives_the_same_dev_results_and_predictions(pretrained, mrpc_bucketed,
                                                                      tmp_path):
  """A run trained with length buckets (the default), evaluated again with them off
  (config.length_buckets=0: every batch padded to max_seq_length): the same dev metrics and
  the same predictions, through finetune.py's own evaluation."""
  bucketed, trained = mrpc_bucketed
  workdir = tmp_path / 'mrpc'
  shutil.copytree(trained, workdir)
  stored = json.load(open(workdir / RunDir.LENGTH_BUCKETS))['lengths']
  assert min(stored) < 64  # some shorter: padded less
  predictions = (workdir / 'predictions' / 'MRPC.tsv').read_text()
  padded = run(ft_config('mrpc', pretrained, length_buckets=0), str(workdir))
  assert padded['step'] == bucketed['step'] and padded['dev'] == bucketed['dev']
  assert (workdir / 'predictions' / 'MRPC.tsv').read_text() == predictions


def test_compiling_in_the_background_trains_exactly_as_compiling_first(pretrained, mrpc_bucketed,
                                                                       tmp_path):
  """config.compile_in_background (the default) compiles each length while training runs:
  the same programs, so the same losses, dev results and predictions as compiling first."""
  summary, workdir = mrpc_bucketed
  background = (summary['dev'], _train_losses(workdir),
                (workdir / 'predictions' / 'MRPC.tsv').read_text())
  first_dir = tmp_path / 'background_False'
  summary = run(ft_config('mrpc', pretrained, compile_in_background=False,
                          bucket_compile_seconds=0.0), str(first_dir))
  first = (summary['dev'], _train_losses(first_dir),
           (first_dir / 'predictions' / 'MRPC.tsv').read_text())
  assert len(first[1]) > 1 and background == first
  order = json.load(open(workdir / RunDir.LENGTH_BUCKETS))['lengths']
  assert len(order) > 1  # several programs, compiled while the run went on


def test_a_resume_on_other_training_examples_is_refused(tmp_path):
  """A run resumed after its training examples changed (its train file edited, tokenized
  otherwise, tfds's copy updated) would train on other batches: refused in one line. The
  dev and test files may change; a file of before the checksum is taken as it is."""
  rows = (np.arange(32) < np.random.default_rng(0).integers(3, 30, size=64)[:, None])
  features = {'attention_mask': rows.astype(np.int32)}
  config = ml_collections.ConfigDict(
      {'length_buckets': 0, 'group_by_length': True, 'bucket_multiple': 8, 'max_seq_length': 32,
       'num_epochs': 1, 'bucket_compile_seconds': 0.0, 'bucket_flops_per_second': 0.0})
  task = lambda train, dev=features: types.SimpleNamespace(name='rte', train=train,
                                                           eval_features=lambda: [dev])
  workdir = RunDir(tmp_path)
  finetune_task.length_buckets(config, task(features), workdir, resuming=False)
  other_dev = {'attention_mask': np.ones((3, 32), np.int32)}
  assert finetune_task.length_buckets(config, task(features, other_dev), workdir, True) == (32,)
  edited = {'attention_mask': features['attention_mask'][::-1].copy()}  # the rows reordered
  with pytest.raises(ValueError, match=r"^rte's training examples are not those this run "
                                       r'began with \(their checksum in .*length_buckets.json\)'
                                       r": its train file, their tokenization or tfds's copy "
                                       r'changed; resume with the data as it was, or train '
                                       r'afresh in another --workdir$'):
    finetune_task.length_buckets(config, task(edited), workdir, resuming=True)
  stored = json.load(open(tmp_path / RunDir.LENGTH_BUCKETS))
  del stored['train_digest']  # (a run of before the checksum)
  with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
    json.dump(stored, f)
  assert finetune_task.length_buckets(config, task(edited), workdir, resuming=True) == (32,)


def test_changed_bucket_settings_apply_at_an_epoch_start_and_are_refused_mid_epoch(tmp_path):
  """The stored buckets are kept on resume only while length_buckets and bucket_multiple
  are the ones that chose them (dev or test files may change meanwhile)."""
  lengths = np.random.default_rng(0).integers(3, 120, size=500)
  features = {'attention_mask': (np.arange(128) < lengths[:, None]).astype(np.int32)}
  task = types.SimpleNamespace(train=features, eval_features=lambda: [features])
  config = lambda n, m, grouped=True: ml_collections.ConfigDict(
      {'length_buckets': n, 'group_by_length': grouped, 'bucket_multiple': m,
       'max_seq_length': 128, 'num_epochs': 1, 'batch_size': 8, 'seed': 0,
       'bucket_compile_seconds': 0.0, 'bucket_flops_per_second': 0.0})
  workdir = RunDir(tmp_path)
  first = finetune_task.length_buckets(config(5, 8), task, workdir, resuming=False)
  (tmp_path / 'fresh').mkdir()
  other = finetune_task.length_buckets(config(2, 32), task, RunDir(tmp_path / 'fresh'), resuming=False)
  assert len(first) == 5 and len(other) == 2 and first != other
  for mid_epoch in (False, True):  # the same settings: kept
    assert finetune_task.length_buckets(config(5, 8), task, workdir, True, mid_epoch) == first
  with pytest.raises(ValueError, match='stopped in mid-epoch with length buckets'):
    finetune_task.length_buckets(config(2, 32), task, workdir, resuming=True, mid_epoch=True)
  assert finetune_task.length_buckets(config(2, 32), task, workdir, resuming=True) == other
  assert finetune_task.length_buckets(config(0, 8), task, workdir, resuming=True) == (128,)
  longer = {'attention_mask': np.ones((1, 100), np.int32)}  # a dev file changed since
  task_now = types.SimpleNamespace(train=features, eval_features=lambda: [longer])
  assert finetune_task.eval_lengths(config(2, 32), task_now, (64, 96)) == (64, 96, 128)
  assert finetune_task.eval_lengths(config(5, 8), task_now, (64, 96)) == (64, 96, 104)
  assert finetune_task.eval_lengths(config(5, 8), task, (64, 120)) == (64, 120)
  # The training batches do not depend on the dev and test files: a longer example there
  # gets an evaluation length of its own, not a longer training bucket.
  short = {'attention_mask': (np.arange(128) < 20).astype(np.int32)[None]}
  (tmp_path / 'short').mkdir()
  train_only = finetune_task.length_buckets(
      config(5, 8), types.SimpleNamespace(train=features, eval_features=lambda: [short]),
      RunDir(tmp_path / 'short'), resuming=False)
  (tmp_path / 'long').mkdir()
  long_eval = {'attention_mask': np.ones((1, 128), np.int32)}
  assert max(train_only) < 128 and finetune_task.length_buckets(
      config(5, 8), types.SimpleNamespace(train=features, eval_features=lambda: [long_eval]),
      RunDir(tmp_path / 'long'), resuming=False) == train_only
  # A file of an older version (the lengths alone): kept to finish the epoch, then chosen
  # again with the settings of the day.
  with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
    json.dump(list(first), f)
  assert finetune_task.length_buckets(config(2, 32), task, workdir, True, mid_epoch=True) == first
  assert finetune_task.length_buckets(config(2, 32), task, workdir, resuming=True) == other
  # A file that stored fewer settings (before the compile cost): the ones it names must
  # match to finish the epoch; the rest are unknown.
  with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
    json.dump({'lengths': list(first), 'settings': {'length_buckets': 5, 'bucket_multiple': 8}},
              f)
  assert finetune_task.length_buckets(config(5, 8), task, workdir, True, mid_epoch=True) == first
  with pytest.raises(ValueError, match='resume with the bucket settings as they were'):
    finetune_task.length_buckets(config(2, 32), task, workdir, True, mid_epoch=True)
  # One length was the cost model's choice (a short run; a device whose compiles cost more):
  # kept like any plan by the settings that chose it, though another device would choose
  # more; the same length from padded training (length_buckets=0) is not.
  settings = {'length_buckets': 5, 'group_by_length': True, 'bucket_multiple': 8,
              'bucket_compile_seconds': 0.0, 'bucket_flops_per_second': 0.0}
  with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
    json.dump({'lengths': [128], 'settings': settings}, f)
  for mid_epoch in (False, True):
    assert finetune_task.length_buckets(config(5, 8), task, workdir, True, mid_epoch) == (128,)
  with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
    json.dump({'lengths': [128], 'settings': dict(settings, length_buckets=0)}, f)
  assert finetune_task.length_buckets(config(5, 8), task, workdir, resuming=True) == first
  # The batches' composition (group_by_length) is part of the plan: random batches choose
  # their own lengths at an epoch's start. In mid-epoch a change that would change the
  # epoch's batches is refused (grouped of several lengths to random or back, from a file of
  # before the setting too: its batches were grouped), even where the lengths chosen would be
  # the same; random batches are the same whatever lengths pad them (and grouped ones of one
  # length are those), so a change of their lengths is taken.
  random = finetune_task.length_buckets(config(5, 8, False), task, workdir, resuming=True)
  assert random != first and len(random) > 1
  def resumed(stored_lengths, stored_settings, new_config):
    with open(tmp_path / RunDir.LENGTH_BUCKETS, 'w') as f:
      json.dump({'lengths': list(stored_lengths), 'settings': stored_settings}, f)
    return finetune_task.length_buckets(new_config, task, workdir, True, mid_epoch=True)
  randomly = dict(settings, group_by_length=False)
  for stored in (settings, {k: v for k, v in settings.items() if k != 'group_by_length'}):
    with pytest.raises(ValueError, match='resume with the bucket settings as they were'):
      with mock.patch.object(finetune_task, '_choose_buckets', return_value=random):
        resumed(random, stored, config(5, 8, False))
  with pytest.raises(ValueError, match='resume with the bucket settings as they were'):
    resumed(random, randomly, config(5, 8, True))
  assert resumed([128], settings, config(5, 8, False)) == random
  assert resumed(random, randomly, config(5, 8, False)) == random  # kept
  assert resumed(random, randomly, config(2, 32, False)) not in (random, first)
  assert resumed(random, randomly, config(0, 8, False)) == (128,)


def _marker_task(root, seed=0, sizes=(('train', 320), ('dev', 200))):
  """An SST-2-format task a tiny encoder learns from random init in a few epochs: a sentence
  of 3 to 40 filler words holds 'peace' (label 1) or 'war' (label 0) at a random place."""
  rng = np.random.default_rng(seed)
  words = ('the people of this nation have made great progress in every year and we shall '
           'continue to work for our country with the congress').split()
  folder = os.path.join(root, 'SST-2')
  os.makedirs(folder)
  for split, n in sizes:
    rows = []
    for label in rng.integers(2, size=n):
      sentence = list(rng.choice(words, size=int(rng.integers(2, 40))))
      sentence.insert(int(rng.integers(len(sentence) + 1)), 'peace' if label else 'war')
      rows.append(f'{" ".join(sentence)}\t{label}\n')
    with open(os.path.join(folder, f'{split}.tsv'), 'w') as f:
      f.write('sentence\tlabel\n' + ''.join(rows))


def test_training_with_length_buckets_reaches_the_accuracy_of_padded_training(pretrained,
                                                                              tmp_path):
  """Trained from random init on a task with sentences of 3 to 40 words, length buckets
  (batches drawn within a bucket, padded to it) and padding every batch to max_seq_length
  both learn the task; buckets that mixed up examples, labels or masks stay near 0.5."""
  _marker_task(str(tmp_path / 'glue'))
  results = {}
  for buckets_ in (2, 0):
    config = ft_config('sst2', pretrained, data_dir=str(tmp_path / 'glue'), batch_size=16,
                       eval_batch_size=50, num_epochs=6, length_buckets=buckets_,
                       bucket_compile_seconds=0.0, keep_best=False)
    config.optimizer.learning_rate = 3e-3
    workdir = tmp_path / f'buckets_{buckets_}'
    results[buckets_] = run(config, str(workdir))['dev']['sst2']['accuracy']
    records = [json.loads(l) for l in open(workdir / 'metrics.jsonl')]
    real = [r['tokens_per_s'] / r['padded_tokens_per_s'] for r in records if 'tokens_per_s' in r]
    assert (min(real) > 0.5) == (buckets_ > 0)  # the buckets padded less
  assert min(results.values()) >= 0.95, results  # 0.5 is chance; both reached 1.0 at seeds 0-1


def test_regression_task_and_scratch_baseline(pretrained, tmp_path):
  summary = run(ft_config('stsb', pretrained, batch_size=1), str(tmp_path / 'a'))
  assert set(summary['dev']['stsb']) == {'pearson', 'spearman'}
  lines = open(tmp_path / 'a' / 'predictions' / 'STS-B.tsv').read().splitlines()
  float(lines[1].split('\t')[1])
  head, *rows = [l.split('\t') for l in open(
      tmp_path / 'a' / 'predictions' / 'dev' / 'STS-B.tsv').read().splitlines()]
  assert head == ['index', 'label', 'prediction']  # (the prediction is its score)
  got, want = (np.array([float(r[i]) for r in rows]) for i in (2, 1))
  assert np.corrcoef(got, want)[0, 1] == pytest.approx(summary['dev']['stsb']['pearson'],
                                                       abs=1e-4)
  # The scratch baseline starts from a random encoder, not the pretrained one: at a learning
  # rate of 0 its final encoder is what it started from, and that is not the checkpoint's
  # (one whose values a fresh init cannot give).
  moved = str(tmp_path / 'moved')
  save_tiny_encoder(moved, 'postln', num_layers=2, num_heads=2, step=10, moved=True)
  c = ft_config('rte', moved, from_scratch=True, num_epochs=1)  # (the other tests' programs)
  c.optimizer.learning_rate = 0.0
  scratch = run(c, str(tmp_path / 'b'))
  assert 'accuracy' in scratch['dev']['rte']
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  def query_kernel(workdir):  # Orbax's own reading of a checkpoint's first query kernel
    state = ocp.StandardCheckpointer().restore(
        os.path.join(checkpoints.resolve_step_dir(workdir), 'state'))
    return np.asarray(state['params']['encoder']['layers_0']['attention']['query']['kernel'])
  start, final = query_kernel(moved), query_kernel(str(tmp_path / 'b' / 'final'))
  assert start.shape == final.shape and not np.allclose(start, final)


def test_process_zero_downloads_what_tfds_prepares_before_every_host_loads(monkeypatch):
  """With several processes, process 0 alone fetches what tfds would download and prepare
  into a folder the hosts may share (FinetuneTask.download, before every host loads): the
  task's datasets, mnli's AX too; nothing for files of one's own or Hugging Face's copies."""
  from realformer.finetune.tasks import glue as glue_kind
  from realformer.finetune.tasks import squad as squad_kind
  from data import squad as squad_data
  fetched = []
  monkeypatch.setattr(glue, 'prepare_tfds', lambda task, data_dir: fetched.append(
      (f'glue/{task}', data_dir)))
  monkeypatch.setattr(squad_data, 'prepare_tfds', lambda version, data_dir: fetched.append(
      (f'squad/{version}', data_dir)))
  for kind, task, data_dir, want in [
      (glue_kind.GlueTask, 'rte', '', [('glue/rte', '/tfds')]),
      (glue_kind.GlueTask, 'mnli', '', [('glue/mnli', '/tfds'), ('glue/ax', '/tfds')]),
      (glue_kind.GlueTask, 'rte', 'tests/data/glue', []),
      (glue_kind.GlueTask, 'rte', 'hf:nyu-mll/glue', []),
      (squad_kind.SquadTask, 'v2.0', '', [('squad/v2.0', '/tfds')]),
      (squad_kind.SquadTask, 'v1.1', 'tests/data/squad', [])]:
    fetched.clear()
    task_ = object.__new__(kind)
    task_.config = ml_collections.ConfigDict({'task': task, 'data_dir': data_dir,
                                              'tfds_data_dir': '/tfds'})
    task_.download()
    assert fetched == want, (kind, task, data_dir)


def test_glue_without_a_test_split_trains_evaluates_and_says_so(pretrained, tmp_path, caplog):
  data = tmp_path / 'glue' / 'RTE'
  data.mkdir(parents=True)
  for split in ('train.tsv', 'dev.tsv'):
    shutil.copy(os.path.join(GLUE_DIR, 'RTE', split), data / split)
  caplog.set_level('INFO', logger='absl')
  config = lambda: ft_config('rte', pretrained, data_dir=str(tmp_path / 'glue'),
                             max_seq_length=128)
  summary = run(config(), str(tmp_path / 'ft'))
  assert 'accuracy' in summary['dev']['rte']
  assert not (tmp_path / 'ft' / 'predictions' / 'RTE.tsv').exists()
  assert 'no test set for rte' in caplog.text and 'no predictions were written' in caplog.text
  assert re.search(r'compiled lengths?, whose batches hold', caplog.text)  # how many shapes
  assert re.search(r'the train step for (1 length|\d+ lengths) \([\d, ]+\): (compiled|loaded '
                   r'from the compilation cache) in ', caplog.text)
  assert 'encoder: 2 layers x ' in caplog.text and ', attention dot, float32' in caplog.text
  assert '; attention: training plain, evaluation plain' in caplog.text
  # The model's parameters, counted (a fine-tuning model: the encoder, its pooler and the
  # classifier), and those of its layers.
  params = checkpoints.stored_tree(checkpoints.resolve_step_dir(str(tmp_path / 'ft' / 'best')))
  sizes = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  layers = {k: v for k, v in params['params']['encoder'].items() if k.startswith('layers')}
  assert (f'{sizes(params["params"]):,} parameters ({sizes(layers):,} in the encoder\'s '
          'layers)') in caplog.text
  # A test.tsv added afterwards, longer than every stored bucket: the rerun predicts it
  # (one more compiled length for evaluation), the stored training buckets unchanged.
  stored = json.loads((tmp_path / 'ft' / RunDir.LENGTH_BUCKETS).read_text())['lengths']
  long = ' '.join(['word'] * 80)
  (data / 'test.tsv').write_text(f'index\tsentence1\tsentence2\n0\t{long}\tA short one.\n'
                                 '1\tA man.\tA person.\n')
  again = run(config(), str(tmp_path / 'ft'))
  assert again['dev'] == summary['dev']
  assert max(stored) < 96 and 'evaluation and predictions also compile length' in caplog.text
  rows = (tmp_path / 'ft' / 'predictions' / 'RTE.tsv').read_text().splitlines()
  assert [r.split('\t')[0] for r in rows] == ['index', '0', '1']
  assert json.loads((tmp_path / 'ft' / RunDir.LENGTH_BUCKETS).read_text())['lengths'] == stored


def test_random_init_baseline_from_a_pretraining_config(tmp_path):
  config = ft_config('rte', 'configs/pretrain.py:postln,tiny', from_scratch=True)
  summary = run(config, str(tmp_path / 'ft'))
  assert 'accuracy' in summary['dev']['rte']
  stored = json.load(open(tmp_path / 'ft' / 'config.json'))
  assert stored['init_checkpoint'] == 'configs/pretrain.py:postln,tiny'
  with pytest.raises(ValueError, match='holds no weights: set config.from_scratch=True'):
    run(ft_config('rte', 'configs/pretrain.py:postln,tiny'),
                      str(tmp_path / 'ft2'))


@test_wordpiece.needs_minilm
def test_a_random_init_baseline_takes_the_tokenizer_it_is_given():
  """config.tokenizer replaces the pretraining config's vocabulary, and the model's
  embedding table follows it (here a real BERT WordPiece vocab.txt, 30,522 pieces)."""
  vocab = os.path.join(test_wordpiece.MINILM, 'vocab.txt')
  config = ft_config('rte', 'configs/pretrain.py:postln,tiny', from_scratch=True,
                     tokenizer=vocab)
  pre = finetune_task.pretrained_config(config.init_checkpoint, config)
  assert pre.data.tokenizer == vocab and pre.model.vocab_size == 30522
  assert tokenizer_lib.load_for_config(pre.data).vocab_size == 30522
  default = finetune_task.pretrained_config(config.init_checkpoint,
                                       ft_config('rte', config.init_checkpoint,
                                                 from_scratch=True))
  assert default.model.vocab_size == 8000  # the embedded 8k sentencepiece vocabulary


def test_the_length_kept_is_the_longest_trained_one(pretrained, tmp_path):
  """best/ and final/ record the length their positions have been trained to: the
  pretraining's, or the longest training example's where that is longer (a batch's padding
  trains no position), not max_seq_length's (64 here); from scratch, the longest example's."""
  short = tmp_path / 'short'
  short.mkdir()
  config = json.load(open(os.path.join(pretrained, 'config.json')))
  config['data']['max_seq_length'] = 8  # pretrained on short sequences
  json.dump(config, open(short / 'config.json', 'w'))
  os.symlink(os.path.join(pretrained, 'checkpoints'), short / 'checkpoints')

  def kept(init, **overrides):
    """(the length params_config records, the longest training example)"""
    c = ft_config('sst2', str(init), **overrides)
    mesh = partitioning.make_mesh(c.mesh)
    with jax.set_mesh(mesh):
      task = registry.get('glue')(c, mesh, RunDir(str(tmp_path / 'run')))
    return task.params_config.data.max_seq_length, int(task.lengths.max())

  length, longest = kept(short)
  assert length == longest and 8 < longest < 64
  assert kept(pretrained)[0] == 128  # (pretrained at 128: longer than every example)
  length, longest = kept('configs/pretrain.py:postln,tiny', from_scratch=True)
  assert length == longest


def test_mismatched_checkpoint_is_a_clear_error(pretrained, tmp_path, caplog):
  other = str(tmp_path / 'other')
  os.makedirs(other)
  config = json.load(open(os.path.join(pretrained, 'config.json')))
  config['model']['hidden_size'] = 48  # the config no longer describes the checkpoint
  json.dump(config, open(os.path.join(other, 'config.json'), 'w'))
  os.symlink(os.path.join(pretrained, 'checkpoints'), os.path.join(other, 'checkpoints'))
  with pytest.raises(ValueError, match=r'encoder/embeddings/\S+ has shape'):
    run(ft_config('rte', other), str(tmp_path / 'ft'))
  assert not (tmp_path / 'ft').exists()  # no lock, no empty checkpoints/ left behind
  with pytest.raises(ValueError, match='init_checkpoint is empty'):
    run(ft_config('rte', ''), str(tmp_path / 'ft2'))
  with pytest.raises(ValueError, match='fewer than one batch'):
    run(ft_config('rte', pretrained, batch_size=64), str(tmp_path / 'ft3'))
  config['model']['hidden_size'] = 32
  config['model']['type_vocab_size'] = 1  # no row for the second sentence's segment id 1
  config['data']['max_seq_length'] = 48  # pretrained on shorter sequences than max_seq_length
  json.dump(config, open(os.path.join(other, 'config.json'), 'w'))
  with pytest.raises(ValueError, match="type_vocab_size=1: rte's text pairs use segment ids "
                                       '0 to 1; fine-tune a checkpoint with two token types'):
    run(ft_config('rte', other), str(tmp_path / 'ft4'))
  assert ('max_seq_length=64 is longer than the pretraining sequences (48): positions 48-63 '
          'were never trained (their position embeddings have had no gradient)'
          ) in caplog.text  # (a Post-LN encoder: no synthesizer named)
  caplog.clear()  # a Synthesizer's logits for those positions are as untrained: named too
  config['model'].update(attention='random+dot', type_vocab_size=2)
  json.dump(config, open(os.path.join(other, 'config.json'), 'w'))
  with pytest.raises(ValueError):  # (its checkpoint holds no random table)
    run(ft_config('rte', other), str(tmp_path / 'ft5'))
  assert ('(their position embeddings, and the random synthesizer\'s logits for them, have '
          'had no gradient)') in caplog.text
  # An import (params at step 0) does not say what length it was pretrained at: no warning.
  assert finetune_task.trained_length_known(pretrained)
  save_tiny_encoder(str(tmp_path / 'imported'), 'postln', num_layers=1, num_heads=2, step=0)
  assert not finetune_task.trained_length_known(str(tmp_path / 'imported'))


def test_grid_commands_and_summary(tmp_path, capsys):
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  root = str(tmp_path)
  finetune_grid.main(['--tasks', 'rte,squad/v1.1', '--root', root, '--init_checkpoint', '/ck',
                      '--seeds', '2', '--print_only', '--set', 'max_seq_length=96'])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python')]
  assert len(lines) == 2 * 5 * 2 * 3 * 2  # tasks x lr x batch x epochs x seeds
  assert all('--config.init_checkpoint=/ck' in l and '--config.max_seq_length=96' in l
             for l in lines)
  assert any('configs/finetune.py:squad/v1.1' in l for l in lines)
  # Several encoders in one grid: each its own runs, named by it (the table's rows apart).
  finetune_grid.main(['--tasks', 'rte', '--root', f'{root}/two', '--init_checkpoint', '/ck/a',
                      '--init_checkpoint', '/ck/b', '--seeds', '1', '--learning_rates', '1e-4',
                      '--batch_sizes', '16', '--epochs', '2', '--print_only'])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python')]
  assert len(lines) == 2 and all(
      f'init_checkpoint=_ck_{e},num_epochs=2,optimizer.learning_rate=0.0001,seed=0 ' in l and
      f'--config.init_checkpoint=/ck/{e} ' in l for l, e in zip(lines, 'ab'))
  with pytest.raises(ValueError, match='the grid repeats a run'):
    finetune_grid.main(['--tasks', 'rte', '--root', f'{root}/two', '--init_checkpoint', '/ck/a',
                        '--init_checkpoint', '/ck/a', '--print_only'])
  # A misspelt --set key: named with the grid's own flag (it has no --sweep).
  with pytest.raises(ValueError, match=r'max_seq_lenght is not a field of .*\(did you mean '
                                       r'max_seq_length\?\); fix the --set key$'):
    finetune_grid.main(['--tasks', 'rte', '--root', root, '--print_only', '--set',
                        'max_seq_lenght=96'])
  # A failed (or refused) run makes the grid's exit code non-zero, after the summary.
  with mock.patch.object(finetune_grid.sweep, 'run_all', return_value={'seed=0': 3}):
    assert finetune_grid.main(['--tasks', 'rte', '--root', root, '--seeds', '1',
                               '--set', 'from_scratch=True']) == 1
  # Before any run starts: a pretrained checkpoint that is not there.
  with pytest.raises(ValueError, match="--init_checkpoint='/ck' is not a train.py"):
    finetune_grid.main(['--tasks', 'rte', '--root', root, '--init_checkpoint', '/ck'])
  # a fine-tuning run's own folder (not its best/): refused once, not by each of its runs
  (tmp_path / 'ft_rte').mkdir()
  (tmp_path / 'ft_rte' / 'config.json').write_text(json.dumps({'task': 'rte'}))
  with pytest.raises(ValueError, match='ft_rte is a fine-tuning run'):
    finetune_grid.main(['--tasks', 'rte', '--root', root, '--init_checkpoint',
                        str(tmp_path / 'ft_rte')])
  assert 'failed runs: rte/seed=0' in capsys.readouterr().out
  # A run whose loss became nan is a result, said once and not run again by later calls.
  with mock.patch.object(finetune_grid.sweep, 'run_all', return_value={'seed=0': 1}) as runs:
    name = 'batch_size=16,num_epochs=2,optimizer.learning_rate=0.0001,seed=0'
    (tmp_path / 'dv' / 'rte' / name).mkdir(parents=True)
    (tmp_path / 'dv' / 'rte' / name / 'log.txt').write_text(
        'error: the loss became nan at step 7; lower the learning rate\n')
    runs.return_value = {name: 1}
    grid_args = ['--tasks', 'rte', '--root', str(tmp_path / 'dv'), '--seeds', '1',
                 '--learning_rates', '1e-4', '--batch_sizes', '16', '--epochs', '2',
                 '--set', 'from_scratch=True']
    assert finetune_grid.main(grid_args) == 0
    assert f'diverged (nan/inf; failed in the table, not run again): rte/{name}' in (
        capsys.readouterr().out)
    runs.return_value = {}
    assert finetune_grid.main(grid_args) == 0
    assert runs.call_args.args[0] == []  # the diverged run is not started again
  # A setting every run's own checks refuse: one line before any run starts (not a failure
  # in each run's log); printed for a cluster, the kind's checks are the runs' there.
  with mock.patch.object(finetune_grid.sweep, 'run_all') as runs:
    with pytest.raises(ValueError, match=r'the run with .*length_buckets=-1: '
                                         r'config.length_buckets=-1: give the number'):
      finetune_grid.main(['--tasks', 'rte', '--root', root, '--seeds', '1',
                          '--set', 'from_scratch=True', '--set', 'length_buckets=-1'])
    runs.assert_not_called()
  # Hugging Face data (hf:) is no directory here: the runs load it
  with mock.patch.object(finetune_grid.sweep, 'run_all', return_value={'seed=0': 0}) as runs:
    finetune_grid.main(['--tasks', 'rte', '--root', f'{root}/hf_run', '--seeds', '1',
                        '--data_dir', 'hf:nyu-mll/glue', '--set', 'from_scratch=True'])
  assert all(run['data_dir'] == 'hf:nyu-mll/glue' for run in runs.call_args.args[0])
  finetune_grid.main(['--tasks', 'rte', '--root', root, '--learning_rates', '1e-4',
                      '--batch_sizes', '16', '--epochs', '3', '--seeds', '1', '--print_only'])
  one = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python')]
  # One value per axis: the grid's values still name the run (grids extend in one root).
  assert len(one) == 1 and (f'--workdir {root}/rte/batch_size=16,num_epochs=3,'
                            'optimizer.learning_rate=0.0001,seed=0 ') in one[0]
  hf_args = ['--tasks', 'rte', '--seeds', '1', '--print_only', '--data_dir',
             'hf:nyu-mll/glue', '--learning_rates', '1e-5', '--batch_sizes', '16', '--epochs',
             '2']
  # A setting the first grid ran with another --data_dir: a folder of its own, named by it.
  finetune_grid.main(hf_args + ['--root', root])
  out = capsys.readouterr().out
  assert re.search(f'--workdir {root}/rte/batch_size=16,data_dir=hf_nyu-mll_glue,[^ ]*'
                   'optimizer.learning_rate=1e-05,seed=0 ', out), out
  assert '--config.data_dir=hf:nyu-mll/glue ' in out
  with pytest.raises(ValueError, match=f'--root {root} is a local folder, which each TPU '
                     'worker would have a copy of'):  # (the root given, not a task's)
    finetune_grid.main(hf_args + ['--root', root, '--target', 'tpu'])
  for flags, error in ((['--seeds', '0'], 'need at least one seed'),
                       (['--learning_rates', '2e-5,2e-05'], 'the grid repeats a run'),
                       (['--set', 'batch_size=64'], '--set batch_size: the grid sets it'),
                       (['--set', 'seed=7'], '--set seed: the grid sets it')):
    with pytest.raises(ValueError, match=error):
      finetune_grid.main(['--tasks', 'rte', '--root', root, '--print_only'] + flags)
  check_grid_summary(f'{root}/summary')


def test_a_grid_compiles_each_program_once(pretrained, tmp_path, monkeypatch):
  """finetune_grid on RTE, then on WNLI (a task of the same shapes) at another learning
  rate, then extended in its root by a second seed of RTE's setting: three finetune.py
  processes. The first compiles every program it runs; each later run, of another task and
  learning rate or of another seed, loads them from the persistent cache and compiles none
  but the small table of its learning-rate schedule (train_lib.LearningRates), and the seed's
  run, of the first's schedule, not even that; read by name from each run's log.txt (jax's
  compile-time threshold set to 0 so that every program counts, however fast)."""
  import re  # pylint: disable=g-import-not-at-top
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  from tests.conftest import cpu_xla_flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('REALFORMER_COMPILATION_CACHE', str(tmp_path / 'cache'))
  monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  monkeypatch.setenv('JAX_DEBUG_LOG_MODULES', 'jax._src.compiler')  # names each program
  monkeypatch.setenv('XLA_FLAGS', cpu_xla_flags(1))
  root = tmp_path / 'grid'
  grid = ['--root', str(root), '--init_checkpoint', pretrained, '--data_dir', GLUE_DIR,
          '--batch_sizes', '2', '--epochs', '1', '--set', 'max_seq_length=32',
          '--set', 'length_buckets=0']
  assert finetune_grid.main(grid + ['--tasks', 'rte', '--learning_rates', '1e-4',
                                    '--seeds', '1']) == 0
  assert finetune_grid.main(grid + ['--tasks', 'wnli', '--learning_rates', '3e-4',
                                    '--seeds', '1']) == 0
  assert finetune_grid.main(grid + ['--tasks', 'rte', '--learning_rates', '1e-4',
                                    '--seeds', '2']) == 0  # seed 0 is done: seed 1 runs
  runs = []
  for log in root.glob('*/*/log.txt'):
    text = log.read_text()
    compiled = set(re.findall(r'PERSISTENT COMPILATION CACHE MISS for \'(\w+)\'', text))
    loaded = set(re.findall(r'Persistent compilation cache hit for \'(\w+)\'', text))
    runs.append((text.split()[1], compiled, loaded, log.parent))  # by the log's clock
  runs.sort()
  assert len(runs) == 3
  (_, first, none, _), later = runs[0], runs[1:]
  assert not none and {'jit_init', 'jit_step_fn', 'jit_learning_rates'} <= first, first
  for _, compiled, loaded, workdir in later:
    assert compiled <= {'jit_learning_rates'}, (workdir, compiled)
    assert first - {'jit_learning_rates'} <= loaded, (workdir, first - loaded)
  # Each run's log says which: its steps compiled, or loaded (kept whatever jax's threshold:
  # tests/test_compile_cache.py).
  logs = [(run[3] / 'log.txt').read_text() for run in runs]
  for name in ('train step', 'prediction'):
    assert re.search(rf'the {name} for 1 length \(32\): compiled in ', logs[0]), name
    for log in logs[1:]:
      assert re.search(rf'the {name} for 1 length \(32\): loaded from the compilation cache '
                       'in ', log), name
  schedule_of = lambda run: {k: v for k, v in json.loads(
      (run[3] / 'overrides.json').read_text()).items() if k != 'seed'}
  same_schedule = [r for r in later if schedule_of(r) == schedule_of(runs[0])
                   and r[3].parent == runs[0][3].parent]
  assert len(same_schedule) == 1 and not same_schedule[0][1]  # (the second seed's run)


def check_grid_summary(root: str):
  """Runs of three settings in the grid's `root` (a folder or a gs:// URL): the summary
  marks the one with the higher median over seeds best, a failed seed (a non-finite headline:
  no correlation of constant predictions; or a diverged run) counting below every score, so
  that a setting does not win on the median of the seeds it did not fail; an unfinished run
  is left out, and counted."""
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  nan = float('nan')
  for lr, seed, headline in [(1e-5, 0, 0.9), (1e-5, 1, 0.5), (1e-5, 2, 0.5),
                             (2e-5, 0, 0.6), (2e-5, 1, nan), (2e-5, 2, 0.1), (2e-5, 3, 0.6),
                             (2e-5, 4, None), (2e-5, 5, 'diverged'), (2e-5, 6, 0.7),
                             (3e-5, 0, nan), (3e-5, 1, 'diverged'), (4e-5, 0, None)]:
    run = {'optimizer.learning_rate': lr, 'batch_size': 16, 'num_epochs': 2, 'seed': seed}
    workdir = storage.path(root) / 'rte' / f'lr={lr},seed={seed}'
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / 'overrides.json').write_text(json.dumps(run))
    if headline == 'diverged':
      (workdir / 'diverged.json').write_text(json.dumps({'what': 'loss', 'step': 3}))
    elif headline is not None:
      (workdir / 'results.json').write_text(json.dumps({'headline': headline}))
  finetune_grid.main(['--tasks', 'rte', '--root', root, '--summarize_only'])
  rows = (storage.path(root) / 'results.csv').read_text().splitlines()
  assert rows[0].split(',') == finetune_grid.HEADER
  best = [r.split(',') for r in rows[1:] if r.split(',')[11] == 'best']
  # 2e-05's scored seeds have the median 0.6, above 1e-05's 0.5; with its two failed seeds
  # below them, its median is that of (fail, fail, 0.1, 0.6, 0.6, 0.7): 0.35
  assert len(best) == 1 and best[0][1] == '1e-05' and best[0][4:8] == ['3', '0', '0', '0.5']
  markdown = (storage.path(root) / 'results.md').read_text()
  assert '| rte | 2e-05 | 16 | 2 | 6 | 2 | 1 | 0.3500 | 0.5000 | 0.1000 | 0.7000 |  |' in markdown
  assert '| rte | 3e-05 | 16 | 2 | 2 | 2 | 0 | failed |  |  |  |  |' in markdown
  assert '| rte | 4e-05 | 16 | 2 | 0 | 0 | 1 |  |  |  |  |  |' in markdown
  # A grid of another task into the same root keeps the first task's rows (the tasks the
  # root holds are read from its runs' command.json).
  (storage.path(root) / 'rte' / 'lr=1e-05,seed=0' / 'command.json').write_text(json.dumps(
      {'program': 'finetune.py', 'config': 'configs/finetune.py:glue/rte'}))
  mrpc = storage.path(root) / 'mrpc' / 'seed=0'
  mrpc.mkdir(parents=True, exist_ok=True)
  (mrpc / 'overrides.json').write_text(json.dumps(
      {'optimizer.learning_rate': 1e-5, 'batch_size': 16, 'num_epochs': 2, 'seed': 0}))
  (mrpc / 'results.json').write_text(json.dumps({'headline': 0.8}))
  finetune_grid.main(['--tasks', 'mrpc', '--root', root, '--summarize_only'])
  markdown = (storage.path(root) / 'results.md').read_text()
  assert '| mrpc | 1e-05 | 16 | 2 | 1 | 0 | 0 | 0.8000 |' in markdown
  assert markdown.count('| rte |') == 4 and markdown.index('| mrpc |') < markdown.index('| rte |')
  # Runs of two encoders (--init_checkpoint repeated): the best setting of each is marked.
  for init, lr, headline in (('/a', 1e-5, 0.7), ('/a', 2e-5, 0.6), ('/b', 1e-5, 0.5),
                             ('/b', 2e-5, 0.55), ('/c', 1e-5, 0.9), ('/c', 2e-5, 0.9)):
    workdir = storage.path(root) / 'mrpc' / f'init={init[1]},lr={lr}'
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / 'overrides.json').write_text(json.dumps(
        {'init_checkpoint': init, 'optimizer.learning_rate': lr, 'batch_size': 16,
         'num_epochs': 2, 'seed': 0}))
    (workdir / 'results.json').write_text(json.dumps({'headline': headline}))
  finetune_grid.main(['--tasks', 'mrpc', '--root', root, '--summarize_only'])
  rows = [r.split(',') for r in (storage.path(root) / 'results.csv').read_text().splitlines()
          if r.startswith('mrpc,') and 'init_checkpoint' in r]
  assert sorted((r[-1], r[1], r[-2]) for r in rows if r[-2]) == [
      ('init_checkpoint=/a', '1e-05', 'best'), ('init_checkpoint=/b', '2e-05', 'best'),
      ('init_checkpoint=/c', '1e-05', 'best (tied)'), ('init_checkpoint=/c', '2e-05', 'tied')
  ], rows  # (equal medians: the first, said to be tied)
  assert '"best" marks each encoder\'s best setting' in (
      storage.path(root) / 'results.md').read_text().splitlines()[0]


def test_a_grid_extended_with_another_set_keeps_its_settings_apart(tmp_path, capsys):
  """A grid extended in its root with another --set (max_seq_length 128, then 64): the
  summary gives each its own row, never their mean; a run another tool put there (no grid
  values) has its row too; a task named twice runs once; --set values are read as their
  fields' types; an unreadable record is one line naming its file."""
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  root = tmp_path / 'grid'
  for length, seed, headline in [(128, 0, 0.8), (128, 1, 0.6), (64, 2, 0.1)]:
    run = {'optimizer.learning_rate': 2e-5, 'batch_size': 16, 'num_epochs': 2, 'seed': seed,
           'max_seq_length': length}
    workdir = root / 'rte' / f'seed={seed}'
    workdir.mkdir(parents=True)
    (workdir / 'overrides.json').write_text(json.dumps(run))
    (workdir / 'results.json').write_text(json.dumps(
        {'headline': headline} if seed else  # (one run that recorded its dev metrics)
        {'headline': headline, 'dev': {'rte': {'accuracy': headline,
                                               'majority_accuracy': 0.5}}}))
  (root / 'rte' / 'swept').mkdir()  # a sweep.py run: no grid values
  (root / 'rte' / 'swept' / 'overrides.json').write_text(json.dumps({'seed': 0}))
  finetune_grid.main(['--tasks', 'rte,glue/rte', '--root', str(root), '--summarize_only'])
  markdown = (root / 'results.md').read_text()
  assert markdown.count('| rte |') == 3, markdown  # one task, three settings
  assert markdown.startswith("median, mean, min and max of each task's headline metric "
                             '(rte: accuracy)')  # (runs that did not name it: by the task)
  assert ('| rte | 2e-05 | 16 | 2 | 1 | 0 | 0 | 0.1000 | 0.1000 | 0.1000 | 0.1000 |  | '
          'max_seq_length=64 |') in markdown
  assert ('| rte | 2e-05 | 16 | 2 | 2 | 0 | 0 | 0.7000 | 0.7000 | 0.6000 | 0.8000 | best | '
          'max_seq_length=128 |') in markdown
  assert '| rte |  |  |  | 0 | 0 | 1 |' in markdown
  assert markdown.endswith('\nThe headline metric of always predicting the majority label: '
                           'rte 0.5000\n')
  assert finetune_grid.expand_tasks('glue,rte').count('rte') == 1
  with pytest.raises(ValueError, match=r'--tasks tsv: the kind tsv takes any task name; name '
                                       r'yours, --tasks tsv/<name>'):
    finetune_grid.expand_tasks('tsv')
  with pytest.raises(ValueError, match=r"unknown task 'squad/v3'; use GLUE names"):
    finetune_grid.expand_tasks('squad/v3')
  capsys.readouterr()
  finetune_grid.main(['--tasks', 'tsv/topics', '--root', str(tmp_path / 'tsv'), '--seeds', '1',
                      '--learning_rates', '1e-4', '--batch_sizes', '16', '--epochs', '1',
                      '--print_only', '--set', 'tsv.label=007', '--set', 'optimizer.warmup_fraction=0'])
  out = capsys.readouterr().out
  assert {'--config.tsv.label=007', '--config.optimizer.warmup_fraction=0.0'} <= set(out.split())
  (root / 'rte' / 'seed=2' / 'results.json').write_text('{"headline": 0.')
  with pytest.raises(ValueError, match=r'seed=2/results.json is not readable JSON .*; delete '
                                       r"its run's folder"):
    finetune_grid.main(['--tasks', 'rte', '--root', str(root), '--summarize_only'])


def _write_hf_glue(root, task, splits):
  """The shipped TSV rows of `task` as a local Hugging Face GLUE copy in nyu-mll/glue's
  layout (<root>/<task>/<split>-00000-of-00001.parquet), with tfds's column names."""
  import datasets  # pylint: disable=g-import-not-at-top
  t = glue.get_task(task)
  for split in splits:
    examples = glue.read_tsv(task, GLUE_DIR, split)
    columns = {t.tfds_text[0]: [e.text_a for e in examples],
               'label': [-1 if e.label is None else int(e.label) for e in examples],
               'idx': [int(e.guid) if e.guid.isdigit() else i for i, e in enumerate(examples)]}
    if len(t.tfds_text) > 1:
      columns[t.tfds_text[1]] = [e.text_b for e in examples]
    folder = os.path.join(root, 'mnli' if task == 'mnli_mismatched' else task)
    os.makedirs(folder, exist_ok=True)
    datasets.Dataset.from_dict(columns).to_parquet(
        os.path.join(folder, f'{t.tfds_splits[split]}-00000-of-00001.parquet'))


def test_glue_from_a_hugging_face_dataset(pretrained, tmp_path, caplog):
  root = str(tmp_path / 'hf_glue')
  _write_hf_glue(root, 'rte', ('train', 'dev'))  # no test split
  for split in ('train', 'dev'):
    got, want = glue.read_hf('rte', split, root), glue.read_tsv('rte', GLUE_DIR, split)
    assert [(e.text_a, e.text_b, e.label) for e in got] == \
        [(e.text_a, e.text_b, e.label) for e in want]
  caplog.set_level('INFO', logger='absl')
  summary = run(ft_config('rte', pretrained, data_dir=f'hf:{root}',
                                        num_epochs=1), str(tmp_path / 'hf'))
  tsv = run(ft_config('rte', pretrained, num_epochs=1), str(tmp_path / 'tsv'))
  assert summary['dev'] == tsv['dev']  # the same examples: the same run
  assert 'no predictions were written' in caplog.text
  with pytest.raises(ValueError, match='could not be loaded'):
    glue.read_hf('rte', 'train', str(tmp_path / 'missing'))
  # MNLI's splits share prefixes (validation_matched, validation_mismatched, test_matched...).
  _write_hf_glue(root, 'mnli', ('train', 'dev', 'test'))
  _write_hf_glue(root, 'mnli_mismatched', ('dev',))
  for task, split in (('mnli', 'dev'), ('mnli_mismatched', 'dev'), ('mnli', 'test')):
    got, want = glue.read_hf(task, split, root), glue.read_tsv(task, GLUE_DIR, split)
    assert [(e.text_a, e.label) for e in got] == [(e.text_a, e.label) for e in want]
  with pytest.raises(sources.SplitNotFoundError):
    glue.read_hf('rte', 'test', root)


def test_the_bucket_count_follows_the_runs_length(tmp_path):
  """finetune's plan: a padded token costs the model's training FLOPs at the device's rate, a
  length config.bucket_compile_seconds; 1 epoch of a small set gets fewer lengths than 300."""
  lengths = np.minimum(np.random.default_rng(0).lognormal(3.0, 0.6, 3200).astype(int) + 2, 128)
  features = {'attention_mask': (np.arange(128) < lengths[:, None]).astype(np.int32)}
  spec = resolve(pretrain.get_config('postln,small').model)
  flops = lambda length: train_lib.flops_per_example(
      dataclasses.replace(spec, last_layer='all'), length, 0)
  task = types.SimpleNamespace(train=features, eval_features=lambda: [features], spec=spec,
                               flops_per_example=flops)
  config = lambda epochs: ml_collections.ConfigDict(
      {'length_buckets': 5, 'group_by_length': True, 'bucket_multiple': 8,
       'max_seq_length': 128, 'num_epochs': epochs,
       'bucket_compile_seconds': 8.0, 'bucket_flops_per_second': 1e11})
  per_token, worth = finetune_task.compile_cost_in_tokens(config(1), flops)
  assert per_token == pytest.approx(flops(128) / 128 / 1e11)
  assert worth == pytest.approx(8.0 / per_token)
  # A known accelerator's peak (here 1e12 a device): 40% of it on every device of the job,
  # which share the batch.
  with mock.patch.object(finetune_task.metrics_lib, 'peak_flops_per_device',
                         return_value=1e12):
    per_token, _ = finetune_task.compile_cost_in_tokens(
        ml_collections.ConfigDict(dict(config(1), bucket_flops_per_second=0.0)), flops)
  assert per_token == pytest.approx(flops(128) / 128 / (0.4e12 * jax.device_count()))
  short = finetune_task.length_buckets(config(1), task, RunDir(tmp_path), resuming=False)
  (tmp_path / 'long').mkdir()
  long = finetune_task.length_buckets(config(300), task, RunDir(tmp_path / 'long'),
                                      resuming=False)
  assert len(short) < len(long) == 5 and short[-1] == long[-1] == 128
  stored = json.loads((tmp_path / 'long' / RunDir.LENGTH_BUCKETS).read_text())
  assert stored['settings']['bucket_compile_seconds'] == 8.0


def test_a_step_that_waits_for_its_compilation_leaves_it_out_of_the_throughput():
  """The lengths compile in a background thread; a step whose length is not ready waits,
  and that wait is a compilation's time, not the training's (trainer.Window.exclude)."""
  from concurrent import futures  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ('x',), devices=jax.devices()[:1])

  def slow(*args):
    time.sleep(0.5)
    return jax.jit(lambda a, b: (a + 1, b['input_ids'].sum())).lower(*args)

  step = types.SimpleNamespace(lower=slow)
  batch_of = lambda length: {'input_ids': jax.ShapeDtypeStruct((2, length), np.int32)}
  with futures.ThreadPoolExecutor(1) as compiler:
    programs = finetune_task.Programs(step, (jax.ShapeDtypeStruct((), np.int32),), batch_of,
                                      [8, 16], 'step', mesh, compiler)
    out = programs(np.int32(1), {'input_ids': np.ones((2, 16), np.int32)})
    assert int(out[0]) == 2 and int(out[1]) == 32
    assert programs.waited() >= 0.9  # both lengths, compiled in the order given
    programs(np.int32(1), {'input_ids': np.ones((2, 8), np.int32)})
    assert programs.waited() == 0.0
  from realformer.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  window = trainer.Window()
  window.add(metrics_lib.collection(
      finetune_task.FinetuneMetrics, loss=metrics_lib.average(1.0, 1.0),
      learning_rate=metrics_lib.last_value(1.0), grad_norm=metrics_lib.average(1.0, 1.0)),
             trainer.StepCost(examples=2, length=16), flops=0.0)
  time.sleep(0.4)
  window.exclude(0.3)
  before = time.time() - window.start
  seconds = 1 / window.values(1, None)['steps_per_sec']
  assert before - 0.3 <= seconds <= time.time() - window.start - 0.3


def test_a_task_of_ones_own_named_like_a_glue_split_is_scored_by_its_own_metric(tmp_path):
  """tsv/mnli_mismatched is the user's task, not GLUE MNLI's second dev set."""
  from realformer.finetune.tasks import tsv  # pylint: disable=g-import-not-at-top
  config = finetune_configs.get_config('tsv/mnli_mismatched')
  config.unlock()
  config.data_dir = str(tmp_path)
  config.tsv.labels, config.tsv.metric = 'a,b,c', 'macro_f1'
  task = object.__new__(tsv.TsvTask)
  task.config, task.name = config, config.task
  task.task, task.evals = tsv.tsv_task(config), {config.task: None}
  task._predictions = lambda *_: (np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1]))
  dev = task.evaluate_outputs(None)
  assert set(dev['mnli_mismatched']) == {'accuracy', 'macro_f1', 'majority_accuracy',
                                        'majority_macro_f1'}
  # per class F1: 1, 2/3, 2/3 (the last example, a 'b' taken for a 'c')
  assert dev['mnli_mismatched']['macro_f1'] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
  assert dev['mnli_mismatched']['accuracy'] == 0.75
  assert task.dev_headline(dev) == dev['mnli_mismatched']['macro_f1']


def test_config_model_sets_how_the_pretrained_encoder_computes(pretrained, tmp_path):
  """config.model's fields that are set replace the pretraining's (an import of float32
  weights fine-tuned in bfloat16, another dropout, the plain attention path); what the
  encoder is stays the checkpoint's, and best/ and final/ keep its config (with the layout
  of their layers: scanned here, where the pretraining's were unrolled); a field left empty
  is as pretrained."""
  from realformer.finetune import registry  # pylint: disable=g-import-not-at-top
  from realformer.train import partitioning  # pylint: disable=g-import-not-at-top
  config = ft_config('rte', pretrained)
  config.model.dtype, config.model.attention_dropout_rate = 'bfloat16', 0.0
  config.model.fused_attention, config.model.scan_layers = 'off', True
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  task = registry.get('glue')(config, mesh, RunDir(str(tmp_path / 'ft')))
  pre = finetune_task.pretrained_config(pretrained)
  assert task.spec.dtype == jax.numpy.bfloat16 and task.spec.attention_dropout_rate == 0.0
  assert task.spec.fused_attention == 'off'
  assert task.spec.dropout_rate == pre.model.dropout_rate == 0.1  # not set: as pretrained
  assert (task.spec.num_layers, task.spec.hidden_size) == (pre.model.num_layers,
                                                           pre.model.hidden_size)
  assert task.params_config.model.dtype == pre.model.dtype == 'float32'
  assert task.spec.scan_layers and task.params_config.model.scan_layers
  assert not pre.model.scan_layers
  # best/ and final/ record the kind that made their head and its labels, for export-hf
  assert task.params_config.finetuned.to_dict() == {
      'kind': 'glue', 'task': 'rte', 'hf_architecture': 'BertForSequenceClassification',
      'labels': ['entailment', 'not_entailment']}
  assert finetune_task.computed_as(pre.model, ft_config('rte', pretrained).model) is pre.model


def test_the_grid_zips_a_glue_submission_from_each_tasks_best_run(tmp_path, capsys):
  """--submission: for each GLUE task, the predictions of its best setting (by median) and,
  of that setting, the seed with the best dev score, at the zip's top level; MNLI's run gives
  MNLI-m, MNLI-mm and AX; the files the benchmark still lacks are named."""
  import zipfile  # pylint: disable=g-import-not-at-top
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  root = tmp_path / 'grid'
  runs = {'rte': [(1e-5, 0, 0.70), (1e-5, 1, 0.60), (1e-5, 2, 0.65),
                  (2e-5, 0, 0.90), (2e-5, 1, 0.50), (2e-5, 2, 0.55)],
          'mnli': [(1e-5, 0, 0.80), (1e-5, 1, 0.82)]}
  for task, cells in runs.items():
    for lr, seed, headline in cells:
      workdir = root / task / f'lr={lr},seed={seed}'
      (workdir / 'predictions').mkdir(parents=True)
      (workdir / 'overrides.json').write_text(json.dumps(
          {'optimizer.learning_rate': lr, 'batch_size': 16, 'num_epochs': 2, 'seed': seed}))
      (workdir / 'results.json').write_text(json.dumps({'headline': headline}))
      stems = glue.SUBMISSION[task]
      for stem in stems:
        (workdir / 'predictions' / f'{stem}.tsv').write_text(f'index\tprediction\n{lr} {seed}\n')
  out = tmp_path / 'new' / 'submission.zip'  # (its folder made)
  assert finetune_grid.main(['--tasks', 'rte,mnli,squad/v1.1', '--root', str(root),
                             '--summarize_only', '--submission', str(out)]) == 0
  with zipfile.ZipFile(out) as z:
    got = {name: z.read(name).decode().splitlines()[1] for name in z.namelist()}
  # RTE: 1e-05's median 0.65 beats 2e-05's 0.55 (whose best seed, 0.90, does not decide);
  # its best seed is 0. MNLI: one setting, seed 1 the better.
  assert got == {'RTE.tsv': '1e-05 0', 'MNLI-m.tsv': '1e-05 1', 'MNLI-mm.tsv': '1e-05 1',
                 'AX.tsv': '1e-05 1'}
  out_text = capsys.readouterr().out
  assert 'rte: lr=1e-05,seed=0 (dev 0.7000): RTE.tsv' in out_text
  assert (f'wrote {out} (4 files); the benchmark takes all 11: missing CoLA, SST-2, MRPC, '
          'STS-B, QQP, QNLI, WNLI') in out_text
  with pytest.raises(ValueError, match='no GLUE test predictions under'):
    finetune_grid.main(['--tasks', 'cola', '--root', str(root), '--summarize_only',
                        '--submission', str(out)])
  with pytest.raises(ValueError, match='--tasks squad/v1.1 has no GLUE task; name them'):
    finetune_grid.main(['--tasks', 'squad/v1.1', '--root', str(root), '--summarize_only',
                        '--submission', str(out)])
  with pytest.raises(ValueError, match='--submission with --print_only: the runs have not'):
    finetune_grid.main(['--tasks', 'rte', '--root', str(root), '--print_only',
                        '--submission', str(out)])
  # A root whose runs fine-tune several encoders: a submission is one encoder's, refused.
  other = root / 'rte' / 'other_encoder'
  other.mkdir()
  (other / 'overrides.json').write_text(json.dumps(
      {'init_checkpoint': '/b', 'optimizer.learning_rate': 1e-5, 'batch_size': 16,
       'num_epochs': 2, 'seed': 0}))
  with pytest.raises(ValueError, match=r"rte's runs fine-tune several encoders"):
    finetune_grid.main(['--tasks', 'rte', '--root', str(root), '--summarize_only',
                        '--submission', str(out)])
  shutil.rmtree(other)
  # A run recorded before STS-B's headline became Spearman is read by today's rule.
  workdir = root / 'stsb' / 'old'
  workdir.mkdir(parents=True)
  (workdir / 'overrides.json').write_text(json.dumps(
      {'optimizer.learning_rate': 1e-5, 'batch_size': 16, 'num_epochs': 2, 'seed': 0}))
  (workdir / 'results.json').write_text(json.dumps(
      {'headline': 0.9, 'dev': {'stsb': {'pearson': 0.9, 'spearman': 0.8}}}))
  assert [r['headline'] for r in finetune_grid.collect(str(root / 'stsb'), 'stsb')] == [0.8]


def test_a_kind_of_ones_own_is_told_its_contract_in_one_line(pretrained, tmp_path):
  """A kind whose per-token labels are not in its sequence_keys (length buckets would not
  cut them) is refused before anything is written; one whose model returns its head's
  outputs alone (not the encoder's output first) is told so when its evaluation traces."""
  from realformer.finetune import registry  # pylint: disable=g-import-not-at-top
  from realformer.train import partitioning  # pylint: disable=g-import-not-at-top
  config = ft_config('rte', pretrained)
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  glue_task = registry.get('glue')

  class Tagged(glue_task):
    def load(self, tokenizer):
      super().load(tokenizer)
      self.train['tags'] = np.zeros_like(self.train['input_ids'])
  with pytest.raises(ValueError, match=r"Tagged: the training features \['tags'\] hold values "
                     r"per token .* add them \(sequence_keys = \('input_ids', 'segment_ids', "
                     r"'attention_mask'\) \+ \('tags',\)\)"):
    Tagged(config, mesh, RunDir(str(tmp_path / 'a')))

  class HeadOnly(glue_task):
    def build(self, spec):
      class Logits(nn.Module):
        spec: object

        @nn.compact
        def __call__(self, batch, **kw):
          return models.build(self.spec, head='classification', num_labels=2)(batch, **kw)[1]
      return Logits(spec)
  task = HeadOnly(config, mesh, RunDir(str(tmp_path / 'b')))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in task.program.batch_shapes.items()
           if k != 'label'}
  with pytest.raises(ValueError, match=r"HeadOnly.build: its model returns an array; a "
                     r"fine-tuning model returns \(the encoder's output, \*the head's outputs\)"):
    jax.eval_shape(task.program.eval_step, task.program.abstract.params, batch)
  # The HF class a kind's head exports as is declared where its build is: HeadOnly's own head
  # inherits none of GLUE's; Tagged keeps GLUE's head, and its class.
  assert finetune_task.hf_architecture_of(HeadOnly) == ''
  assert finetune_task.hf_architecture_of(Tagged) == 'BertForSequenceClassification'
  assert finetune_task.hf_architecture_of(registry.get('tsv')) == 'BertForSequenceClassification'
  assert finetune_task.hf_architecture_of(registry.get('squad')) == 'BertForQuestionAnswering'
