"""Named-entity recognition, `configs/finetune.py:ner/conll2003` (CoNLL-2003, Tjong Kim Sang
and De Meulder 2003; the BERT paper's section 5.3) or `ner/<name>` for one's own data in its
format: a tag per word, read at the word's first piece (data/conll.py), the entity scores of
conlleval.pl, as a FinetuneTask.

Data: config.data_dir holds train.txt, dev.txt and optionally test.txt (or their other names:
valid.txt, or the original eng.train, eng.testa and eng.testb). Its own fields: ner.labels,
the tags in id order (BIO; CoNLL-2003's nine by default), and ner.document_context: False
fine-tunes on sentences alone, as transformers' run_ner does; True gives each sentence the
rest of its sequence from its document's sentences around it (the documents that -DOCSTART-
lines separate), as the paper's CoNLL-2003 runs did, its own words alone labelled. The test
set's tags are public, so it is scored beside dev at every evaluation (dev alone picks best/
and the grid's setting). Prediction files: predictions/dev.txt and test.txt, conlleval.pl's
input (word, gold tag, predicted tag).
"""

import collections
from typing import Dict, Tuple

import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from data import buckets as buckets_lib
from data import conll
from realformer import models
from realformer.finetune import metrics as finetune_metrics
from realformer.finetune.registry import register
from realformer.finetune.task import FinetuneTask
from realformer.train import distributed


def _labels(config) -> Tuple[str, ...]:
  return tuple(t.strip() for t in config.ner.labels.split(',') if t.strip())


@register('ner')
class NerTask(FinetuneTask):
  """A linear layer on every token's hidden state (its first piece's, for a word), trained
  by the cross-entropy of the words' tags; entity F1 on dev (and test)."""
  token_outputs = True  # logits per token
  hf_architecture = 'BertForTokenClassification'
  sequence_keys = buckets_lib.SEQUENCE_KEYS + ('labels',)  # per token, cut with the inputs
  takes_any_name = True  # ner/<name>: tags of one's own (names(): what --tasks ner runs)

  @classmethod
  def configure(cls, config: ml_collections.ConfigDict, name: str) -> None:
    """transformers' run_ner settings: lr 5e-5, 3 epochs, batch 32, 128 pieces, and its
    random batches (BENCHMARKS.md, "NER against transformers": batches of one bucket's
    sentences cost about 0.05 dev F1 against random ones, 3 seeds of each), each padded to
    the shortest of a few lengths that holds its longest sentence, as transformers pads a
    batch to its longest (--config.group_by_length=True pads least, at that cost)."""
    del name  # any name: conll2003, or data of one's own
    config.optimizer.learning_rate = 5e-5
    config.group_by_length = False
    config.ner = ml_collections.ConfigDict({'labels': ','.join(conll.CONLL2003_LABELS),
                                            'document_context': False})

  @classmethod
  def names(cls) -> Tuple[str, ...]:
    return ('conll2003',)

  @classmethod
  def checked_config(cls, config, mesh):
    config = super().checked_config(config, mesh)
    try:
      conll.check_labels(_labels(config))
    except ValueError as e:
      raise ValueError(f'config.ner.labels: {e}') from None
    if not config.data_dir:
      raise ValueError(f'ner/{config.task}: set config.data_dir to the folder of its train.txt '
                       'and dev.txt (test.txt optional), CoNLL-2003\'s format: a word and its '
                       'tag per line')
    return config

  def load(self, tokenizer):
    config = self.config
    self.name, self.labels = config.task, _labels(config)
    self.sets = {}  # split -> (sentences, features, each sentence's labelled words)
    for split in ('train', 'dev', 'test'):
      try:
        path = conll.split_file(config.data_dir, split)
      except FileNotFoundError:
        if split == 'test':
          continue
        raise
      sentences = conll.read(path)
      ids = conll.label_ids(sentences, self.labels, path)
      entities = collections.Counter(c[0] for s in sentences for c in conll.chunks(s.tags))
      documents = len({s.document for s in sentences})
      logging.info('%s: %s, %d sentences in %d document%s, %d words; entities %s', split,
                   path, len(sentences), documents, 's' * (documents != 1),
                   sum(len(s.words) for s in sentences),
                   ', '.join(f'{k} {n}' for k, n in sorted(entities.items())) or 'none')
      if config.ner.document_context and documents == 1 < len(sentences):
        logging.warning('%s holds no -DOCSTART- line between its sentences: with '
                        'config.ner.document_context the whole file is one document, and a '
                        'sentence\'s context is whatever sentences stand beside it', path)
      features, placed, unplaced = conll.featurize(
          sentences, ids, tokenizer, config.max_seq_length, config.ner.document_context)
      if unplaced:
        logging.warning('%d words of %s have no piece within max_seq_length=%d (cut off, or '
                        'characters the tokenizer drops): %s (raise config.max_seq_length)',
                        unplaced, path, config.max_seq_length,
                        'not trained on' if split == 'train' else 'predicted O')
      self.sets[split] = (sentences, features, placed)
    self.train = self.sets['train'][1]
    labelled = (self.train['labels'] != conll.IGNORE).sum(1)
    self.words_per_example = max(1.0, float(labelled.mean()))  # (totals' normaliser)
    self.predicted = {}  # split -> the last evaluation's tags, for the prediction files

  def build(self, spec):
    return models.build(spec, head='token_classification', num_labels=len(self.labels))

  def label_names(self):
    return self.labels

  def head_flops(self, length: int) -> float:
    return 2 * length * self.spec.hidden_size * len(self.labels)

  def totals(self, batch):
    """The step's examples, and the words it would hold at the training set's mean words
    per example: the loss's normaliser. Transformers' is the batch's own count of words,
    which over random batches is about that; over a length bucket's it is not (a batch of
    short sentences holds few words, and each would weigh several times one of a long
    sentence's), so a constant keeps every word's weight what random batches give it."""
    examples = jnp.asarray(batch['input_ids'].shape[0], jnp.float32)
    return {'examples': examples, 'words': examples * self.words_per_example}

  def loss_fn(self, model):
    """Cross-entropy of each word's tag at its first piece, summed over the step's words,
    over totals' `words`: a mean per word where the step holds the mean number of them."""
    def loss_fn(params, batch, rng, totals):
      deterministic = rng is None
      _, logits = model.apply({'params': params}, batch, deterministic=deterministic,
                              rngs=None if deterministic else {'dropout': rng})
      labels = batch['labels']
      labelled = labels != conll.IGNORE
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(labelled, labels, 0))
      return jnp.sum(jnp.where(labelled, ce, 0.0)) / totals['words'], {}
    return loss_fn

  def eval_features(self):
    return [features for split, (_, features, _) in self.sets.items() if split != 'train']

  def _scores(self, outputs, split: str) -> Dict[str, Dict[str, float]]:
    if split not in self.sets:
      return {}
    sentences, features, placed = self.sets[split]
    (logits,) = outputs(features)
    self.predicted[split] = conll.word_tags(logits, placed, sentences, self.labels)
    return {self.name: finetune_metrics.entity_scores([s.tags for s in sentences],
                                                      self.predicted[split])}

  def evaluate_outputs(self, outputs) -> Dict[str, Dict[str, float]]:
    return self._scores(outputs, 'dev')

  def evaluate_tests(self, outputs) -> Dict[str, Dict[str, float]]:
    return self._scores(outputs, 'test')

  def write_predictions(self, outputs, results, out_dir: str):
    del outputs, results  # the tags of the evaluation just made, with the final params

    def write():
      for split, tags in self.predicted.items():
        conll.write_predictions(f'{out_dir}/{split}.txt', self.sets[split][0], tags)
    distributed.on_process_zero(write, f'write the predictions to {out_dir}')

  def dev_headline(self, dev) -> float:
    return dev[self.name]['f1']

  def headline_metric(self) -> str:
    return 'f1'
