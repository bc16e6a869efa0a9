"""The pretraining task: BERT's masked language modelling + next sentence prediction.

What it gives the trainer (trainer.Task): the model with its MLM and NSP heads and the train
step of train_lib.pretraining_program (the same program the launch check compiles), the
stream of prepared pretraining batches (its position saved in each checkpoint's 'data'
item, so a resumed run reads on exactly where it stopped), and the held-out evaluation:
the first `train.eval_steps` batches of the eval split, the same at every evaluation, with
the majority predictors' accuracies on those batches beside the model's.
"""

from typing import Any, Dict

import jax
import ml_collections
import orbax.checkpoint as ocp

from realformer import config_checks
from realformer.model.spec import resolve
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
  if config.data.sources != 'synthetic':
    from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    config.model.vocab_size = tokenizer_lib.load_for_config(config.data).vocab_size
    resolve(config.model)  # with the tokenizer's vocabulary
  return config


def make_input_fn(config, workdir: str):
  """(split, seed) -> this host's iterator of numpy batches (global batch / process count).

  The real pipeline prepares its shards once (process 0 writes, the others wait), and checks
  the eval split against the evaluation's batches here, before the first step."""
  kw = dict(global_batch_size=config.train.batch_size,
            process_index=jax.process_index(), process_count=jax.process_count())
  if config.data.sources == 'synthetic':
    return lambda split, seed: train_lib.SyntheticPretrainingData(
        vocab_size=config.model.vocab_size, seq_len=config.data.max_seq_length,
        num_predictions=config.data.max_predictions_per_seq, seed=seed + (split == 'eval'),
        **kw)
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


def cadence(config) -> trainer.Cadence:
  tc = config.train
  return trainer.Cadence(
      num_steps=tc.num_steps, log_every=tc.log_every_steps,
      eval_every=tc.eval_every_steps if tc.eval_steps > 0 else 0,
      checkpoint_every=tc.checkpoint_every_steps, keep_checkpoints=tc.keep_checkpoints,
      profile_steps=tc.profile_steps,
      time_budget_minutes=float(tc.get('time_budget_minutes', 0) or 0),
      peak_flops_per_device=float(tc.get('peak_flops_per_device', 0) or 0))


class PretrainingTask(trainer.Task):
  """MLM + NSP on config.data's sources (config: a resolved_config)."""
  program = 'train.py'
  name = 'pretraining'
  nonfinite_hint = ('lower optimizer.learning_rate, raise optimizer.warmup_steps or train '
                    'in float32 (model.dtype)')

  def __init__(self, config, mesh, run: RunDir):
    self.config, self.mesh, self.seed = config, mesh, config.seed
    self.cadence = cadence(config)
    program = train_lib.pretraining_program(config, mesh)
    self.step_program = program
    self.model, self.tx, self.schedule = program.model, program.tx, program.schedule
    self.abstract, self.shardings = program.abstract, program.shardings
    self.example_batch = program.batch_shapes
    if config.train.init_checkpoint:
      self.init_checkpoint = trainer.InitCheckpoint(config.train.init_checkpoint)
    self._make_input = make_input_fn(config, str(run))  # prepares the data (under the lock)
    self.train_iter = self._make_input('train', config.seed)
    self._eval_step = train_lib.make_eval_step(
        program.loss_fn, mesh=mesh, params_sharding=program.shardings.params,
        metrics_cls=metrics_lib.PretrainingEvalMetrics)
    self._label_counts = train_lib.make_label_counts(mesh, config.model.vocab_size)
    self._baselines: Dict[str, float] = {}  # majority predictors on the eval batches

  # ---- Data state.

  def data_items(self):
    return ('data',)

  def data_checkpoint_args(self, mode: str) -> Dict[str, Any]:
    it = self.train_iter
    if isinstance(it, train_lib.SyntheticPretrainingData):
      return {'data': ocp.args.JsonSave(it.get_state()) if mode == 'save' else
                      ocp.args.JsonRestore()}
    from data import pipeline  # pylint: disable=g-import-not-at-top
    return {'data': pipeline.iterator_checkpoint_args(it, mode)}

  def restore_data(self, restored):
    if isinstance(self.train_iter, train_lib.SyntheticPretrainingData):
      self.train_iter.set_state(restored['data'])

  # ---- Training.

  def compile_train_step(self):
    return self.step_program.train_step

  def batches(self, start_step: int):
    del start_step  # the stream's own position (restored) says where it is
    tc, data = self.config.train, self.config.data
    cost = trainer.StepCost(
        examples=tc.batch_size, padded_tokens=tc.batch_size * data.max_seq_length,
        flops=self.step_program.flops_per_example * tc.batch_size)
    while True:
      yield train_lib.global_batch(next(self.train_iter), self.mesh), cost

  # ---- Evaluation.

  def evaluate(self, params, step: int) -> trainer.Results:
    eval_iter = self._make_input('eval', self.config.seed)  # the same batches every time
    collected, counts = None, None
    for _ in range(self.config.train.eval_steps):
      batch = train_lib.global_batch(next(eval_iter), self.mesh)
      collected = metrics_lib.merge(collected, self._eval_step(params, batch))
      if not self._baselines:
        counted = self._label_counts(batch)
        counts = counted if counts is None else jax.tree.map(lambda a, b: a + b, counts,
                                                             counted)
    if not self._baselines:
      self._baselines.update(train_lib.majority_baselines(counts))
    return {'eval': dict(metrics_lib.to_floats(collected), **self._baselines)}

