r"""Fine-tune a pretrained encoder on a GLUE task or SQuAD; evaluate on dev; write predictions.

  python finetune.py --config configs/finetune.py:glue/rte --workdir /tmp/ft_rte \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/glue
  python finetune.py --config configs/finetune.py:squad/v2.0 --workdir /tmp/ft_squad2 \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/squad

The encoder is restored from the newest checkpoint of `init_checkpoint` (only the encoder:
the pretraining heads and optimizer are not read); a checkpoint whose architecture or
vocabulary does not match its config.json is an error naming the parameter. The run is
resumable: its resume checkpoint (written each epoch) is in <workdir>/checkpoints and running
the same command again continues. Checkpoints are lean: <workdir>/best holds the params of the
best dev epoch, and a finished run keeps only its params in <workdir>/final, without the
optimizer state (config.keep_best, config.keep_optimizer_state); both are params-only
checkpoints with the pretraining config.json, usable as another run's init_checkpoint.
Batches are padded to a few length buckets chosen from the data, not to max_seq_length
(data/buckets.py; config.length_buckets=0 turns it off). Outputs: metrics.jsonl (train loss,
throughput, dev metrics per epoch), results.json (the final and the best dev metrics) and
predictions/<Task>.tsv (GLUE submission format, from the final params; SQuAD:
predictions/predictions.json of dev, plus null_odds.json for v2.0).
The grid of the paper's practice: `python -m realformer.finetune_grid` (see its docstring).
"""

import datetime
import json
import os
import shutil
import time
from typing import Dict, Tuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app
from absl import flags
from absl import logging
from clu import metric_writers
from clu import metrics as clu_metrics
from ml_collections import config_flags

from data import buckets as buckets_lib
from data import glue
from data import sources
from data import squad
from data import tokenizer as tokenizer_lib
from realformer import checkpoints
from realformer import cli
from realformer import distributed
from realformer import finetune_metrics
from realformer import host_memory
from realformer import machine
from realformer import metrics as metrics_lib
from realformer import models
from realformer import partitioning
from realformer import train_lib
from realformer import workdir as workdir_lib

_REPO = os.path.dirname(os.path.abspath(__file__))
BEST_DIR = 'best'    # params of the best dev epoch (config.keep_best)
FINAL_DIR = 'final'  # params of a finished run (its optimizer state dropped)


@flax.struct.dataclass
class FinetuneMetrics(clu_metrics.Collection):
  loss: clu_metrics.Average
  learning_rate: clu_metrics.LastValue
  grad_norm: clu_metrics.Average


def pretrained_config(path: str, config=None) -> ml_collections.ConfigDict:
  """The pretraining config: a workdir's config.json, or, for a random-init baseline
  (from_scratch=True), a pretraining config file such as configs/pretrain.py:postln,tiny,
  with config.tokenizer (or that config's data.tokenizer) giving the vocabulary."""
  if not path:
    raise ValueError('config.init_checkpoint is empty: name the pretraining workdir (its '
                     'config.json gives the architecture and the tokenizer)')
  if path.partition(':')[0].endswith('.py'):
    if config is None or not config.from_scratch:
      raise ValueError(f'config.init_checkpoint={path!r} is a config file, which holds no '
                       f'weights: set config.from_scratch=True for a random-init baseline, '
                       f'or name a pretraining workdir')
    from realformer import sweep  # pylint: disable=g-import-not-at-top
    pre = sweep.load_config(path).copy_and_resolve_references()
    if config.get('tokenizer'):
      pre.data.tokenizer = config.tokenizer
    pre.model.vocab_size = tokenizer_lib.load_for_config(pre.data).vocab_size
    return pre
  return ml_collections.ConfigDict(checkpoints.read_pretraining_config(path))


def full_batch(batch: Dict[str, np.ndarray], mesh) -> Dict[str, jax.Array]:
  """A global batch that every host holds whole -> arrays sharded over (data, fsdp); each
  device takes its own rows (multi-host safe, whatever the device order)."""
  sharding = partitioning.batch_sharding(mesh)
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
          for k, v in batch.items()}


BUCKETS_FILE = 'length_buckets.json'


def length_buckets(config, task, workdir: str, resuming: bool,
                   mid_epoch: bool = False) -> Tuple[int, ...]:
  """The compiled sequence lengths: chosen from the training lengths, the longest covering
  every split; (max_seq_length,) when config.length_buckets is 0. Stored in the workdir with
  the settings that chose them: a resumed run with the same length_buckets and
  bucket_multiple keeps them (they shape the epoch's batches), whatever dev or test files
  changed. A change of either setting takes effect at an epoch's start; in mid-epoch it is
  an error (the rest of the epoch would be drawn from another plan)."""
  path = os.path.join(workdir, BUCKETS_FILE)
  settings = {'length_buckets': int(config.length_buckets),
              'bucket_multiple': int(config.bucket_multiple)}
  stored, stored_settings = None, None
  if resuming and os.path.isfile(path):
    with open(path) as f:
      saved = json.load(f)
    if isinstance(saved, list):  # written before the settings were stored with them
      stored = tuple(saved)
    else:
      stored, stored_settings = tuple(saved['lengths']), saved['settings']
  # Settings unknown (an older file): kept to finish an epoch, chosen again at the next.
  same = stored_settings == settings or (stored_settings is None and mid_epoch)
  kept = bool(config.length_buckets and stored and stored != (config.max_seq_length,) and same)
  if not config.length_buckets:
    chosen = (config.max_seq_length,)
  else:
    chosen = stored if kept else _choose_buckets(config, task)
  if mid_epoch and stored is not None and chosen != stored:
    raise ValueError(f'this run stopped in mid-epoch with length buckets {list(stored)}'
                     f'{f" ({stored_settings})" if stored_settings else ""}; resume with '
                     f'config.length_buckets and config.bucket_multiple as they were, and '
                     f'change them once the epoch is over')
  if jax.process_index() == 0:  # replaced whole: another host may be reading it
    with open(path + '.tmp', 'w') as f:
      json.dump({'lengths': list(chosen),
                 'settings': None if kept and stored_settings is None else settings}, f)
    os.replace(path + '.tmp', path)
  return chosen


def _longest_eval(task) -> int:
  """The longest example of the splits that are only evaluated (dev, test)."""
  return max((int(buckets_lib.lengths_of(f).max(initial=0)) for f in task.eval_features()),
             default=0)


def eval_lengths(config, task, buckets: Tuple[int, ...]) -> Tuple[int, ...]:
  """The lengths evaluation and predictions compile: the training buckets, and one more
  when a dev or test example is longer than the longest of them (buckets kept by a resumed
  run cover the splits as they were: a test.tsv added since, a dev file changed). The
  training batches keep the stored buckets, so an epoch's plan does not change."""
  longest = _longest_eval(task)
  if longest <= max(buckets):
    return buckets
  extra = min(config.max_seq_length, -(-longest // config.bucket_multiple) *
              config.bucket_multiple)
  logging.info('a dev/test example of %d tokens is longer than the stored length buckets %s: '
               'evaluation and predictions also compile length %d', longest, list(buckets),
               extra)
  return tuple(buckets) + (extra,)


def _choose_buckets(config, task) -> Tuple[int, ...]:
  lengths = buckets_lib.lengths_of(task.train)
  cover = _longest_eval(task)
  chosen = buckets_lib.choose_lengths(lengths, config.length_buckets, config.bucket_multiple,
                                      config.max_seq_length, cover=cover)
  logging.info('%s (config.length_buckets=0 pads every batch to max_seq_length)',
               buckets_lib.describe(lengths, chosen, config.max_seq_length))
  return chosen


def compile_lengths(step, args, batch_of_length, buckets, name: str) -> dict:
  """{length: `step` compiled for a batch of that length}, every length up front, so the
  log says what compiles and no step of the run waits for a compilation. (Compiling them in
  parallel threads was no faster on CPU: XLA's compiler already uses the cores.)"""
  start = time.time()
  compiled = {length: step.lower(*args, batch_of_length(length)).compile()
              for length in buckets}
  logging.info('compiled the %s for %d lengths (%s) in %.1f s', name, len(buckets),
               ', '.join(map(str, buckets)), time.time() - start)
  return compiled


def run_model(predict, params, features, *, batch_size: int, buckets, mesh,
              token_outputs: bool) -> Tuple[np.ndarray, ...]:
  """`predict`'s outputs for every row of `features`, in order: batches within each length
  bucket; per-token outputs padded back to max_seq_length with -inf."""
  n, max_len = features['input_ids'].shape
  lengths = buckets_lib.lengths_of(features)
  outs = None
  for length, idx, valid in buckets_lib.eval_batches(lengths, buckets, batch_size):
    inputs = {k: features[k] for k in buckets_lib.SEQUENCE_KEYS}
    out = predict(params, full_batch(buckets_lib.take(inputs, idx, length), mesh))
    out = [np.asarray(o)[valid] for o in out]
    if token_outputs:
      out = [np.pad(o, ((0, 0), (0, max_len - length)), constant_values=-np.inf) for o in out]
    if outs is None:
      outs = [np.empty((n,) + o.shape[1:], o.dtype) for o in out]
    for full, o in zip(outs, out):
      full[idx[valid]] = o
  return tuple(outs)


# ------------------------------------------------------------------------------ tasks
# A task gives the head, the training features, the loss, the dev evaluation and the
# prediction files; `run_model(params, features)` returns the head's outputs for every row.


class GlueTask:
  """One GLUE task (mnli also evaluates mismatched dev and predicts AX)."""
  token_outputs = False  # the head's outputs are per example

  def __init__(self, config, tokenizer):
    self.config, self.name = config, config.task
    if config.task in ('ax', 'mnli_mismatched'):
      raise ValueError(f'{config.task} has no training set: fine-tune glue/mnli, which also '
                       'evaluates mismatched dev and predicts AX')
    self.task = glue.get_task(config.task)
    self.regression = not self.task.labels
    self.featurize = lambda ex: glue.featurize(ex, tokenizer, config.max_seq_length,
                                               self.regression)
    self.train = self.featurize(self._load(config.task, 'train'))
    self.evals = {config.task: self._load(config.task, 'dev')}
    # GLUE's test sets are optional: without test.tsv the run trains and evaluates only.
    self.tests = {config.task: self._load_test(config.task)}
    if config.task == 'mnli':
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

  def _load(self, task: str, split: str):
    if self.config.data_dir.startswith('hf:'):
      return glue.read_hf(task, split, self.config.data_dir[len('hf:'):])
    if self.config.data_dir:
      return glue.read_tsv(task, self.config.data_dir, split,
                           skip_malformed=self.config.skip_malformed_rows)
    return glue.read_tfds(task, split, self.config.tfds_data_dir)

  def build(self, model_config):
    return models.build(model_config, head='classification',
                        num_labels=len(self.task.labels) or 1)

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

  def _predict(self, run_model, split, name):
    feats = self.features[split, name]
    (logits,) = run_model(feats)
    return (logits[:, 0] if self.regression else logits.argmax(-1)), feats['label']

  def evaluate(self, run_model) -> Dict[str, Dict[str, float]]:
    results = {}
    for name in self.evals:
      preds, labels = self._predict(run_model, 'dev', name)
      results[name] = finetune_metrics.glue_metrics(
          'mnli' if name == 'mnli_mismatched' else name, preds, labels)
    return results

  def write_predictions(self, run_model, results, out_dir: str):
    del results
    missing = [n for n, examples in self.tests.items() if examples is None]
    for name, examples in self.tests.items():
      if examples is not None:
        preds, _ = self._predict(run_model, 'test', name)  # every process: collectives
        if jax.process_index() == 0:
          glue.write_predictions(name, examples, preds, out_dir)
    if missing:
      logging.info('no test.tsv for %s in %s: trained and evaluated; no predictions were '
                   'written for %s', ', '.join(missing), self.config.data_dir,
                   'it' if len(missing) == 1 else 'them')

  def headline(self, results) -> float:
    return finetune_metrics.headline(self.name, results[self.name])


class SquadTask:
  """SQuAD v1.1 or v2.0: span head, windows, n-best post-processing, official metrics."""
  token_outputs = True  # start and end logits per position

  def __init__(self, config, tokenizer):
    self.config, self.tokenizer = config, tokenizer
    self.version_2 = config.task == 'v2.0'
    self.name = f'squad/{config.task}'
    self.featurize = lambda examples, training: squad.featurize(
        examples, tokenizer, max_seq_length=config.max_seq_length,
        doc_stride=config.doc_stride, max_query_length=config.max_query_length,
        training=training)
    self.train, _ = self.featurize(self._load('train'), True)
    self.dev = self._load('dev')
    self.dev_features, self.dev_infos = self.featurize(self.dev, False)
    self.answers = None  # dev answers of the last evaluation, for the prediction file

  def _load(self, split: str):
    if self.config.data_dir.startswith('hf:'):
      return squad.read_hf(self.config.task, 'train' if split == 'train' else 'validation',
                           self.config.data_dir[len('hf:'):])
    if self.config.data_dir:
      name = f'{split}-{self.config.task}.json'
      return squad.read_json(os.path.join(self.config.data_dir, name))
    return squad.read_tfds(self.config.task, 'train' if split == 'train' else 'validation',
                           self.config.tfds_data_dir)

  def build(self, model_config):
    return models.build(model_config, head='span')

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

  def evaluate(self, run_model) -> Dict[str, Dict[str, float]]:
    # Padding positions never compete for the n best starts and ends (BERT's run_squad
    # lets them, then drops them: fewer real candidates, and answers that would depend on
    # how far a batch is padded).
    padding = self.dev_features['attention_mask'] == 0
    start, end = (np.where(padding, -np.inf, logits) for logits in run_model(self.dev_features))
    c = self.config
    answers, null_diff = squad.postprocess(
        self.dev, self.dev_infos, self.dev_features, start, end, self.tokenizer,
        n_best_size=c.n_best_size, max_answer_length=c.max_answer_length,
        version_2=self.version_2)
    golds = {ex.qid: ex.answers for ex in self.dev}
    if not self.version_2:
      self.answers, self.null_diff = answers, {}
      return {'squad': finetune_metrics.squad_v1(golds, answers)}
    metrics = finetune_metrics.squad_v2(golds, answers, null_diff)
    threshold = c.null_score_diff_threshold
    if threshold is None:
      threshold = metrics['best_f1_thresh']
    self.answers = squad.apply_null_threshold(answers, null_diff, threshold)
    self.null_diff = null_diff
    metrics['null_score_diff_threshold'] = float(threshold)
    if c.null_score_diff_threshold is not None:
      metrics.update({f'thresholded_{k}': v for k, v in finetune_metrics.squad_v2(
          golds, self.answers).items() if k in ('exact', 'f1')})
    return {'squad': metrics}

  def write_predictions(self, run_model, results, out_dir: str):
    del run_model, results  # SQuAD's test sets are hidden: the dev answers are written
    if jax.process_index() != 0:
      return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'predictions.json'), 'w') as f:
      json.dump(self.answers, f, indent=1)
    if self.version_2:
      with open(os.path.join(out_dir, 'null_odds.json'), 'w') as f:
        json.dump(self.null_diff, f, indent=1)

  def headline(self, results) -> float:
    return finetune_metrics.headline(self.name, results['squad'])


def make_task(config, tokenizer):
  if config.get('benchmark', 'glue') == 'squad':
    return SquadTask(config, tokenizer)
  return GlueTask(config, tokenizer)


# ------------------------------------------------------------------------------ main loop


def finetune(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Fine-tunes, evaluates and predicts; returns {'task', 'step', 'dev', 'headline'}."""
  for name in ('batch_size', 'eval_batch_size', 'log_every_steps', 'num_epochs',
               'bucket_multiple'):
    if config[name] <= 0:  # a cadence of 0 divided by zero after the workdir was written
      raise ValueError(f'config.{name}={config[name]}: give a positive number')
  if config.length_buckets < 0:
    raise ValueError(f'config.length_buckets={config.length_buckets}: give the number of '
                     'compiled lengths (0 pads every batch to max_seq_length)')
  mesh = partitioning.make_mesh(config.mesh)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  # scoped: the caller's mesh (or none) is back afterwards; the lock before any write
  with jax.set_mesh(mesh), workdir_lib.Lock(workdir, 'finetune.py'):
    workdir_lib.check_resume_config(workdir, config, checkpoints.has_complete_step(workdir) or
                                    checkpoints.has_complete_step(os.path.join(workdir,
                                                                               FINAL_DIR)))
    return _finetune(config, workdir, mesh)


def _finetune(config: ml_collections.ConfigDict, workdir: str, mesh) -> dict:
  pre = pretrained_config(config.init_checkpoint, config)
  if config.max_seq_length > pre.model.max_len:
    raise ValueError(f'max_seq_length={config.max_seq_length} exceeds the pretrained model\'s '
                     f'positions ({pre.model.max_len}); lower config.max_seq_length')
  tokenizer = tokenizer_lib.load_for_config(pre.data)
  if tokenizer.vocab_size != pre.model.vocab_size:
    raise ValueError(f'tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the '
                     f'checkpoint was trained with {pre.model.vocab_size}')
  task = make_task(config, tokenizer)
  train = task.train
  num_train = len(train['input_ids'])

  dp = partitioning.data_parallel_size(mesh)
  if config.batch_size % dp or config.eval_batch_size % dp:
    raise ValueError(f'batch_size={config.batch_size} and eval_batch_size='
                     f'{config.eval_batch_size} must be multiples of the data-parallel size '
                     f'{dp} (mesh.data * mesh.fsdp)')
  steps_per_epoch = num_train // config.batch_size
  if steps_per_epoch == 0:
    raise ValueError(f'{num_train} training examples are fewer than one batch of '
                     f'{config.batch_size}; lower config.batch_size')
  num_steps = steps_per_epoch * config.num_epochs
  opt = config.optimizer

  model = task.build(pre.model)
  tx, schedule = train_lib.make_optimizer(opt, num_steps)
  shapes = {k: jax.ShapeDtypeStruct((config.batch_size,) + v.shape[1:], v.dtype)
            for k, v in train.items()}
  abstract, shardings = train_lib.state_shardings(model, tx, shapes, mesh)
  # Restart order: this run's resume checkpoint, else its final params (a finished run whose
  # optimizer state was dropped), else the pretrained encoder (or scratch).
  manager = checkpoints.make_manager(workdir, keep=1, item_names=('state',))
  latest = checkpoints.latest_complete_step(manager)
  final_dir = os.path.join(workdir, FINAL_DIR)
  if latest is not None:
    tree, _ = checkpoints.restore(manager, latest, abstract.to_checkpoint())
    state = train_lib.TrainState.from_checkpoint(tree)
    logging.info('resuming from step %d', latest)
  elif checkpoints.has_complete_step(final_dir):
    state, _ = train_lib.create_train_state(model, tx, shapes, mesh, config.seed)
    params, _ = checkpoints.restore_params(final_dir, abstract.params)
    final_step = int(os.path.basename(checkpoints.resolve_step_dir(final_dir)))
    state = state.replace(params=params, step=jnp.asarray(final_step, state.step.dtype))
    logging.info('the run finished at step %d: evaluating its final params (%s)', final_step,
                 final_dir)
  else:
    state, _ = train_lib.create_train_state(model, tx, shapes, mesh, config.seed)
    if not config.from_scratch:
      encoder, missing = checkpoints.restore_params(config.init_checkpoint,
                                                    abstract.params['encoder'],
                                                    subtree=('encoder',))
      if missing:
        raise ValueError(f'checkpoint {config.init_checkpoint} does not match the model: it '
                         f'has no {missing[0]} ({len(missing)} missing)')
      params = dict(state.params, encoder=encoder)
      state = state.replace(params=params, opt_state=jax.jit(
          tx.init, out_shardings=shardings.opt_state)(params))

  # Every check has passed (config, model, checkpoint): the workdir now describes this run.
  checkpoints.write_config(workdir, config)
  machine.record(workdir)
  train_step = train_lib.make_train_step(
      task.loss_fn(model), tx, schedule, mesh=mesh, shardings=shardings,
      metrics_cls=FinetuneMetrics,
      totals_fn=lambda b: {'examples': jnp.asarray(b['input_ids'].shape[0], jnp.float32)},
      seed=config.seed)
  # Only process 0 writes files (metrics, predictions, results); every process computes.
  writer = (metrics_lib.JsonlWriter(os.path.join(workdir, 'metrics.jsonl'))
            if jax.process_index() == 0 else metric_writers.MultiWriter([]))
  buckets = length_buckets(config, task, workdir, resuming=int(state.step) > 0,
                           mid_epoch=int(state.step) % steps_per_epoch != 0)
  eval_buckets = eval_lengths(config, task, buckets)
  lengths = buckets_lib.lengths_of(train)
  sharding = partitioning.batch_sharding(mesh)

  def batch_of(batch_size, keys):  # length -> the abstract batch of that length
    return lambda length: {
        k: jax.ShapeDtypeStruct((batch_size,) + ((length,) if k in buckets_lib.SEQUENCE_KEYS
                                                 else train[k].shape[1:]), train[k].dtype,
                                sharding=sharding) for k in keys}

  steps = {}  # a finished run (rerun to evaluate and predict) compiles no train step
  if int(state.step) < num_steps:
    steps = compile_lengths(train_step, (state,), batch_of(config.batch_size, train), buckets,
                            'train step')
  predictions = compile_lengths(  # the model's inputs only; outputs whole on every host
      jax.jit(lambda params, batch: model.apply({'params': params}, batch)[1:],
              out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
      (state.params,), batch_of(config.eval_batch_size, buckets_lib.SEQUENCE_KEYS),
      eval_buckets, 'prediction')
  predict = lambda params, batch: predictions[batch['input_ids'].shape[1]](params, batch)

  def infer(params):  # features -> the head's outputs for every row
    return lambda features: run_model(predict, params, features, mesh=mesh,
                                      buckets=eval_buckets,
                                      batch_size=config.eval_batch_size,
                                      token_outputs=task.token_outputs)

  def evaluate(params, step):
    results = task.evaluate(infer(params))
    for name, values in results.items():
      # metrics.jsonl lines {"step": s, "split": "dev_<task>", "accuracy": ...}
      writer.write_scalars(step, {f'dev_{name}/{k}': v for k, v in values.items()})
      logging.info('step %d dev %s: %s', step, name, values)
    return results

  step = int(state.step)
  results = None
  best = BestCheckpoint(workdir, task, pre, config.keep_best, fresh=step == 0)
  preempted = None
  with workdir_lib.StopSignal() as stop:
    for epoch in range(step // steps_per_epoch, config.num_epochs):
      plan = buckets_lib.train_batches(lengths, buckets, config.batch_size, config.seed, epoch)
      window = TrainWindow()
      epoch_start = time.time()
      first_step = step - epoch * steps_per_epoch
      for i in range(first_step, steps_per_epoch):
        length, idx = plan[i]
        state, m = steps[length](state, full_batch(buckets_lib.take(train, idx, length), mesh))
        step += 1
        window.add(m, real=int(lengths[idx].sum()), padded=length * len(idx))
        # Preempted: save here, a rerun resumes mid-epoch (an epoch's last step is saved
        # below, after its evaluation).
        stopping = i < steps_per_epoch - 1 and stop.reached(manager, step)
        if step % config.log_every_steps == 0 or i == steps_per_epoch - 1 or stopping:
          values = window.report(step, num_steps, epoch, config.batch_size)
          writer.write_scalars(step, {f'train/{k}': v for k, v in values.items()})
        if stopping:
          checkpoints.save(manager, step, state.to_checkpoint(), force=True)
          preempted = step
          break
      if preempted is not None:
        break
      epoch_seconds = time.time() - epoch_start
      logging.info('epoch %d/%d: %.1f s', epoch + 1, config.num_epochs, epoch_seconds)
      if first_step == 0:  # a whole epoch in this process (not the rest of one)
        writer.write_scalars(step, {'train/epoch_seconds': epoch_seconds})
      results = evaluate(state.params, step)
      best.offer(state.params, step, epoch + 1, results)  # before the resume point moves on
      checkpoints.save(manager, step, state.to_checkpoint(), force=True)
      if epoch + 1 < config.num_epochs and stop.reached(manager, step):
        preempted = step
        break
  manager.wait_until_finished()
  if preempted is not None:
    logging.warning('stop signal: saved step %d in %s; run the same command to resume',
                    preempted, manager.directory)
    manager.close()
    writer.close()
    return {'task': task.name, 'step': step, 'preempted': preempted}
  if results is None:  # resumed after the last epoch
    results = evaluate(state.params, step)
  task.write_predictions(infer(state.params), results, os.path.join(workdir, 'predictions'))
  summary = {'task': task.name, 'step': step, 'dev': results,
             'headline': task.headline(results), 'best': best.summary()}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'results.json'), 'w') as f:
      json.dump(summary, f, indent=2)
  if checkpoints.latest_complete_step(manager) is not None and not config.keep_optimizer_state:
    drop_optimizer_state(manager, state.params, step, pre, final_dir, best)
  manager.close()
  writer.close()
  return summary


class TrainWindow:
  """The train metrics and throughput of the steps since the last report."""

  def __init__(self):
    self._reset()

  def _reset(self):
    self.metrics, self.real, self.padded, self.steps = None, 0, 0, 0
    self.start = time.time()

  def add(self, step_metrics, real: int, padded: int):
    """One step's metrics and its real and padded token counts."""
    self.metrics = metrics_lib.merge(self.metrics, step_metrics)
    self.real, self.padded, self.steps = self.real + real, self.padded + padded, self.steps + 1

  def report(self, step: int, num_steps: int, epoch: int, batch_size: int) -> dict:
    """The window's values (logged; a non-finite loss or gradient raises), then a new
    window."""
    values = metrics_lib.to_floats(self.metrics)
    for name in ('loss', 'grad_norm'):  # an inf gradient has already made params nan
      if not np.isfinite(values[name]):
        raise FloatingPointError(f'{name} became {values[name]} by step {step}; nothing was '
                                 'saved since the last checkpoint; lower '
                                 'config.optimizer.learning_rate')
    seconds = time.time() - self.start
    if self.steps and seconds > 0:
      steps_per_s = self.steps / seconds
      values.update({'steps_per_s': steps_per_s, 'examples_per_s': steps_per_s * batch_size,
                     'tokens_per_s': self.real / seconds,  # real tokens
                     'padded_tokens_per_s': self.padded / seconds})
      eta = (num_steps - step) / steps_per_s
      logging.info('step %d/%d (epoch %d): loss %.4f, %.2f steps/s, %.1f examples/s, '
                   '%.0f tokens/s (%.0f with padding, %.0f%% real), ETA %s', step, num_steps,
                   epoch + 1, values['loss'], steps_per_s, values['examples_per_s'],
                   values['tokens_per_s'], values['padded_tokens_per_s'],
                   100 * values['tokens_per_s'] / values['padded_tokens_per_s'],
                   datetime.timedelta(seconds=int(eta)))
    self._reset()
    return values


class BestCheckpoint:
  """<workdir>/best: the params of the epoch with the best dev headline so far, as a
  params-only checkpoint with the pretraining config.json (so another fine-tuning can start
  from it) and best/results.json (its step, epoch and dev metrics)."""

  def __init__(self, workdir: str, task, pretraining_config, enabled: bool, fresh: bool):
    self.dir, self.task, self.config = os.path.join(workdir, BEST_DIR), task, pretraining_config
    self.enabled = enabled
    path = os.path.join(self.dir, 'results.json')
    if fresh and os.path.exists(self.dir):  # a run starting at step 0: best/ is another's
      logging.warning('removing %s: it holds the best epoch of an earlier run in this workdir '
                      '(this run starts from step 0)', self.dir)
      if jax.process_index() == 0:
        shutil.rmtree(self.dir)
      self.best = None
      return
    self.best = json.load(open(path)) if enabled and os.path.isfile(path) else None

  def offer(self, params, step: int, epoch: int, results):
    headline = self.task.headline(results)
    if not self.enabled or not np.isfinite(headline) or (
        self.best is not None and headline <= self.best['headline']):
      return
    manager = checkpoints.make_manager(self.dir, keep=1, item_names=('state',))
    for old in manager.all_steps():  # an epoch redone after a kill saves its step again
      if old >= step:
        checkpoints.delete_step(manager, old)
    checkpoints.save(manager, step, {'step': step, 'params': params}, force=True)
    manager.wait_until_finished()
    manager.close()
    checkpoints.write_config(self.dir, self.config)
    self.best = {'step': step, 'epoch': epoch, 'headline': headline, 'dev': results}
    if jax.process_index() == 0:
      with open(os.path.join(self.dir, 'results.json.tmp'), 'w') as f:
        json.dump(self.best, f, indent=2)
      os.replace(os.path.join(self.dir, 'results.json.tmp'),
                 os.path.join(self.dir, 'results.json'))
    logging.info('best dev %s so far (epoch %d): params saved to %s', self.task.name, epoch,
                 self.dir)

  def summary(self):
    return dict(self.best, dir=self.dir) if self.best else None


def drop_optimizer_state(manager, params, step: int, pretraining_config, final_dir: str,
                         best: BestCheckpoint):
  """A finished run needs no optimizer state: keep its params in <workdir>/final (a
  params-only checkpoint that a rerun evaluates and another fine-tuning can start from; a
  link to best/ when the last epoch was the best) and delete the resume checkpoint
  (config.keep_optimizer_state=True keeps it)."""
  if os.path.islink(final_dir) or checkpoints.has_complete_step(final_dir):
    pass  # written by an attempt killed before the resume checkpoint was deleted
  elif best.best is not None and best.best['step'] == step:
    if jax.process_index() == 0:
      os.symlink(BEST_DIR, final_dir)
  else:
    checkpoints.save_params(final_dir, params, pretraining_config, step=step)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.sync_global_devices('finetune final params saved')
  for old in manager.all_steps():
    checkpoints.delete_step(manager, old)
  logging.info('finished: final params in %s; the optimizer state was dropped '
               '(config.keep_optimizer_state=True keeps it)', final_dir)


def main(argv):
  del argv
  if not flags.FLAGS.workdir:
    cli.fail('--workdir is required: the directory for checkpoints, metrics and predictions '
             '(e.g. --workdir /tmp/ft_sst2)')
  logging.get_absl_handler().addFilter(cli.QuietLibraries())
  host_memory.keep_freed_memory()  # CPU-only runs: no page faults per step (logs if applied)
  distributed.initialize_from_flags()  # several hosts: one run over all their devices
  workdir_lib.exit_on_sigterm()  # the loop's own handler saves first
  summary = cli.run_main(finetune, flags.FLAGS.config, flags.FLAGS.workdir,
                         also=(FloatingPointError,))
  if 'preempted' in summary:
    workdir_lib.exit_not_finished(summary['preempted'])
  print(json.dumps(summary, indent=2))


def define_flags():
  """Flags exist only when this file runs as a program (tests import it beside train.py)."""
  with cli.config_overrides():  # an unknown --config.<key> fails here: one line
    config_flags.DEFINE_config_file(
        'config', os.path.join(_REPO, 'configs', 'finetune.py') + ':glue/sst2',
        'configs/finetune.py:glue/<task>', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and predictions.')
  distributed.define_flags()


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
