"""The pretraining task: BERT's masked language modelling + next sentence prediction, or
RoBERTa's masked language modelling alone (config.objective).

What it gives the trainer (trainer.Task): train_lib.pretraining_program (the model with its
MLM and NSP heads and its train and eval steps: the program the launch check compiles), the
stream of prepared pretraining batches (its position saved in each checkpoint's 'data'
item, so a resumed run reads on exactly where it stopped), and the held-out evaluation:
the first `train.eval_steps` batches of the eval split, the same at every evaluation, with
the majority predictors' accuracies on those batches beside the model's.
"""

from typing import Dict

from absl import logging
import jax
import ml_collections
import orbax.checkpoint as ocp

from realformer import config_checks
from realformer.model.spec import resolve
from realformer.train import checkpoints
from realformer.train import distributed
from realformer.train import metrics as metrics_lib
from realformer.train import train_lib
from realformer.train import trainer
from realformer.train.run_dir import RunDir


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
    checkpoints.check_matches(step_dir, {'params': abstract_params}, allow_missing=True)
  except ValueError as e:
    sizes = _sizes_to_match(stored, config) if stored is not None else ''
    if not sizes:
      raise
    what = str(e).partition('does not match the model: ')[2].partition('; use the')[0]
    raise ValueError(f'train.init_checkpoint {path} holds a model of other sizes than this '
                     f'run\'s ({what}); give this run those of the run that wrote it: '
                     f'{sizes}') from None
  if stored is None:
    return
  from data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  data = stored.get('data') or {}
  if 'tokenizer' in data:  # (recorded: '' is the embedded one)
    theirs, ours = (prepare_lib.tokenizer_signature(t)
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


# The model fields that set its parameters' shapes (model.max_len has its own message; the
# vocabulary is the tokenizer's).
_SIZES = ('num_layers', 'hidden_size', 'num_heads', 'mlp_dim', 'type_vocab_size')


def _sizes_to_match(stored, config) -> str:
  """The overrides that give this run the sizes (and vocabulary) of the run that wrote an
  init checkpoint, where they differ: '--config.model.hidden_size=384 ...', else ''."""
  model = stored.get('model') or {}
  flags = [f'--config.model.{f}={model[f]}' for f in _SIZES
           if f in model and model[f] != config.model.get(f)]
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
    return lambda split, seed: train_lib.SyntheticPretrainingData(
        vocab_size=config.model.vocab_size, seq_len=config.data.max_seq_length,
        num_predictions=config.data.max_predictions_per_seq, seed=seed + (split == 'eval'),
        next_sentence=pretraining.of_config(config).next_sentence, **kw)
  from data import pipeline  # pylint: disable=g-import-not-at-top
  from data import prepare as prepare_lib  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizer_lib.load_for_config(config.data)
  prepared_dir = pipeline.ensure_prepared(config, workdir)
  if config.train.eval_steps > 0:
    metadata = prepare_lib.read_metadata(prepared_dir)
    pipeline.check_split(metadata, prepared_dir, 'eval', metadata['counts']['eval'],
                         config.train.batch_size, jax.process_count(),
                         batches=config.train.eval_steps)
  return lambda split, seed: pipeline.make_pretraining_iterator(
      config.data, tokenizer, prepared_dir, split=split, seed=seed, **kw)


class StreamPosition(trainer.DataState):
  """Where the training stream stands: a grain iterator's state (restored in place), or the
  synthetic stream's (JSON)."""

  def __init__(self, stream):
    self.stream = stream

  def checkpoint_args(self, mode: str):
    if isinstance(self.stream, train_lib.SyntheticPretrainingData):
      return (ocp.args.JsonSave(self.stream.get_state()) if mode == 'save' else
              ocp.args.JsonRestore())
    from data import pipeline  # pylint: disable=g-import-not-at-top
    return pipeline.iterator_checkpoint_args(self.stream, mode)

  def restored(self, value):
    if isinstance(self.stream, train_lib.SyntheticPretrainingData):
      self.stream.set_state(value)

  def check_restorable(self, step_dir: str) -> None:
    if not isinstance(self.stream, train_lib.SyntheticPretrainingData):
      from data import pipeline  # pylint: disable=g-import-not-at-top
      pipeline.check_saved_position(step_dir, jax.process_count())


class PretrainingTask(trainer.Task):
  """MLM + NSP, or MLM alone, on config.data's sources (config: a resolved_config)."""
  command = 'train.py'
  name = 'pretraining'
  nonfinite_hint = ('lower optimizer.learning_rate, raise optimizer.warmup_steps or train '
                    'in float32 (model.dtype)')

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
      logging.info('objective: %s (masked language modelling alone, no NSP head)',
                   config.objective)
    self.cadence = trainer.make_cadence(config.train)
    self.program = train_lib.pretraining_program(config, mesh,
                                                 platform=mesh.devices.flat[0].platform)
    if config.train.init_checkpoint:
      self.init_checkpoint = trainer.InitCheckpoint(config.train.init_checkpoint)
      # A fresh start reads it: checked before the data (as process 0 sees the run).
      if not distributed.from_process_zero(run.has_checkpoint()):
        check_init_checkpoint(config, self.program.abstract.params)
    self._make_input = make_input_fn(config, str(run))  # prepares the data (under the lock)
    self.train_iter = self._make_input('train', config.seed)
    self.data = StreamPosition(self.train_iter)
    self._label_counts = train_lib.make_label_counts(mesh, config.model.vocab_size)
    self._baselines: Dict[str, float] = {}  # majority predictors on the eval batches

  def batches(self, start_step: int):
    del start_step  # the stream's own position (restored) says where it is
    cost = trainer.StepCost(examples=self.config.train.batch_size,
                            length=self.config.data.max_seq_length)
    while True:
      yield train_lib.global_batch(next(self.train_iter), self.program.mesh), cost

  def evaluate(self, params, step: int) -> trainer.Results:
    # The same batches every time, and for every run seed that reads one prepared corpus
    # (data.seed): the seeds of a sweep are compared on one evaluation set and its masks.
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
      self._baselines.update(train_lib.majority_baselines(counts))
    return {'eval': dict(metrics_lib.to_floats(collected), **self._baselines)}
