"""A new fine-tuning task is one file: this one defines a task kind (its config fields, data,
head, head FLOPs and metric), registers it, and fine-tunes it through finetune.py's own
function on a data x fsdp x tensor mesh, with no library file naming it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import finetune
from configs import finetune as finetune_configs
from data import glue
from realformer.finetune import registry
from realformer.finetune.task import FinetuneTask
from realformer.layers.dense import dense
from realformer.model.encoder import Encoder
from realformer.tools import hlo_stats
from realformer.train import partitioning
from realformer.train.run_dir import RunDir
from tests.test_finetune import pretrained  # pylint: disable=unused-import

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

  def evaluate_outputs(self, outputs):
    (logits,) = outputs(self.dev)
    guess, label = logits.argmax(-1), self.dev['label']
    recalls = [float(np.mean(guess[label == k] == k)) for k in (0, 1) if (label == k).any()]
    return {self.name: {'balanced_accuracy': float(np.mean(recalls)),
                        'accuracy': float(np.mean(guess == label))}}

  def write_predictions(self, outputs, results, out_dir):
    del outputs, results, out_dir  # no test split

  def dev_headline(self, dev):
    return dev[self.name]['balanced_accuracy']


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


def test_a_task_of_ones_own_is_one_file(pretrained, tmp_path):  # pylint: disable=redefined-outer-name
  assert registry.get('keyword') is KeywordTask and 'keyword' in registry.kinds()
  config = _config(pretrained, num_epochs=2)
  assert (config.keyword, config.num_sentences) == ('cell', 96)  # its own fields
  assert 'doc_stride' not in config and 'tsv' not in config  # and no other kind's
  summary = finetune.finetune(config, str(tmp_path / 'ft'))
  assert summary['task'] == 'cell' and summary['step'] == 2 * 96 // 8
  assert summary['headline'] == summary['dev']['cell']['balanced_accuracy']
  assert (tmp_path / 'ft' / RunDir.FINAL).is_dir()
  # Its FLOPs are what the compiled train step computes: the encoder and its own head.
  mesh = partitioning.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    task = KeywordTask(config, mesh, RunDir(str(tmp_path / 'flops')))
    task.prepare(0)
    programs = task.compile_train_step()
    length = task.buckets[0]
    compiled = programs._programs[length].result()  # pylint: disable=protected-access
    task.close()
  assert tuple(task.shardings.params['head_hidden']['kernel'].spec) == ('fsdp', 'tensor')
  per_example = hlo_stats.analyze(compiled.as_text()).matmul_flops * 8 / config.batch_size
  assert per_example == pytest.approx(task.flops_per_example(length), rel=0.05)
  without_head = task.flops_per_example(length) - 3 * task.head_flops(length)
  assert per_example > 1.2 * without_head  # (a task that forgot its head would fail here)


def test_a_kind_is_registered_once():
  with pytest.raises(ValueError, match="two fine-tuning tasks are registered as 'keyword'"):
    registry.register('keyword')(type('Other', (KeywordTask,), {}))
  with pytest.raises(ValueError, match="no fine-tuning task kind 'keywords'; choose one of "
                                       'glue, keyword, squad, tsv'):
    finetune_configs.get_config('keywords/cell')
