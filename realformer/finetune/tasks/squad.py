"""SQuAD fine-tuning (Rajpurkar et al. 2016, 2018), `configs/finetune.py:squad/v1.1` and
`squad/v2.0`: windows over the paragraphs, a span head, n-best post-processing and the
official v1.1 / v2.0 metrics, as a FinetuneTask.

Data: config.data_dir holds {train,dev}-v1.1.json or -v2.0.json, or `hf:<dataset>` reads
Hugging Face's copy, or empty reads tfds squad. SQuAD's test sets are hidden: the prediction
files are of dev (predictions/predictions.json; for v2.0 also null_odds.json and
predictions_raw.json, the answers before the null threshold, with which the official script
reproduces best_exact and best_f1).
"""

import json
from typing import Dict, Tuple

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from data import squad
from realformer import models
from realformer import storage
from realformer.finetune import metrics as finetune_metrics
from realformer.finetune.registry import register
from realformer.finetune.task import FinetuneTask
from realformer.train import distributed


@register('squad')
class SquadTask(FinetuneTask):
  """SQuAD v1.1 or v2.0: span head, windows, n-best post-processing, official metrics."""
  token_outputs = True  # start and end logits per position
  hf_architecture = 'BertForQuestionAnswering'

  @classmethod
  def configure(cls, config: ml_collections.ConfigDict, name: str) -> None:
    """BERT's run_squad settings (its README's lr 3e-5 and 2 epochs; the batch stays 32,
    where the README used 12 or 24): max_seq_length 384, doc_stride 128,
    max_query_length 64, n_best_size 20, max_answer_length 30; v2.0's null-score threshold
    tuned on dev (best F1) unless null_score_diff_threshold is set."""
    if name not in cls.names():
      raise ValueError(f"config arg 'squad/{name}': SQuAD versions are v1.1 and v2.0")
    config.max_seq_length, config.num_epochs = 384, 2
    config.optimizer.learning_rate = 3e-5
    config.doc_stride = 128
    config.max_query_length = 64
    config.n_best_size = 20
    config.max_answer_length = 30
    config.null_score_diff_threshold = ml_collections.FieldReference(None, field_type=float)

  @classmethod
  def names(cls) -> Tuple[str, ...]:
    return ('v1.1', 'v2.0')

  def load(self, tokenizer):
    config, self.tokenizer = self.config, tokenizer
    self.version_2 = config.task == 'v2.0'
    self.name = f'squad/{config.task}'
    self.featurize = lambda examples, training: squad.featurize(
        examples, tokenizer, max_seq_length=config.max_seq_length,
        doc_stride=config.doc_stride, max_query_length=config.max_query_length,
        training=training, infos=not training)
    train = self._load('train')
    self.dev = self._load('dev')
    if not self.version_2:
      for split, examples in (('train', train), ('dev', self.dev)):
        unanswerable = sum(ex.is_impossible for ex in examples)
        if unanswerable:
          raise ValueError(f'squad/v1.1: {unanswerable} {split} questions have no answer '
                           '(SQuAD 2.0 data?); use configs/finetune.py:squad/v2.0')
    self.train, _ = self.featurize(train, True)
    self.dev_features, self.dev_infos = self.featurize(self.dev, False)
    self.answers = None  # dev answers of the last evaluation, for the prediction file

  def download(self) -> None:
    if not self.config.data_dir:  # tfds squad/<version>
      squad.prepare_tfds(self.config.task, self.config.tfds_data_dir)

  def _load(self, split: str):
    if self.config.data_dir.startswith('hf:'):
      return squad.read_hf(self.config.task, 'train' if split == 'train' else 'validation',
                           self.config.data_dir[len('hf:'):])
    if self.config.data_dir:
      name = f'{split}-{self.config.task}.json'
      return squad.read_json(f'{self.config.data_dir.rstrip("/")}/{name}')
    return squad.read_tfds(self.config.task, 'train' if split == 'train' else 'validation',
                           self.config.tfds_data_dir)

  def build(self, spec):
    return models.build(spec, head='span')

  def head_flops(self, length: int) -> float:
    return 2 * length * self.spec.hidden_size * 2  # start and end logits of every token

  def loss_fn(self, model):
    """Mean of the start and end cross-entropies (targets at [CLS] when no answer)."""
    def loss_fn(params, batch, rng, totals):
      deterministic = rng is None
      _, start, end = model.apply({'params': params}, batch, deterministic=deterministic,
                                  rngs=None if deterministic else {'dropout': rng})
      ce = optax.softmax_cross_entropy_with_integer_labels
      per_example = (ce(start, batch['start_positions']) +
                     ce(end, batch['end_positions'])) / 2
      return jnp.sum(per_example) / totals['examples'], {}
    return loss_fn

  def eval_features(self):
    return [self.dev_features]

  def evaluate_outputs(self, outputs) -> Dict[str, Dict[str, float]]:
    # Padding positions never compete for the n best starts and ends (BERT's run_squad
    # lets them, then drops them: fewer real candidates, and answers that would depend on
    # how far a batch is padded).
    padding = self.dev_features['attention_mask'] == 0
    start, end = (np.where(padding, -np.inf, logits) for logits in outputs(self.dev_features))
    c = self.config
    answers, null_diff = squad.postprocess(
        self.dev, self.dev_infos, self.dev_features, start, end, self.tokenizer,
        n_best_size=c.n_best_size, max_answer_length=c.max_answer_length,
        version_2=self.version_2)
    golds = {ex.qid: ex.answers for ex in self.dev}
    self.raw_answers = answers
    if not self.version_2:
      self.answers, self.null_diff = answers, {}
      return {'squad': finetune_metrics.squad_v1(golds, answers)}
    # best_exact/best_f1: the official script's sweep of the null threshold over the raw
    # answers (tuned on dev, as BERT reports v2.0); exact, f1 and their HasAns/NoAns parts:
    # the answers written to predictions.json, null where null_diff exceeds the threshold
    # (null_score_diff_threshold, else best_f1's), as the script scores that file.
    swept = finetune_metrics.squad_v2(golds, answers, null_diff)
    threshold = c.null_score_diff_threshold
    if threshold is None:
      threshold = swept['best_f1_thresh']
    self.answers = squad.apply_null_threshold(answers, null_diff, threshold)
    self.null_diff = null_diff
    metrics = finetune_metrics.squad_v2(golds, self.answers)
    metrics.update({k: v for k, v in swept.items() if k.startswith('best_')},
                   null_score_diff_threshold=float(threshold))
    return {'squad': metrics}

  def write_predictions(self, outputs, results, out_dir: str):
    del outputs, results  # SQuAD's test sets are hidden: the dev answers are written

    def write():
      storage.write_text(f'{out_dir}/predictions.json', json.dumps(self.answers, indent=1))
      if self.version_2:  # (evaluate-v2.0.py dev.json predictions_raw.json --na-prob-file
        # null_odds.json: best_exact, best_f1 and their thresholds, as results.json's)
        storage.write_text(f'{out_dir}/null_odds.json', json.dumps(self.null_diff, indent=1))
        storage.write_text(f'{out_dir}/predictions_raw.json',
                           json.dumps(self.raw_answers, indent=1))
    distributed.on_process_zero(write, f'write the predictions to {out_dir}')

  def dev_headline(self, dev) -> float:
    """v2.0 with a null_score_diff_threshold given: the f1 of the answers written with it
    (not the sweep's best_f1, which tunes the threshold on dev)."""
    return dev['squad'][self.headline_metric()]

  def headline_metric(self) -> str:
    if self.version_2 and self.config.null_score_diff_threshold is not None:
      return 'f1'
    return finetune_metrics.SQUAD_HEADLINE[self.name]
