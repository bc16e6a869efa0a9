"""GLUE: the nine tasks and the AX diagnostic, read from the official TSV files or tfds, and
tokenised as BERT pairs ([CLS] A [SEP] B [SEP]) with the pretraining run's tokenizer.

The official TSVs (https://gluebenchmark.com/tasks, unpacked as <data_dir>/<Task>/*.tsv) are
read by column name (CoLA's train/dev have no header), without quote handling, as GLUE's
own files need. tfds (`glue/<task>`) is the other source: its labels use the same order as
each Task's `labels` in TASKS below. Hugging Face datasets (`hf:nyu-mll/glue`, or a local copy) are the third, with
tfds's configs, columns and label order. Test labels are unknown (None); test predictions are written in the submission
format: <Task>.tsv with `index<TAB>prediction` and label names for classification.
"""

import csv
import dataclasses
import io
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from absl import logging

from data import sources
from realformer import storage


class Task(NamedTuple):
  name: str                  # official directory / submission name
  text: Tuple[str, ...]      # TSV columns of sentence A (and B)
  label: str                 # TSV label column
  labels: Tuple[str, ...]    # label names in id order (() = regression)
  metric: str                # the headline: one of CLASSIFICATION_METRICS (or, for a
                             # regression, REGRESSION_METRICS); finetune/metrics.py computes it
  splits: Dict[str, str]     # our split -> TSV file stem
  tfds_text: Tuple[str, ...]
  tfds_splits: Dict[str, str]


_STD = {'train': 'train', 'dev': 'dev', 'test': 'test'}
_TFDS = {'train': 'train', 'dev': 'validation', 'test': 'test'}
_NLI = ('entailment', 'not_entailment')
TASKS = {
    'cola': Task('CoLA', ('sentence',), 'label', ('0', '1'), 'mcc', _STD, ('sentence',), _TFDS),
    'sst2': Task('SST-2', ('sentence',), 'label', ('0', '1'), 'accuracy', _STD,
                 ('sentence',), _TFDS),
    'mrpc': Task('MRPC', ('#1 String', '#2 String'), 'Quality', ('0', '1'), 'f1', _STD,
                 ('sentence1', 'sentence2'), _TFDS),
    'stsb': Task('STS-B', ('sentence1', 'sentence2'), 'score', (), 'spearman', _STD,
                 ('sentence1', 'sentence2'), _TFDS),
    'qqp': Task('QQP', ('question1', 'question2'), 'is_duplicate', ('0', '1'), 'f1', _STD,
                ('question1', 'question2'), _TFDS),
    'mnli': Task('MNLI-m', ('sentence1', 'sentence2'), 'gold_label',
                 ('entailment', 'neutral', 'contradiction'), 'accuracy',
                 {'train': 'train', 'dev': 'dev_matched', 'test': 'test_matched'},
                 ('premise', 'hypothesis'),
                 {'train': 'train', 'dev': 'validation_matched', 'test': 'test_matched'}),
    'mnli_mismatched': Task('MNLI-mm', ('sentence1', 'sentence2'), 'gold_label',
                            ('entailment', 'neutral', 'contradiction'), 'accuracy',
                            {'train': 'train', 'dev': 'dev_mismatched',
                             'test': 'test_mismatched'}, ('premise', 'hypothesis'),
                            {'train': 'train', 'dev': 'validation_mismatched',
                             'test': 'test_mismatched'}),
    'qnli': Task('QNLI', ('question', 'sentence'), 'label', _NLI, 'accuracy', _STD,
                 ('question', 'sentence'), _TFDS),
    'rte': Task('RTE', ('sentence1', 'sentence2'), 'label', _NLI, 'accuracy', _STD,
                ('sentence1', 'sentence2'), _TFDS),
    'wnli': Task('WNLI', ('sentence1', 'sentence2'), 'label', ('0', '1'), 'accuracy', _STD,
                 ('sentence1', 'sentence2'), _TFDS),
    # The diagnostic: test only, predicted by the MNLI model.
    'ax': Task('AX', ('sentence1', 'sentence2'), '', ('entailment', 'neutral', 'contradiction'),
               'accuracy', {'test': 'diagnostic'}, ('premise', 'hypothesis'), {'test': 'test'}),
}
# The files of a GLUE benchmark submission (gluebenchmark.com takes one zip of all eleven),
# by the training task whose run writes them: MNLI's run predicts mismatched and AX too.
SUBMISSION = {t: (TASKS[t].name,) for t in ('cola', 'sst2', 'mrpc', 'stsb', 'qqp', 'qnli',
                                            'rte', 'wnli')}
SUBMISSION['mnli'] = tuple(TASKS[t].name for t in ('mnli', 'mnli_mismatched', 'ax'))
# Folders of the official download (download_glue_data.py layout).
FOLDERS = {'cola': 'CoLA', 'sst2': 'SST-2', 'mrpc': 'MRPC', 'stsb': 'STS-B', 'qqp': 'QQP',
           'mnli': 'MNLI', 'mnli_mismatched': 'MNLI', 'qnli': 'QNLI', 'rte': 'RTE',
           'wnli': 'WNLI', 'ax': 'diagnostic'}


@dataclasses.dataclass
class Example:
  guid: str
  text_a: str
  text_b: Optional[str]
  label: Optional[float]  # class id, regression score, or None (test)


def get_task(name) -> Task:
  """A GLUE task by name (a Task, e.g. local_task's, is returned as it is)."""
  if isinstance(name, Task):
    return name
  if name not in TASKS:
    raise ValueError(f'unknown GLUE task {name!r}; choose one of {", ".join(TASKS)}')
  return TASKS[name]


# A task's headline metric: accuracy, mcc, f1 (of the second label), macro_f1 for classes;
# pearson, spearman for a regression (realformer/finetune/metrics.py computes them).
CLASSIFICATION_METRICS = ('accuracy', 'mcc', 'f1', 'macro_f1')
REGRESSION_METRICS = ('pearson', 'spearman')


def local_task(name: str, text: Sequence[str], label: str, labels: Sequence[str],
               metric: str) -> Task:
  """A classification (or, without labels, regression) task of your own in GLUE's shape:
  <data_dir>/{train,dev[,test]}.tsv with a header row naming the `text` columns (one or
  two: a single sentence or a pair) and the `label` column (labels: its values in id order;
  none: a number to predict). Predictions go to <name>.tsv (index<TAB>prediction)."""
  text, labels = tuple(c.strip() for c in text if c.strip()), tuple(labels)
  where = f'task {name!r}'
  if len(text) not in (1, 2):
    raise ValueError(f'{where}: give one or two text columns (a sentence, or a pair), not '
                     f'{len(text)}')
  if not label:
    raise ValueError(f'{where}: name the label column')
  if len(set(labels)) != len(labels) or len(labels) == 1:
    raise ValueError(f'{where}: labels {list(labels)} must be two or more distinct values '
                     '(none for a regression)')
  allowed = CLASSIFICATION_METRICS if labels else REGRESSION_METRICS
  if metric not in allowed or (metric == 'f1' and len(labels) != 2):
    raise ValueError(f'{where}: metric {metric!r}; choose one of {", ".join(allowed)}' +
                     (' (f1 is of two labels: use macro_f1)' if metric == 'f1' else ''))
  return Task(name, text, label, labels, metric, dict(_STD), (), {})


def label_value(task: Task, raw: str, where: str = '') -> float:
  """A row's label as the model's target: its id in task.labels, or a regression's number;
  a one-line error (prefixed by `where`, a file and line) for one the task does not have."""
  if not task.labels:
    try:
      return float(raw)
    except ValueError:
      raise ValueError(f'{where}{task.name}: label {raw!r} is not a number') from None
  if raw not in task.labels:
    fix = ('give the task its file\'s label values in id order (its labels: config.tsv.labels '
           'for a tsv/<name> task), or fix the row' if not task.tfds_text else  # (local_task's)
           'fix the row (is the file the task\'s own?)')
    raise ValueError(f'{where}{task.name}: label {raw!r} is not one of {task.labels}; {fix}')
  return task.labels.index(raw)


def read_tsv(task_name, data_dir: str, split: str,
             skip_malformed: bool = False) -> List[Example]:
  """Examples of one split from the official GLUE TSV files under data_dir/<Task>/ (of a
  local_task: <data_dir>/<split>.tsv).

  A row with too few columns is an error naming the file and line; with skip_malformed
  such rows are skipped, counted and reported (GLUE's own QQP and MNLI files hold a few;
  fine-tuning skips training rows only).
  A bad label is an error naming the file and line.
  """
  task = get_task(task_name)
  official = isinstance(task_name, str)  # a GLUE task, in its folder of the download
  if split not in task.splits:
    raise ValueError(f'{task.name} has no {split} split (it has {", ".join(task.splits)})')
  folder = f'{str(data_dir).rstrip("/")}' + (f'/{FOLDERS[task_name]}' if official else '')
  path = f'{folder}/{task.splits[split]}.tsv'
  if not storage.path(path).exists():
    raise FileNotFoundError(
        f'{path} not found; set config.data_dir to the directory holding ' +
        ('the GLUE task folders (CoLA/, SST-2/, ...) or use tfds' if official else
         f'{task.name}\'s train.tsv and dev.tsv (test.tsv optional)'))
  csv.field_size_limit(sys.maxsize)
  try:
    text = storage.path(path).read_bytes().decode('utf-8-sig')
    rows = list(csv.reader(io.StringIO(text, newline=''), delimiter='\t',
                           quoting=csv.QUOTE_NONE))
  except UnicodeDecodeError as e:
    raise ValueError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to '
                     f'UTF-8') from None
  if not rows:
    raise ValueError(f'{path} is empty; is it the {task.name} file?')
  skipped = []

  def usable(row, line, width, names) -> bool:
    if len(row) >= width:
      return True
    if not row:  # a blank line (a file's last ones, often): no example, as HF's loader reads
      return False
    if not skip_malformed:
      how = ('fix the row, or set config.skip_malformed_rows=True to skip such rows'
             if split == 'train' else 'fix the row (config.skip_malformed_rows skips training '
             'rows only: a dev score or a test submission without the row would be wrong)')
      raise ValueError(f'{path}:{line}: {len(row)} columns where {width} are expected '
                       f'({names}); {how}')
    skipped.append(line)
    return False

  examples = []
  if official and task_name == 'cola' and split != 'test':  # source, label, mark, sentence
    for i, r in enumerate(rows):
      if usable(r, i + 1, 4, 'source, label, mark, sentence'):
        examples.append(Example(f'{split}-{i}', r[3], None,
                                label_value(task, r[1], f'{path}:{i + 1}: ')))
  else:
    header = [h.strip().lstrip('\ufeff') for h in rows[0]]
    col = {h: i for i, h in enumerate(header)}
    needed = list(task.text) + ([task.label] if split != 'test' and task.label else [])
    missing = [c for c in needed if c not in col]
    if missing:
      raise ValueError(f'{path}: columns {missing} missing (header {header}); is it the '
                       f'{task.name} file?')
    for i, r in enumerate(rows[1:]):
      line = i + 2
      if not usable(r, line, len(header), ', '.join(header)):
        continue
      a = r[col[task.text[0]]]
      b = r[col[task.text[1]]] if len(task.text) > 1 else None
      guid = r[col['index']] if 'index' in col else r[col['id']] if 'id' in col else str(i)
      label = None
      if split != 'test' and task.label:
        label = label_value(task, r[col[task.label]], f'{path}:{line}: ')
      examples.append(Example(guid, a, b, label))
  if skipped:
    logging.warning('skipped %d malformed rows of %s (lines %s%s)', len(skipped), path,
                    ', '.join(map(str, skipped[:5])), ', ...' if len(skipped) > 5 else '')
  if not examples:
    what = 'every row was malformed and skipped' if skipped else 'no rows below the header'
    fix = ('; remove the file to train and evaluate without predictions' if split == 'test'
           else '')
    raise ValueError(f'{path} holds no examples ({what}); is it the {task.name} file?{fix}')
  return examples


_TFDS_OFFLINE = ('pass config.data_dir=<a folder with the task\'s official TSV files> or '
                 'hf:<a local copy of nyu-mll/glue>')


def _tfds_name(task_name: str) -> str:
  return 'glue/' + ('mnli' if task_name == 'mnli_mismatched' else task_name)


def prepare_tfds(task_name: str, data_dir: Optional[str] = None) -> None:
  """Downloads and prepares tfds glue/<task> where it is not yet (sources.prepare_tfds_task)."""
  sources.prepare_tfds_task(_tfds_name(task_name), data_dir, _TFDS_OFFLINE)


def read_tfds(task_name: str, split: str, data_dir: Optional[str] = None) -> List[Example]:
  """Examples of one split of tfds glue/<task> (needs network or a prepared data_dir)."""
  task = get_task(task_name)
  examples = []
  for ex in sources.load_tfds_task(_tfds_name(task_name), task.tfds_splits[split], data_dir,
                                   offline=_TFDS_OFFLINE):
    text = [ex[k].decode('utf-8') for k in task.tfds_text]
    label = None if split == 'test' else float(ex['label'])
    examples.append(Example(str(int(ex['idx'])), text[0], text[1] if len(text) > 1 else None,
                            label))
  return examples


def read_hf(task_name: str, split: str, dataset: str = 'nyu-mll/glue') -> List[Example]:
  """Examples of one split from a Hugging Face GLUE dataset (`config.data_dir=hf:<dataset>`:
  the hub's nyu-mll/glue, or a local copy in its layout: <dir>/<task>/<split>-*.parquet).
  Its configs, splits, columns and label order are tfds's."""
  from data import sources  # pylint: disable=g-import-not-at-top
  task = get_task(task_name)
  dataset = dataset or 'nyu-mll/glue'
  config = 'mnli' if task_name == 'mnli_mismatched' else task_name
  ds = sources.load_hf(dataset, config, task.tfds_splits[split], streaming=False,
                       what='config.data_dir')
  missing = [c for c in task.tfds_text + ('label', 'idx') if c not in ds.column_names]
  if missing:
    raise ValueError(f'hf:{dataset} {config}/{task.tfds_splits[split]} has no columns '
                     f'{missing} (it has {ds.column_names}); is it GLUE in nyu-mll/glue\'s '
                     'layout?')
  examples = []
  for row in ds:
    text = [row[k] for k in task.tfds_text]
    label = None if split == 'test' else float(row['label'])
    examples.append(Example(str(row['idx']), text[0], text[1] if len(text) > 1 else None,
                            label))
  return examples


def truncate_pair(a: List[int], b: List[int], max_tokens: int):
  """BERT's _truncate_seq_pair: drop from the end of the longer one, in place."""
  while len(a) + len(b) > max_tokens:
    (a if len(a) > len(b) else b).pop()


def featurize(examples: Sequence[Example], tokenizer, max_seq_length: int,
              regression: bool = False) -> Dict[str, np.ndarray]:
  """[CLS] A [SEP] (B [SEP]) -> input_ids, segment_ids, attention_mask, label arrays. As in
  BERT's run_classifier, an example is a pair only where B has tokens: an empty (or
  all-whitespace) second text makes a single sentence, not [CLS] A [SEP] [SEP]."""
  n = len(examples)
  ids = np.full((n, max_seq_length), tokenizer.pad_id, np.int32)
  seg = np.zeros((n, max_seq_length), np.int32)
  mask = np.zeros((n, max_seq_length), np.int32)
  encoded_a = tokenizer.encode_batch([ex.text_a for ex in examples])
  encoded_b = iter(tokenizer.encode_batch([ex.text_b for ex in examples if ex.text_b]))
  for i, ex in enumerate(examples):
    a = encoded_a[i]
    b = next(encoded_b) if ex.text_b else []
    truncate_pair(a, b, max_seq_length - (3 if b else 2))
    tokens = [tokenizer.cls_id] + a + [tokenizer.sep_id]
    segments = [0] * len(tokens)
    if b:
      tokens += b + [tokenizer.sep_id]
      segments += [1] * (len(b) + 1)
    ids[i, :len(tokens)] = tokens
    seg[i, :len(tokens)] = segments
    mask[i, :len(tokens)] = 1
  labels = np.array([np.nan if ex.label is None else ex.label for ex in examples],
                    np.float32 if regression else np.float64)
  if not regression:
    labels = np.where(np.isnan(labels), -1, labels).astype(np.int32)
  return {'input_ids': ids, 'segment_ids': seg, 'attention_mask': mask, 'label': labels}


def write_predictions(task_name, examples: Sequence[Example], predictions: np.ndarray,
                      out_dir: str) -> str:
  """<out_dir>/<Task>.tsv in GLUE's submission format: each row named by its example's guid
  (the test file's index or id column, tfds's and Hugging Face's idx; else its row)."""
  task = get_task(task_name)
  lines = ['index\tprediction\n']
  for ex, p in zip(examples, predictions):
    value = (f'{float(p):.3f}' if not task.labels else task.labels[int(p)])
    lines.append(f'{ex.guid}\t{value}\n')
  return str(storage.write_text(f'{str(out_dir).rstrip("/")}/{task.name}.tsv', ''.join(lines)))


def write_dev_scores(task_name, examples: Sequence[Example], logits: np.ndarray,
                     out_dir: str) -> str:
  """<out_dir>/dev/<Task>.tsv, for error analysis: each dev example's index (as
  write_predictions names it), its label, the prediction, and the model's raw scores (a
  classification's logit of each label, in id order, named `logit_<label>`; a regression's
  prediction is its score)."""
  task = get_task(task_name)
  name = lambda v: f'{float(v):.6g}' if not task.labels else task.labels[int(v)]
  head = ['index', 'label', 'prediction'] + [f'logit_{l}' for l in task.labels]
  lines = ['\t'.join(head) + '\n']
  for ex, row in zip(examples, np.asarray(logits, np.float64)):
    pred = row.argmax() if task.labels else row[0]
    scores = [f'{x:.6g}' for x in row] if task.labels else []
    lines.append('\t'.join([ex.guid, name(ex.label), name(pred)] + scores) + '\n')
  return str(storage.write_text(f'{str(out_dir).rstrip("/")}/dev/{task.name}.tsv',
                                ''.join(lines)))


def write_sst2_layout(out_dir: str, train: Sequence[Tuple[str, int]],
                      dev: Sequence[Tuple[str, int]]) -> str:
  """(sentence, label) pairs as <out_dir>/SST-2/{train,dev}.tsv in GLUE's layout, and the dev
  sentences again as an unlabelled test.tsv, so finetune.py also writes predictions for them
  (whitespace inside a sentence becomes single spaces). Returns out_dir."""
  folder = os.path.join(out_dir, FOLDERS['sst2'])
  os.makedirs(folder, exist_ok=True)
  clean = lambda s: ' '.join(s.split())
  for name, rows in (('train', train), ('dev', dev)):
    with open(os.path.join(folder, f'{name}.tsv'), 'w', encoding='utf-8') as f:
      f.write('sentence\tlabel\n')
      f.writelines(f'{clean(s)}\t{y}\n' for s, y in rows)
  with open(os.path.join(folder, 'test.tsv'), 'w', encoding='utf-8') as f:
    f.write('index\tsentence\n')
    f.writelines(f'{i}\t{clean(s)}\n' for i, (s, _) in enumerate(dev))
  return out_dir
