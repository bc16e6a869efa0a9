"""The pretraining task: BERT's masked language modelling + next sentence prediction, or
RoBERTa's masked language modelling alone (config.objective).

The objective is here: the batch's format (abstract_batch), the loss over the step's totals
(loss_fn, totals), the model with its MLM and NSP heads and its train and eval steps
(program: what the launch check compiles) and the majority baselines. What the task gives
the trainer (trainer.Task): that program, the stream of prepared pretraining batches (its
position saved in each checkpoint's 'data' item, so a resumed run reads on exactly where it
stopped), and the held-out evaluation: the first `train.eval_steps` batches of the eval
split, the same at every evaluation, with the majority predictors' accuracies on those
batches beside the model's.
"""

from typing import Any, Callable, Dict

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from realformer import config_checks
from realformer import models
from realformer.model.spec import resolve
from realformer.train import checkpoints
from realformer.train import distributed
from realformer.train import metrics as metrics_lib
from realformer.train import partitioning
from realformer.train import train_lib
from realformer.train import trainer
from realformer.train.run_dir import RunDir


# --------------------------------------------------------------------------------------
# The objective: the batch, the loss, the program.
# --------------------------------------------------------------------------------------

def abstract_batch(global_batch_size: int, seq_len: int, num_predictions: int,
                   next_sentence: bool = True) -> dict:
  """ShapeDtypeStructs of one global pretraining batch (for init and compile)."""
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  b, t, p = global_batch_size, seq_len, num_predictions
  batch = {'input_ids': i32(b, t), 'segment_ids': i32(b, t), 'attention_mask': i32(b, t),
           'masked_lm_positions': i32(b, p), 'masked_lm_ids': i32(b, p),
           'masked_lm_weights': jax.ShapeDtypeStruct((b, p), jnp.float32)}
  if next_sentence:
    batch['next_sentence_labels'] = i32(b)
  return batch


def totals(batch) -> Dict[str, jax.Array]:
  """Normalizers of a whole step's batch: masked-token weight and example count."""
  return {'mlm_weight': jnp.maximum(jnp.sum(batch['masked_lm_weights'].astype(jnp.float32)),
                                    1e-6),
          'examples': jnp.asarray(batch['input_ids'].shape[0], jnp.float32)}


def loss_fn(model: nn.Module) -> Callable:
  """The loss_fn of train_lib's steps: BERT's MLM + NSP objective, or MLM alone for a model
  without the NSP head (model.next_sentence False: config.objective=mlm).

  loss = sum_i w_i CE(mlm_logits_i, masked_lm_ids_i) / sum_i w_i  [+  mean NSP CE],
  the sums running over the whole step's batch (the denominators are `totals`). Logits are
  float32 whatever model.dtype is. The evaluation's loss is formed from the same two parts
  (metrics.PretrainingEvalMetrics.compute): a change to how they combine is made in both.
  """
  def objective(params, batch, rng, normalizers):
    deterministic = rng is None
    out = model.apply({'params': params}, batch, deterministic=deterministic,
                      rngs=None if deterministic else {'dropout': rng}, full_hidden=False)
    mlm_logits = out.mlm_logits.astype(jnp.float32)                    # [b, P, V]
    weights = batch['masked_lm_weights'].astype(jnp.float32)           # [b, P]
    mlm_ce = optax.softmax_cross_entropy_with_integer_labels(mlm_logits, batch['masked_lm_ids'])
    mlm_sum = jnp.sum(mlm_ce * weights)
    mlm_correct = jnp.sum((jnp.argmax(mlm_logits, -1) == batch['masked_lm_ids']) * weights)
    loss = mlm_sum / normalizers['mlm_weight']
    stats = {'mlm_loss': metrics_lib.average(mlm_sum, jnp.sum(weights)),
             'mlm_accuracy': metrics_lib.average(mlm_correct, jnp.sum(weights))}
    if out.nsp_logits is not None:
      nsp_logits = out.nsp_logits.astype(jnp.float32)                  # [b, 2]
      labels = batch['next_sentence_labels']
      nsp_ce = optax.softmax_cross_entropy_with_integer_labels(nsp_logits, labels)
      nsp_correct = jnp.sum(jnp.argmax(nsp_logits, -1) == labels)
      loss = loss + jnp.sum(nsp_ce) / normalizers['examples']
      n = labels.shape[0]
      stats.update(nsp_loss=metrics_lib.average(jnp.sum(nsp_ce), n),
                   nsp_accuracy=metrics_lib.average(nsp_correct, n))
    return loss, stats
  return objective


def program(config, mesh, platform: str = '') -> train_lib.Program:
  """The program of a (resolved) pretraining `config` on `mesh`: MLM + NSP, or MLM alone
  (config.objective; without NSP the pooler, which nothing trains, is left as initialised).

  platform: the platform the step is compiled for ('' = this process's backend); the
  backend-dependent 'auto' choices of the model follow it (spec.platform).
  """
  from data import pretraining as objectives  # pylint: disable=g-import-not-at-top
  tc = config.train
  spec = resolve(config.model, platform=platform)
  nsp = objectives.of_config(config).next_sentence
  model = models.build(spec, next_sentence=nsp)
  preds = config.data.max_predictions_per_seq
  loss = loss_fn(model)
  train_metrics, eval_metrics = metrics_lib.pretraining_metrics(nsp)
  return train_lib.make_program(
      model, config.optimizer, tc.num_steps, mesh, config.seed,
      abstract_batch(tc.batch_size, config.data.max_seq_length, preds, nsp),
      loss_fn=loss, metrics_cls=train_metrics, totals_fn=totals,
      eval_fn=train_lib.loss_metrics(loss, eval_metrics, totals,
                                     microbatches=tc.grad_accum_steps, mesh=mesh),
      flops_per_example=lambda length: train_lib.flops_per_example(spec, length, preds, nsp),
      grad_accum_steps=tc.grad_accum_steps, untrained=None if nsp else _is_pooler)


def _is_pooler(path) -> bool:
  return 'pooler' in train_lib.param_names(path)


def make_label_counts(mesh, vocab_size: int) -> Callable:
  """A jitted batch -> {'mlm': [vocab] masked-token weight per label id, 'nsp': [2] (where
  the batch has next_sentence_labels)}.

  Summed over the evaluation batches, these give the trivial baselines on exactly those
  batches: always predicting the most frequent masked token, always the majority NSP label
  (what a model that has learned only token frequencies scores)."""
  def counts(batch):
    mlm = jnp.zeros((vocab_size,), jnp.float32).at[batch['masked_lm_ids'].reshape(-1)].add(
        batch['masked_lm_weights'].astype(jnp.float32).reshape(-1))
    if 'next_sentence_labels' not in batch:
      return {'mlm': mlm}
    nsp = jnp.zeros((2,), jnp.float32).at[batch['next_sentence_labels'].reshape(-1)].add(1.0)
    return {'mlm': mlm, 'nsp': nsp}

  return jax.jit(counts, in_shardings=(partitioning.batch_sharding(mesh),),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))


def majority_baselines(counts: Dict[str, Any]) -> Dict[str, float]:
  """eval metrics of the constant predictors from summed make_label_counts outputs."""
  majority = lambda c: float(np.max(c) / max(np.sum(c), 1e-6))
  return {f'{name}_majority_accuracy': majority(c) for name, c in counts.items()}


# --------------------------------------------------------------------------------------
# Synthetic data (throughput checks; config.data.sources == 'synthetic').
# --------------------------------------------------------------------------------------

class SyntheticData:
  """Random pretraining batches of the real format, a pure function of (seed, index).

  Not language: for throughput and sharding checks only. The state is the next batch
  index (a JSON dict), saved in the checkpoint's 'data' item like the real pipeline's.
  Every host draws the global batch and keeps its rows, so any process count agrees.
  next_sentence=False (config.objective=mlm): one segment and no next_sentence_labels.
  """

  def __init__(self, *, vocab_size: int, seq_len: int, num_predictions: int,
               global_batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, num_special: int = 5, mask_id: int = 4,
               next_sentence: bool = True):
    self.vocab_size, self.seq_len, self.num_predictions = vocab_size, seq_len, num_predictions
    self.next_sentence = next_sentence
    self.global_batch_size, self.seed, self.num_special = global_batch_size, seed, num_special
    self.mask_id = mask_id  # [MASK] of the sentencepiece vocabularies trained here
    per_host = global_batch_size // process_count
    self._rows = slice(process_index * per_host, (process_index + 1) * per_host)
    self.index = 0

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, self.index))
    self.index += 1
    b, t, p = self.global_batch_size, self.seq_len, self.num_predictions
    ids = rng.integers(self.num_special, self.vocab_size, (b, t), dtype=np.int32)
    lengths = rng.integers(t // 2, t + 1, (b,))
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    segment = ((np.arange(t)[None] >= lengths[:, None] // 2) * mask).astype(np.int32)
    positions = np.sort(rng.permuted(np.tile(np.arange(1, t), (b, 1)), axis=1)[:, :p], axis=1)
    weights = (positions < lengths[:, None]).astype(np.float32)
    labels = np.take_along_axis(ids, positions, 1).astype(np.int32)
    np.put_along_axis(ids, positions, self.mask_id, 1)  # the model must not see the answer
    if positions.shape[1] < p:  # more predictions than positions: padded, as prepared data's
      pad = ((0, 0), (0, p - positions.shape[1]))
      positions, weights, labels = (np.pad(x, pad) for x in (positions, weights, labels))
    batch = {'input_ids': ids * mask, 'segment_ids': segment, 'attention_mask': mask,
             'masked_lm_positions': positions.astype(np.int32),
             'masked_lm_ids': labels,
             'masked_lm_weights': weights}
    nsp = rng.integers(0, 2, (b,), dtype=np.int32)  # (drawn either way: the same batches)
    if self.next_sentence:
      batch['next_sentence_labels'] = nsp
    else:
      batch['segment_ids'] = np.zeros_like(segment)  # one segment
    return {k: v[self._rows] for k, v in batch.items()}

  def get_state(self) -> dict:
    return {'index': self.index}

  def set_state(self, state: dict):
    self.index = int(state['index'])


# --------------------------------------------------------------------------------------
# The task.
# --------------------------------------------------------------------------------------

def resolved_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """An unlocked copy with model.vocab_size set from the tokenizer (not for 'synthetic'),
  after the checks of everything the config alone shows (one-line errors, before any
  preparation or compile)."""
  config = config.copy_and_resolve_references()
  config_checks.check_config(config)
  from data import pretraining  # pylint: disable=g-import-not-at-top
  pretraining.check_objective(config)
  if config.data.sources != 'synthetic':
    from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    size = tokenizer_lib.load_for_config(config.data).vocab_size
    if config.model.vocab_size != size:  # (a size preset's, or an override's: said)
      logging.info('model.vocab_size=%d: the tokenizer\'s (data.tokenizer), in place of the '
                   'config\'s %d; another vocabulary needs a tokenizer of that size, or '
                   'data.sources=synthetic', size, config.model.vocab_size)
    config.model.vocab_size = size
    resolve(config.model)  # with the tokenizer's vocabulary
  return config


def check_init_checkpoint(config, abstract_params) -> None:
  """A fresh run's train.init_checkpoint (a second phase at a longer length, say), before
  its data is prepared: it is there and fits the model (a one-line error), it was trained
  with this run's tokenizer where both are here to compare (a one-line error: its word
  embeddings stand for another vocabulary's pieces), and with this variant (a warning: its
  weights start another model)."""
  path = config.train.init_checkpoint
  step_dir = checkpoints.resolve_step_dir(path)
  try:
    stored = ml_collections.ConfigDict(checkpoints.read_pretraining_config(path))
  except (FileNotFoundError, ValueError):
    stored = None  # (weights of no train.py run: nothing recorded to compare)
  try:
    checkpoints.check_matches(step_dir, {'params': abstract_params}, allow_missing=True,
                              either_layout=True)
  except ValueError as e:
    sizes = _sizes_to_match(stored, config) if stored is not None else ''
    if not sizes:
      raise
    what = (str(e).partition('does not match the model: ')[2] or
            str(e).partition(f'{step_dir} ')[2]).partition('; ')[0].partition(
                ' (model.max_len)')[0]
    raise ValueError(f'train.init_checkpoint {path} holds a model of other sizes than this '
                     f'run\'s ({what}); give this run those of the run that wrote it: '
                     f'{sizes}') from None
  if stored is None:
    return
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  data = stored.get('data') or {}
  if 'tokenizer' in data:  # (recorded: '' is the embedded one)
    theirs, ours = (tokenizer_lib.signature(t)
                    for t in (data['tokenizer'], config.data.tokenizer))
    if theirs and ours and theirs != ours:
      raise ValueError(f'train.init_checkpoint {path} was trained with the tokenizer '
                       f'{data["tokenizer"] or "embedded"}, this run reads '
                       f'{config.data.tokenizer or "embedded"} (other pieces behind the same '
                       f'ids); set data.tokenizer={data["tokenizer"] or repr("")}')
  try:
    trained = resolve(stored.model).name
  except (ValueError, KeyError, AttributeError):
    return
  if trained != resolve(config.model).name:
    logging.warning('train.init_checkpoint %s was trained as %s; this run is %s: its weights '
                    'start another variant', path, trained, resolve(config.model).name)


# The model fields that set its parameters' shapes (model.max_len alone has its own message;
# the vocabulary is the tokenizer's).
_SIZES = ('num_layers', 'hidden_size', 'num_heads', 'mlp_dim', 'type_vocab_size')


def _sizes_to_match(stored, config) -> str:
  """The overrides that give this run the sizes (with them its longer position table, and
  its vocabulary) of the run that wrote an init checkpoint, where they differ:
  '--config.model.hidden_size=384 ...', else '' (also where only the table's length does:
  check_matches' own message says it)."""
  model = stored.get('model') or {}
  flags = [f'--config.model.{f}={model[f]}' for f in _SIZES
           if f in model and model[f] != config.model.get(f)]
  if (flags and isinstance(model.get('max_len'), int)
      and model['max_len'] > config.model.max_len):  # (a shorter table cannot grow)
    flags.append(f'--config.model.max_len={model["max_len"]}')
  tokenizer = (stored.get('data') or {}).get('tokenizer')
  if tokenizer is not None and tokenizer != config.data.tokenizer:
    flags.append(f'--config.data.tokenizer={tokenizer or repr("")}')
  return ' '.join(flags)


def make_input_fn(config, workdir: str):
  """(split, seed) -> this host's iterator of numpy batches (global batch / process count).

  The real pipeline prepares its shards once (process 0 writes, the others wait), and checks
  the eval split against the evaluation's batches here, before the first step."""
  kw = dict(global_batch_size=config.train.batch_size,
            process_index=jax.process_index(), process_count=jax.process_count())
  if config.data.sources == 'synthetic':
    from data import pretraining  # pylint: disable=g-import-not-at-top
    return lambda split, seed: SyntheticData(
        vocab_size=config.model.vocab_size, seq_len=config.data.max_seq_length,
        num_predictions=config.data.max_predictions_per_seq, seed=seed + (split == 'eval'),
        next_sentence=pretraining.of_config(config).next_sentence, **kw)
  from data import pipeline  # pylint: disable=g-import-not-at-top
  from data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizer_lib.load_for_config(config.data)
  prepared_dir = pipeline.ensure_prepared(config, workdir)
  metadata = prepare_lib.read_metadata(prepared_dir)
  logging.info(passes_over_the_data(config, metadata['counts']['train']))
  if config.train.eval_steps > 0:
    pipeline.check_split(metadata, prepared_dir, 'eval', metadata['counts']['eval'],
                         config.train.batch_size, jax.process_count(),
                         batches=config.train.eval_steps)
  return lambda split, seed: pipeline.make_pretraining_iterator(
      config.data, tokenizer, prepared_dir, split=split, seed=seed, **kw)


def passes_over_the_data(config, instances: int) -> str:
  """How many times the run reads its prepared training instances (each pass masks them
  anew; a small corpus read many times is learnt by heart: its held-out losses rise)."""
  steps, batch = config.train.num_steps, config.train.batch_size
  budget = ' at most' if config.train.get('time_budget_minutes') else ''
  micro = int(config.train.get('grad_accum_steps', 1))
  split = f' (each {micro} microbatches of {batch // micro})' if micro > 1 else ''
  return (f'train.num_steps={steps} batches of {batch}{split} read{budget} {steps * batch:,} '
          f'instances: {steps * batch / max(instances, 1):.3g} passes over the {instances:,} '
          'prepared (each masked anew)')


class StreamPosition(trainer.DataState):
  """Where the training stream stands: a grain iterator's state (restored in place), or the
  synthetic stream's (JSON)."""

  def __init__(self, stream):
    self.stream = stream

  def checkpoint_args(self, mode: str):
    if isinstance(self.stream, SyntheticData):
      return (ocp.args.JsonSave(self.stream.get_state()) if mode == 'save' else
              ocp.args.JsonRestore())
    from data import pipeline  # pylint: disable=g-import-not-at-top
    return pipeline.iterator_checkpoint_args(self.stream, mode)

  def restored(self, value):
    if isinstance(self.stream, SyntheticData):
      self.stream.set_state(value)

  def check_restorable(self, step_dir: str) -> None:
    if not isinstance(self.stream, SyntheticData):
      from data import pipeline  # pylint: disable=g-import-not-at-top
      pipeline.check_saved_position(step_dir, jax.process_count())


class PretrainingTask(trainer.Task):
  """MLM + NSP, or MLM alone, on config.data's sources (config: a resolved_config)."""
  command = 'train.py'
  name = 'pretraining'

  @property
  def nonfinite_hint(self) -> str:
    half = self.config.model.dtype != 'float32'
    return ('lower optimizer.learning_rate' + (', ' if half else ' or ') + 'raise '
            'optimizer.warmup_steps' + (' or train in float32 (model.dtype)' if half else ''))

  @classmethod
  def checked_config(cls, config, mesh):
    config = resolved_config(config)
    resolve(config.model, platform=mesh.devices.flat[0].platform)  # (the devices' own checks)
    train_lib.check_batch_layout(config.train.batch_size, config.train.grad_accum_steps, mesh,
                                 jax.process_count())
    return config

  def __init__(self, config, mesh, run: RunDir):
    self.config = config
    if config.get('objective', 'mlm_nsp') != 'mlm_nsp':
      from data import pretraining as objectives  # pylint: disable=g-import-not-at-top
      logging.info('objective: %s (%s)', config.objective,
                   objectives.of_config(config).about)
    self.cadence = trainer.make_cadence(config.train)
    self.program = program(config, mesh, platform=mesh.devices.flat[0].platform)
    if config.train.init_checkpoint:
      self.init_checkpoint = trainer.InitCheckpoint(config.train.init_checkpoint)
      # A fresh start reads it: checked before the data (as process 0 sees the run).
      if not distributed.from_process_zero(run.has_checkpoint()):
        check_init_checkpoint(config, self.program.abstract.params)
    self._make_input = make_input_fn(config, str(run))  # prepares the data (under the lock)
    self.train_iter = self._make_input('train', config.seed)
    self.data = StreamPosition(self.train_iter)
    self._label_counts = make_label_counts(mesh, config.model.vocab_size)
    self._baselines: Dict[str, float] = {}  # majority predictors on the eval batches

  def batches(self, start_step: int):
    del start_step  # the stream's own position (restored) says where it is
    cost = trainer.StepCost(examples=self.config.train.batch_size,
                            length=self.config.data.max_seq_length)
    while True:
      yield train_lib.global_batch(next(self.train_iter), self.program.mesh), cost

  def evaluate(self, params, step: int) -> trainer.Results:
    # The same batches every time, and for every run seed that reads one prepared corpus
    # (data.seed) with the same train.batch_size, host count and data.worker_count (they
    # deal the shuffled eval stream): the seeds of a sweep are compared on one evaluation
    # set and its masks; runs of other batch sizes on other draws of the same split.
    from data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
    eval_iter = self._make_input('eval', prepare_lib.data_seed(self.config))
    collected, counts = None, None
    for _ in range(self.config.train.eval_steps):
      batch = train_lib.global_batch(next(eval_iter), self.program.mesh)
      collected = metrics_lib.merge(collected, self.program.eval_step(params, batch))
      if not self._baselines:
        counted = self._label_counts(batch)
        counts = counted if counts is None else jax.tree.map(lambda a, b: a + b, counts,
                                                             counted)
    if not self._baselines:
      self._baselines.update(majority_baselines(counts))
    return {'eval': dict(metrics_lib.to_floats(collected), **self._baselines)}
