"""GLUE fine-tuning (Wang et al. 2019), `configs/finetune.py:glue/<task>`: the nine tasks'
data, head, loss, metrics and submission files, as a FinetuneTask.

Data: config.data_dir holds the official TSV folders (CoLA/, SST-2/, ...; test.tsv is
optional), or `hf:<dataset>` reads Hugging Face's copy, or empty reads tfds glue/<task>.
Its own field: skip_malformed_rows.
"""

from typing import Dict, Tuple

import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from data import glue
from data import sources
from realformer import models
from realformer.finetune import metrics as finetune_metrics
from realformer.finetune.registry import register
from realformer.finetune.task import FinetuneTask
from realformer.train import distributed

# GLUE's nine tasks (the grid's `--tasks glue`); data/glue.TASKS also holds MNLI's mismatched
# dev set and the AX diagnostic, which the mnli run evaluates and predicts.
NINE = ('cola', 'sst2', 'mrpc', 'stsb', 'qqp', 'mnli', 'qnli', 'rte', 'wnli')


@register('glue')
class GlueTask(FinetuneTask):
  """One GLUE task (mnli also evaluates mismatched dev and predicts AX): a classifier (a
  regressor for STS-B) on [CLS]'s pooled output, GLUE's metrics, the submission files."""
  token_outputs = False  # the head's outputs are per example
  hf_architecture = 'BertForSequenceClassification'

  @classmethod
  def configure(cls, config: ml_collections.ConfigDict, name: str) -> None:
    if cls.names() and name not in cls.names():
      raise ValueError(f'config arg {cls.kind or "glue"}/{name}: '
                       + ('it has no training set: fine-tune glue/mnli, which also evaluates '
                          'mismatched dev and predicts AX' if name in glue.TASKS else
                          f'unknown GLUE task; choose one of {", ".join(cls.names())}'))
    # Rows of a TSV with too few columns are an error naming file and line; True skips those
    # of train.tsv and reports how many (the official QQP and MNLI files hold a few); dev and
    # test rows are never skipped (a score or a submission without them would be wrong).
    config.skip_malformed_rows = False

  @classmethod
  def names(cls) -> Tuple[str, ...]:
    return NINE

  def glue_task(self) -> glue.Task:
    """The task's columns, labels and metric (data/glue.Task)."""
    return glue.get_task(self.config.task)

  def download(self) -> None:
    if not self.config.data_dir:  # tfds glue/<task> (mnli: its mismatched sets, and AX)
      for task in (self.config.task,) + (('ax',) if self.config.task == 'mnli' else ()):
        glue.prepare_tfds(task, self.config.tfds_data_dir)

  def load(self, tokenizer):
    config = self.config
    self.name = config.task
    self.task = self.glue_task()
    self.regression = not self.task.labels
    self.featurize = lambda ex: glue.featurize(ex, tokenizer, config.max_seq_length,
                                               self.regression)
    self.train = self.featurize(self._load(config.task, 'train'))
    self.evals = {config.task: self._load(config.task, 'dev')}
    # GLUE's test sets are optional: without test.tsv the run trains and evaluates only.
    self.tests = {config.task: self._load_test(config.task)}
    if self.task is glue.TASKS['mnli']:
      self.evals['mnli_mismatched'] = self._load('mnli_mismatched', 'dev')
      self.tests['mnli_mismatched'] = self._load_test('mnli_mismatched')
      self.tests['ax'] = self._load_test('ax')
    self.features = {(split, name): self.featurize(examples)  # tokenised once
                     for split, sets in (('dev', self.evals), ('test', self.tests))
                     for name, examples in sets.items() if examples is not None}

  def _load_test(self, task: str):
    try:
      return self._load(task, 'test')
    except (FileNotFoundError, sources.SplitNotFoundError):
      if not self.config.data_dir:
        raise
      return None

  def _spec(self, name: str):
    """What data/glue and the metrics take for `name`: a GLUE task's name (a subclass with a
    task of its own: its Task)."""
    return name

  def _load(self, task: str, split: str):
    task = self._spec(task)
    if self.config.data_dir.startswith('hf:'):
      return glue.read_hf(task, split, self.config.data_dir[len('hf:'):])
    if self.config.data_dir:
      return glue.read_tsv(task, self.config.data_dir, split,  # dev/test: every row counts
                           skip_malformed=self.config.skip_malformed_rows and split == 'train')
    return glue.read_tfds(task, split, self.config.tfds_data_dir)

  def build(self, spec):
    return models.build(spec, head='classification',
                        num_labels=len(self.task.labels) or 1)

  def label_names(self):
    return tuple(self.task.labels)

  def head_flops(self, length: int) -> float:
    del length  # the pooler and the classifier read [CLS] alone
    d = self.spec.hidden_size
    return 2 * d * d + 2 * d * (len(self.task.labels) or 1)

  def loss_fn(self, model):
    """CE over the classes (MSE for regression), mean over the step's examples."""
    def loss_fn(params, batch, rng, totals):
      deterministic = rng is None
      _, logits = model.apply({'params': params}, batch, deterministic=deterministic,
                              rngs=None if deterministic else {'dropout': rng})
      if self.regression:
        per_example = (logits[:, 0] - batch['label']) ** 2
      else:
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
      return jnp.sum(per_example) / totals['examples'], {}
    return loss_fn

  def eval_features(self):
    """Every feature set that is only evaluated or predicted (their lengths matter too)."""
    return list(self.features.values())

  def _predictions(self, outputs, split, name):
    feats = self.features[split, name]
    (logits,) = outputs(feats)
    return (logits[:, 0] if self.regression else logits.argmax(-1)), feats['label']

  def evaluate_outputs(self, outputs) -> Dict[str, Dict[str, float]]:
    results = {}
    for name in self.evals:
      preds, labels = self._predictions(outputs, 'dev', name)
      mismatched = name == 'mnli_mismatched' and name != self.name  # GLUE MNLI's second dev
      results[name] = finetune_metrics.glue_metrics(
          'mnli' if mismatched else self._spec(name), preds, labels)
    return results

  def write_predictions(self, outputs, results, out_dir: str):
    """GLUE's submission files of the test sets, and each dev set's predictions with the
    model's scores (data/glue.write_dev_scores), from the params the run finished with."""
    del results
    for name, examples in self.evals.items():
      (logits,) = outputs(self.features['dev', name])  # every process: collectives
      distributed.on_process_zero(
          lambda: glue.write_dev_scores(self._spec(name), examples, logits, out_dir),
          f'write the dev scores of {name} to {out_dir}/dev')
    missing = [n for n, examples in self.tests.items() if examples is None]
    for name, examples in self.tests.items():
      if examples is not None:
        preds, _ = self._predictions(outputs, 'test', name)  # every process: collectives
        distributed.on_process_zero(
            lambda: glue.write_predictions(self._spec(name), examples, preds, out_dir),
            f'write the predictions for {name} to {out_dir}')
    if missing:
      logging.info('no test set for %s in %s: trained and evaluated; no predictions were '
                   'written for %s', ', '.join(missing), self.config.data_dir,
                   'it' if len(missing) == 1 else 'them')

  def dev_headline(self, dev) -> float:
    return finetune_metrics.headline(self._spec(self.name), dev[self.name])

  def headline_metric(self) -> str:
    return glue.get_task(self._spec(self.name)).metric
