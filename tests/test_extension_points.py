"""A new attention-logit component, a new block and a new fine-tuning task are one
registration each: this file defines all three, with no library file naming them. The component (a learned per-head
relative-position bias) declares its logical axes, FLOPs, fixed parameters, that it is a
bias of the logits (added with weight 1, not mixed) and that the fused attention may add it;
it pretrains on a data x fsdp x tensor mesh, resumes, runs
through the flash kernel as the plain path does, and reports its FLOPs. The task kind (its
config fields, data, head, head FLOPs and metric) fine-tunes from that pretraining."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import finetune
import train
from configs import finetune as finetune_configs
from data import glue
from data import tokenizer as tokenizer_lib
from realformer import models as models_lib
from realformer.finetune import registry
from realformer.finetune.task import FinetuneTask
from realformer.layers.dense import dense
from realformer.layers.rows import gather_rows
from realformer.model import blocks
from realformer.model.encoder import Encoder
from realformer.model.spec import resolve
from realformer.tools import hlo_stats
from realformer.tools import launch
from realformer.train import partitioning
from realformer.train import pretraining
from realformer.train import train_lib
from realformer.train.run_dir import RunDir
from synthesizer import synthetic
from tests import test_flash_variants
from tests.test_train import losses, tiny_config

MAX_DISTANCE = 6


@synthetic.register('relpos')
class RelativePositionBias(synthetic.LogitComponent):
  """logits[h, q, k] = table[h, clip(k - q, -MAX_DISTANCE, MAX_DISTANCE)]: one learned bias
  per head and clipped distance, shared by the batch (as T5's, without its log buckets).
  A gather, no matmul (flops: 0); nothing fixed; a bias of the logits, added with weight 1
  (not mixed); fusable: it adds to Q K^T."""
  mixed = False

  @nn.compact
  def __call__(self, x, rows=None):
    s, t = self.spec, x.shape[1]
    table = self.param('table', nn.with_logical_partitioning(nn.initializers.normal(0.5),
                                                             ('heads', None)),
                       (s.num_heads, 2 * MAX_DISTANCE + 1), jnp.float32)
    distance = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
    bias = table[:, jnp.clip(distance, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE]
    return bias[None] if rows is None else gather_rows(bias, rows, axis=1, batched=False)


def _relpos_config(**train_overrides):
  config = tiny_config(**train_overrides)
  config.model.attention = 'dot+relpos'
  # (synthetic batches over the tokenizer's vocabulary, which the fine-tuning below reads)
  config.model.vocab_size = tokenizer_lib.load_for_config(config.data).vocab_size
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  return config


@pytest.fixture(scope='module')
def relpos_pretraining(tmp_path_factory):
  """A 4-step pretraining run of Post-LN with the component on a 2 x 2 x 2 mesh."""
  workdir = str(tmp_path_factory.mktemp('relpos'))
  assert train.train_and_evaluate(_relpos_config(num_steps=4), workdir)['step'] == 4
  return workdir


def test_a_bias_of_the_logits_is_added_with_weight_one():
  """A component declared not `mixed` adds its logits to Q K^T / sqrt(d) as they are: each
  real query's log-probabilities differ from Post-LN's (the same parameters) by the bias, up
  to the row's normalisation; no mixture weight is made."""
  from tests.test_models import make_batch, perturbed_params, small_config  # pylint: disable=g-import-not-at-top
  batch = make_batch()
  plain = models_lib.build(small_config('postln'), head='encoder')
  biased = models_lib.build(small_config('postln', attention='dot+relpos'), head='encoder')
  assert biased.spec.mixture == () and resolve(small_config(
      'postln', attention='random+relpos+dot')).mixture == ('random', 'dot')
  params = perturbed_params(biased, batch)
  assert not any('mixture_logits' in jax.tree_util.keystr(path)
                 for path, _ in jax.tree_util.tree_leaves_with_path(params))
  shared = jax.tree.map(lambda x: x, params)
  for layer in (k for k in shared if k.startswith('layers_')):
    del shared[layer]['attention']['synth_relpos']
  a = plain.apply({'params': shared}, batch, capture_attention=True).attention[0]
  b = biased.apply({'params': params}, batch, capture_attention=True).attention[0]
  table = np.asarray(params['layers_0']['attention']['synth_relpos']['table'])
  t = batch['input_ids'].shape[1]
  distance = np.clip(np.arange(t)[None, :] - np.arange(t)[:, None], -MAX_DISTANCE, MAX_DISTANCE)
  bias = table[:, distance + MAX_DISTANCE]  # [H, T, T]
  real = np.asarray(batch['attention_mask'], bool)
  for i in range(len(real)):
    keys = real[i]
    pick = lambda p: np.log(np.asarray(p[i], np.float64)[:, keys][:, :, keys])
    diff = pick(b) - pick(a)
    want = bias[:, keys][:, :, keys]
    np.testing.assert_allclose(diff - diff.mean(-1, keepdims=True),
                               want - want.mean(-1, keepdims=True), atol=2e-4)


def test_biases_of_the_logits_alone_are_warned_about(caplog):
  """An attention of biases alone (relpos without dot) attends by position, never by
  content: a warning naming the fix; none beside the dot product, nor for a Random
  Synthesizer alone (a paper's variant, mixed)."""
  from realformer import config_checks  # pylint: disable=g-import-not-at-top
  from tests.test_models import small_config  # pylint: disable=g-import-not-at-top
  for attention, warned in (('relpos', True), ('dot+relpos', False), ('random', False)):
    caplog.clear()
    config = small_config('postln', attention=attention)
    config_checks.check_used(config, resolve(config))
    assert ("holds only biases of the logits (added, not mixed): its attention reads no "
            f"token's content; add the dot product (dot+{attention})" in caplog.text
            ) == warned, (attention, caplog.text)


def _relpos_reference(p, x, spec):
  """The component's float64 formula, from its definition: table[h, clip(k - q)]."""
  t = x.shape[1]
  distance = np.clip(np.arange(t)[None, :] - np.arange(t)[:, None], -MAX_DISTANCE, MAX_DISTANCE)
  return p['table'][:, distance + MAX_DISTANCE][None]


@pytest.mark.parametrize('attention', ['dot+relpos', 'random+relpos+dot'])
def test_the_component_against_the_float64_reference(attention, monkeypatch):
  """The encoder against tests/reference.py with the component's formula added to it
  (reference.COMPONENTS): alone beside the dot product, and beside a mixture it stays out of
  (Random and the dot product weighted, the bias added as it is)."""
  from tests import reference  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_batch, np_batch, perturbed_params, small_config  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(reference.COMPONENTS, 'relpos', _relpos_reference)
  config = small_config('postln', attention=attention)
  model = models_lib.build(config, head='encoder')
  batch = make_batch()
  params = perturbed_params(model, batch)
  out = model.apply({'params': params}, batch, capture_attention=True)
  b = np_batch(batch)
  hidden, probs, _, _ = reference.encoder(params, resolve(config), b['input_ids'],
                                          b['segment_ids'], b['attention_mask'])
  np.testing.assert_allclose(out.hidden, hidden, rtol=2e-4, atol=2e-4)
  for got, want in zip(out.attention, probs):
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=2e-5)


def _deepnet_gains(spec):
  beta = (8 * spec.num_layers) ** -0.25
  return dict.fromkeys(('value', 'out', 'intermediate', 'output'), beta)


def deep_norm(layer, x):
  """DeepNet's Post-LN (Wang et al. 2022) for an encoder of N layers: LN(alpha x +
  Sublayer(x)), alpha = (2N)^(1/4); its value, output and feed-forward kernels drawn with a
  gain of beta = (8N)^(-1/4) (_deepnet_gains)."""
  alpha = (2 * layer.spec.num_layers) ** 0.25
  x = layer.norm('attention_layer_norm',
                 alpha * layer.residual(x) + layer.dropout(layer.attention(x)))
  return layer.norm('mlp_layer_norm', alpha * x + layer.dropout(layer.mlp(x)))


def _deep_norm_reference(x, attend, mlp, ln, num_layers=2):
  """DeepNet's layer in float64, from the paper's formula (tests/reference.py BLOCKS)."""
  alpha = (2 * num_layers) ** 0.25
  x = ln('attention_layer_norm', alpha * x + attend(x))
  return ln('mlp_layer_norm', alpha * x + mlp(x))


def test_a_block_of_ones_own_is_one_function(monkeypatch, tmp_path):
  """A block registered with its init gains (DeepNet's) is named by model.block: its
  kernels start at the gains declared, the encoder equals the float64 reference given its
  formula, under RealFormer's residual attention too, the pruned last layer equals the
  full one, and it pretrains and resumes; an unknown name lists the registered ones."""
  from tests import reference  # pylint: disable=g-import-not-at-top
  from tests import test_last_layer  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_batch, np_batch, perturbed_params, small_config  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(blocks, 'BLOCKS', dict(blocks.BLOCKS))
  blocks.register('deep_norm', init_gains=_deepnet_gains)(deep_norm)
  monkeypatch.setitem(reference.BLOCKS, 'deep_norm', (_deep_norm_reference, False))
  batch = make_batch()
  for variant in ('postln', 'realformer'):
    config = small_config(variant, block='deep_norm', num_layers=2)
    spec = resolve(config)
    model = models_lib.build(config, head='encoder')
    initial = model.init(jax.random.PRNGKey(0), batch)['params']['layers_0']
    spread = lambda *path: float(np.std(np.asarray(
        functools.reduce(lambda t, k: t[k], path, initial)['kernel'].unbox())))
    beta = (8 * 2) ** -0.25
    for path in (('attention', 'value'), ('attention', 'out'), ('mlp', 'intermediate')):
      assert abs(spread(*path) / (beta * spec.initializer_range) - 1) < 0.2, path
    assert abs(spread('attention', 'query') / spec.initializer_range - 1) < 0.2
    params = perturbed_params(model, batch)
    out = model.apply({'params': params}, batch)
    b = np_batch(batch)
    hidden, _, _, _ = reference.encoder(params, spec, b['input_ids'], b['segment_ids'],
                                        b['attention_mask'])
    np.testing.assert_allclose(out.hidden, hidden, rtol=2e-4, atol=2e-4)
    test_last_layer._compare(variant, block='deep_norm')  # pylint: disable=protected-access
  config = tiny_config(num_steps=4, checkpoint_every_steps=2)
  config.model.block = 'deep_norm'
  assert train.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:1])[
      'step'] == 4
  with pytest.raises(ValueError, match=r"model.block='deepnorm'; choose one of post_ln, "
                                       r'pre_ln, deep_norm \(or one of your own'):
    resolve(small_config('postln', block='deepnorm'))


# pylint: disable=redefined-outer-name  (the fixture)
def test_a_logit_component_of_ones_own_is_one_class(relpos_pretraining, tmp_path, monkeypatch):
  spec = resolve(_relpos_config().model)
  assert spec.attention == ('dot', 'relpos') and spec.flash_fusable
  # Pretrained on a 2 x 2 x 2 mesh, its table split by head over tensor as declared; a run
  # stopped after step 2 and resumed logs the uninterrupted run's losses to the bit.
  train.train_and_evaluate(_relpos_config(num_steps=2), str(tmp_path / 'resumed'))
  resumed = train.train_and_evaluate(_relpos_config(num_steps=4), str(tmp_path / 'resumed'))
  assert resumed['step'] == 4
  assert losses(tmp_path / 'resumed') == losses(relpos_pretraining)
  model, tx = models_lib.build(spec), train_lib.make_optimizer(_relpos_config().optimizer,
                                                                     spec)
  mesh = partitioning.make_mesh(_relpos_config().mesh)
  _, shardings = train_lib.state_shardings(model, tx, pretraining.abstract_batch(8, 32, 5), mesh)
  table = shardings.params['encoder']['layers_0']['attention']['synth_relpos']['table']
  assert tuple(table.spec) == ('tensor', None)
  # Its FLOPs: the compiled step's matmuls are the model's count, its declaration included
  # (a declaration is read: a component claiming 1 MFLOP a row adds it to every layer). The
  # launch check's step is the program the runs above trained with: the cache's entry.
  report, _ = launch.compile_step(_relpos_config(eval_steps=0), launch.local_target())
  assert report.flop_ratio == pytest.approx(1.0, abs=0.05) and report.loaded
  before = train_lib.flops_per_example(spec, 32, 5)
  monkeypatch.setattr(RelativePositionBias, 'flops', staticmethod(lambda s, r, t: r * 1e6))
  assert train_lib.flops_per_example(spec, 32, 5) == before + 3 * 1e6 * (32 + 8)
  monkeypatch.undo()
  # Through the flash kernel (Pallas's interpreter here): the plain path's outputs and
  # gradients, the same dropout masks.
  test_flash_variants.test_in_the_model_flash_gives_the_plain_paths_outputs_and_gradients(
      'postln', {'attention': 'dot+relpos'}, 'triton', monkeypatch)

WORDS = ('the', 'a', 'cell', 'team', 'lens', 'match', 'nation', 'won', 'held', 'under')


WIDTH = 2048  # the head's hidden layer: wide enough that its FLOPs are a good part of the step


class MeanPooled(nn.Module):
  """The encoder, then an MLP classifier on the mean of the real tokens' final states."""
  spec: object
  num_labels: int

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False):
    out = Encoder(self.spec, name='encoder')(batch, deterministic=deterministic,
                                             capture_attention=capture_attention)
    mask = batch['attention_mask'][..., None].astype(jnp.float32)
    mean = (out.hidden.astype(jnp.float32) * mask).sum(1) / mask.sum(1)
    # Logical axes shard the head as the encoder's MLP is (no rule to add): over the tensor
    # axis, and not computed again on every tensor shard, as a plain nn.Dense would be.
    hidden = nn.relu(dense(WIDTH, ('embed', 'mlp'), self.spec, 'head_hidden')(mean))
    logits = dense(self.num_labels, ('mlp', None), self.spec, 'classifier')(hidden)
    return out, logits.astype(jnp.float32)


@registry.register('keyword')
class KeywordTask(FinetuneTask):
  """Does the sentence hold config.keyword? Sentences drawn from WORDS by (seed, split);
  the headline is balanced accuracy (the mean of the two classes' recalls)."""

  @classmethod
  def configure(cls, config, name):
    config.keyword = 'cell'
    config.num_sentences = 96

  def load(self, tokenizer):
    self.name = self.config.task
    rng = np.random.default_rng(self.config.seed)

    def split(n):
      sentences = [' '.join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(n)]
      return glue.featurize([glue.Example(str(i), s, None, int(self.config.keyword in s.split()))
                             for i, s in enumerate(sentences)], tokenizer,
                            self.config.max_seq_length)
    self.train, self.dev = split(self.config.num_sentences), split(32)

  def build(self, spec):
    return MeanPooled(spec, 2)

  def head_flops(self, length):
    return 2 * self.spec.hidden_size * WIDTH + 2 * WIDTH * 2  # (the mean is no matmul)

  def loss_fn(self, model):
    def loss_fn(params, batch, rng, totals):
      _, logits = model.apply({'params': params}, batch, deterministic=rng is None,
                              rngs=None if rng is None else {'dropout': rng})
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
      return jnp.sum(ce) / totals['examples'], {}
    return loss_fn

  def eval_features(self):
    return [self.dev]

  def _predict(self, outputs):  # a helper named as FinetuneTask's own bookkeeping once was
    (logits,) = outputs(self.dev)
    return logits.argmax(-1)

  def evaluate_outputs(self, outputs):
    guess, label = self._predict(outputs), self.dev['label']
    recalls = [float(np.mean(guess[label == k] == k)) for k in (0, 1) if (label == k).any()]
    return {self.name: {'balanced_accuracy': float(np.mean(recalls)),
                        'accuracy': float(np.mean(guess == label))}}

  def write_predictions(self, outputs, results, out_dir):
    del outputs, results, out_dir  # no test split

  def dev_headline(self, dev):
    return dev[self.name]['balanced_accuracy']

  def headline_metric(self):
    return 'balanced_accuracy'


def _config(init, **overrides):
  config = finetune_configs.get_config('keyword/cell')
  config.unlock()
  config.init_checkpoint = init
  config.batch_size, config.eval_batch_size, config.max_seq_length = 8, 8, 16
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  config.optimizer.learning_rate = 1e-3
  for k, v in overrides.items():
    config[k] = v
  return config


def test_a_task_of_ones_own_is_one_file(relpos_pretraining, tmp_path):
  """Fine-tuned from the pretraining with the component above."""
  assert registry.get('keyword') is KeywordTask and 'keyword' in registry.kinds()
  config = _config(relpos_pretraining, num_epochs=1)
  assert (config.keyword, config.num_sentences) == ('cell', 96)  # its own fields
  assert 'doc_stride' not in config and 'tsv' not in config  # and no other kind's
  summary = finetune.finetune(config, str(tmp_path / 'ft'))
  assert summary['task'] == 'cell' and summary['step'] == 96 // 8
  assert summary['headline'] == summary['dev']['cell']['balanced_accuracy']
  assert summary['headline_metric'] == 'balanced_accuracy'  # (printed beside the headline)
  assert (tmp_path / 'ft' / RunDir.FINAL).is_dir()
  # Its FLOPs are what the compiled train step computes: the encoder and its own head.
  mesh = partitioning.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    task = KeywordTask(config, mesh, RunDir(str(tmp_path / 'flops')))
    task.prepare(0)  # the program's train step, compiled for each length bucket
    length = task.buckets[0]
    programs = task.program.train_step
    compiled = programs._programs[length].result()  # pylint: disable=protected-access
    task.close()
  assert tuple(task.program.shardings.params['head_hidden']['kernel'].spec) == ('fsdp', 'tensor')
  per_example = hlo_stats.analyze(compiled.as_text()).matmul_flops * 8 / config.batch_size
  assert per_example == pytest.approx(task.flops_per_example(length), rel=0.05)
  without_head = task.flops_per_example(length) - 3 * task.head_flops(length)
  assert per_example > 1.2 * without_head  # (a task that forgot its head would fail here)


def test_a_set_evaluated_without_examples_is_refused_before_training(relpos_pretraining,
                                                                    tmp_path):
  """An empty dev set (a kind's reader that let an empty file through) is one line when the
  task is built, not a crash after its first epoch."""
  class EmptyDev(KeywordTask):
    def eval_features(self):
      return [self.train, {k: v[:0] for k, v in self.dev.items()}]

  config = _config(relpos_pretraining)
  mesh = partitioning.make_mesh(config.mesh)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r'^cell: set 2 of the 2 that '
                                         r'EmptyDev.eval_features\(\) returns .* holds no '
                                         r'example; is its file empty\?'):
    EmptyDev(config, mesh, RunDir(str(tmp_path / 'run')))


def test_a_kind_is_registered_once():
  with pytest.raises(ValueError, match="two fine-tuning tasks are registered as 'keyword'"):
    registry.register('keyword')(type('Other', (KeywordTask,), {}))
  assert {'glue', 'keyword', 'squad', 'tsv'} <= set(registry.kinds())  # (and any of yours)
  with pytest.raises(ValueError, match="no fine-tuning task kind 'keywords'; choose one of "
                                       + ', '.join(registry.kinds())):
    finetune_configs.get_config('keywords/cell')


def test_a_component_or_a_kind_in_a_file_of_its_own_is_found_by_its_name(tmp_path,
                                                                        monkeypatch):
  """synthesizer/<name>.py and realformer/finetune/tasks/<kind>.py are imported when a config
  first names them (here from a folder added to the packages' paths); a file that registers
  nothing under its name or fails to import, a GLUE name that is no training task, and a
  config whose kind was changed by an override are one-line errors."""
  import synthesizer  # pylint: disable=g-import-not-at-top
  from realformer.finetune import tasks  # pylint: disable=g-import-not-at-top
  (tmp_path / 'scaled_bias.py').write_text(
      'from synthesizer import synthetic\n'
      '@synthetic.register("scaled_bias")\n'
      'class ScaledBias(synthetic.LogitComponent):\n'
      '  def __call__(self, x, rows=None):\n'
      '    raise NotImplementedError\n')
  (tmp_path / 'unregistered.py').write_text(  # a component, its @register forgotten
      'from synthesizer import synthetic\n'
      'class Forgotten(synthetic.LogitComponent):\n'
      '  pass\n')
  (tmp_path / 'helpers.py').write_text('NOTHING = 1\n')  # no component: not one at all
  (tmp_path / 'aliased.py').write_text(  # a class defined elsewhere, registered here
      'from synthesizer import synthetic\n'
      'synthetic.register("aliased")(synthetic.SYNTHESIZERS["dense"])\n')
  (tmp_path / 'broken.py').write_text('def f(:\n')
  (tmp_path / 'later_bias.py').write_text('')  # not imported before the error lists it
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(synthesizer, '__path__', list(synthesizer.__path__) + [str(tmp_path)])
  monkeypatch.setattr(tasks, '__path__', list(tasks.__path__) + [str(tmp_path)])
  monkeypatch.setattr(synthetic, 'SYNTHESIZERS', dict(synthetic.SYNTHESIZERS))
  config = tiny_config().model
  config.attention = 'scaled_bias+dot'
  assert resolve(config).attention == ('scaled_bias', 'dot')
  assert synthetic.SYNTHESIZERS['scaled_bias'].__module__ == 'synthesizer.scaled_bias'
  assert synthetic.component('aliased') is synthetic.SYNTHESIZERS['dense']  # the first call
  for name in ('scaled_biass', 'synthetic', 'helpers'):  # (the package's own module too)
    config.attention = f'{name}+dot'
    with pytest.raises(ValueError, match=rf"model.attention='{name}\+dot': expected "
                                         r'distinct components .* \(or one of your own: '
                                         r'synthesizer/<name>.py\)'):
      resolve(config)
  with pytest.raises(ValueError, match=r'from dot, dense, .*scaled_bias, .*later_bias'):
    resolve(config)
  config.attention = 'unregistered+dot'
  with pytest.raises(ValueError, match=r'synthesizer/unregistered.py registers no logit '
                                       r"component as 'unregistered'; decorate its "
                                       r"LogitComponent with @register\('unregistered'\)"):
    resolve(config)
  config.attention = 'broken+dot'
  with pytest.raises(ValueError, match=r'synthesizer/broken.py failed to import \(SyntaxError: '
                                       r'.*broken.py, line 1\)\); fix the file'):
    resolve(config)
  with pytest.raises(ValueError, match=r'realformer/finetune/tasks/unregistered.py registers '
                                       r"no task as 'unregistered'"):
    finetune_configs.get_config('unregistered/x')
  with pytest.raises(ValueError, match=r'realformer/finetune/tasks/broken.py failed \(.*line 1'
                                       r'\): SyntaxError'):
    finetune_configs.get_config('broken/x')
  for name, error in (('ax', 'it has no training set: fine-tune glue/mnli'),
                      ('sst5', 'unknown GLUE task; choose one of cola, sst2')):
    with pytest.raises(ValueError, match=f'config arg glue/{name}: {error}'):
      finetune_configs.get_config(f'glue/{name}')
  config = finetune_configs.get_config('glue/rte')  # another kind by override: one line
  config.unlock()
  config.benchmark, config.task = 'squad', 'v1.1'
  with pytest.raises(ValueError, match=r'config.benchmark=squad: this config lacks the fields '
                                       r'of that kind \(doc_stride, max_answer_length'):
    finetune.finetune(config, str(tmp_path / 'never'))
  config.benchmark = 'tsv'  # a kind whose own check reads its fields: the same line first
  with pytest.raises(ValueError, match=r'config.benchmark=tsv: this config lacks the fields '
                                       r'of that kind \(tsv.label, tsv.labels'):
    finetune.finetune(config, str(tmp_path / 'never'))
  assert not (tmp_path / 'never').exists()
