r"""Pretrain a BERT-style encoder with masked language modelling + next sentence prediction.

  python train.py --workdir /tmp/bert_tiny       # postln,tiny on the embedded corpus (CPU)
  python train.py --config configs/pretrain.py:realformer,base --workdir DIR \
      --config.mesh.fsdp=8 --config.model.dtype=bfloat16

Everything comes from the config (configs/pretrain.py; unknown keys are errors): mesh
(data x fsdp x tensor), batch, accumulation, optimizer, checkpoints. Running the same command
again continues the run in DIR (checkpoints.py states the restart order). Outputs in DIR:
config.json, checkpoints/<step>/{state,data}, TensorBoard events, metrics.jsonl (one JSON
line per logged step and split; see realformer/metrics.py), machine.jsonl (the machine of
each start: realformer/machine.py). docs/launching.md shows TPU pod
and GPU cluster launches. `config.data.sources=synthetic` trains on random tokens of the
same format (throughput checks only).
"""

import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import app
from absl import flags
from absl import logging
from clu import periodic_actions
from ml_collections import config_flags

from realformer import checkpoints
from realformer import cli
from realformer import config_checks
from realformer import distributed
from realformer import host_memory
from realformer import machine
from realformer import metrics as metrics_lib
from realformer import partitioning
from realformer import train_lib
from realformer import workdir as workdir_lib
from realformer.spec import resolve

_REPO = os.path.dirname(os.path.abspath(__file__))
with cli.config_overrides():  # an unknown --config.<key> fails here: one line
  config_flags.DEFINE_config_file(
      'config', os.path.join(_REPO, 'configs', 'pretrain.py') + ':postln,tiny',
      'Config file and its argument, e.g. configs/pretrain.py:realformer,base', lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and config.json.')
distributed.define_flags()
flags.DEFINE_string('compile_for', None,
                    'Compile the train step ahead of time instead of training, and print '
                    'memory per chip, FLOPs and collectives (realformer/launch.py): a TPU '
                    'slice such as v5p:4x4x4 or v5e:2x2 (needs requirements-tpu.txt; any '
                    'host), or "local" (this machine\'s devices; then times a few steps).')
flags.DEFINE_bool('find_max_batch', False,
                  'With --compile_for: also search the largest global batch that fits.')
flags.DEFINE_integer('max_compiles', 12,
                     'With --find_max_batch: compiles the search may spend (each one is a '
                     'compile of the step: minutes for a large model).')
flags.DEFINE_integer('batch_multiple', 1,
                     'With --find_max_batch: search only multiples of this global batch.')
flags.DEFINE_integer('measure_steps', 5,
                     'With --compile_for=local: steps to time after compiling (0: none).')
flags.DEFINE_string('launch_json', '', 'With --compile_for: also write the facts as JSON here.')


class NonFiniteLossError(RuntimeError):
  """The loss became nan/inf; the bad state was not saved."""


class TimeBudget:
  """train.time_budget_minutes (Geiping & Goldstein's Cramming): the run trains for that much
  wall time and its learning-rate schedule follows the clock, reaching zero when the time is
  spent, so a slower variant gets fewer steps of the same schedule.

  Progress is max(step / num_steps, time spent / budget): the configured schedule (warm-up,
  decay) is read at that fraction of num_steps, which stays an upper bound. Time is counted
  from the end of the first (compiling) step, without evaluation (checkpoint saves, mostly
  asynchronous, count); it is saved beside each
  checkpoint (time_spent.json), so a resumed run continues the budget. On several hosts,
  process 0's clock decides. A budgeted run is not bit-reproducible (its steps follow the
  clock).
  """
  FILE = 'time_spent.json'

  def __init__(self, config, schedule, workdir: str, start_step: int):
    tc = config.train
    self.seconds = float(tc.time_budget_minutes) * 60
    self.num_steps = tc.num_steps
    grid = np.linspace(0.0, tc.num_steps, 2049)  # the schedule, tabulated once
    self._grid = grid
    self._table = np.asarray(jax.vmap(schedule)(grid)) / float(config.optimizer.learning_rate)
    self._path = os.path.join(workdir, self.FILE)
    self._record = {}
    if os.path.exists(self._path):
      with open(self._path) as f:
        self._record = json.load(f)
    self.before = float(self._record.get(str(start_step), 0.0))
    if start_step and str(start_step) not in self._record:
      logging.warning('no time record for step %d in %s: counting the budget from 0 again',
                      start_step, self._path)
    self._clock_from, self._excluded, self.spent = None, 0.0, self.before

  def start(self):
    self._clock_from = time.time()

  def exclude(self, seconds: float):
    self._excluded += seconds

  SYNC_EVERY = 10  # steps between agreements of the hosts on the time spent

  def update(self, step: int) -> float:
    """Time spent so far. On several hosts, process 0's, agreed every SYNC_EVERY steps
    (the factor and the stop must be the same everywhere; a broadcast every step would
    block each step on the hosts' slowest)."""
    spent = self.before
    if self._clock_from is not None:
      spent += time.time() - self._clock_from - self._excluded
    if jax.process_count() > 1:
      if step % self.SYNC_EVERY:
        return self.spent
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      spent = float(multihost_utils.broadcast_one_to_all(np.float64(spent)))
    self.spent = spent
    return spent

  def factor(self, step: int) -> np.ndarray:
    progress = min(1.0, max(step / self.num_steps, self.spent / self.seconds))
    return np.float32(np.interp(progress * self.num_steps, self._grid, self._table))

  def over(self) -> bool:
    return self.spent >= self.seconds

  def save(self, step: int):
    self._record[str(step)] = self.spent
    if jax.process_index() == 0:
      with open(self._path + '.tmp', 'w') as f:
        json.dump(self._record, f)
      os.replace(self._path + '.tmp', self._path)


# --------------------------------------------------------------------------------------
# Setup: config, tokenizer, mesh.
# --------------------------------------------------------------------------------------

def resolved_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """An unlocked copy with model.vocab_size set from the tokenizer (not for 'synthetic'),
  after the checks of everything the config alone shows (one-line errors, before any
  preparation or compile)."""
  config = config.copy_and_resolve_references()
  config_checks.check_config(config)
  if config.data.sources != 'synthetic':
    from data import tokenizer as tokenizer_lib
    config.model.vocab_size = tokenizer_lib.load_for_config(config.data).vocab_size
    resolve(config.model)  # with the tokenizer's vocabulary
  return config


def make_input_fn(config, workdir: str):
  """(split, seed) -> this host's iterator of numpy batches (global batch / process count).

  The real pipeline prepares its shards once (process 0 writes, the others wait)."""
  kw = dict(global_batch_size=config.train.batch_size,
            process_index=jax.process_index(), process_count=jax.process_count())
  if config.data.sources == 'synthetic':
    return lambda split, seed: train_lib.SyntheticPretrainingData(
        vocab_size=config.model.vocab_size, seq_len=config.data.max_seq_length,
        num_predictions=config.data.max_predictions_per_seq, seed=seed + (split == 'eval'),
        **kw)
  from data import pipeline
  from data import tokenizer as tokenizer_lib
  tokenizer = tokenizer_lib.load_for_config(config.data)
  prepared_dir = pipeline.ensure_prepared(config, workdir)
  return lambda split, seed: pipeline.make_pretraining_iterator(
      config.data, tokenizer, prepared_dir, split=split, seed=seed, **kw)


def data_checkpoint_args(it, mode: str):
  """Orbax args that save ('save') or restore in place ('restore') the iterator's state."""
  if isinstance(it, train_lib.SyntheticPretrainingData):
    return ocp.args.JsonSave(it.get_state()) if mode == 'save' else ocp.args.JsonRestore()
  from data import pipeline
  return pipeline.iterator_checkpoint_args(it, mode)


def set_data_state(it, restored):
  if isinstance(it, train_lib.SyntheticPretrainingData):
    it.set_state(restored)


# --------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       devices=None) -> dict:
  """Pretrain per `config` in `workdir` (resuming if it holds a checkpoint).

  devices: the devices of the mesh (default: all of jax.devices()).
  Returns the last logged train metrics and eval metrics ({'train': {...}, 'eval': {...}}).
  Raises NonFiniteLossError when the loss becomes nan/inf (nothing bad is saved).
  """
  if not workdir:
    raise ValueError('--workdir is required: the directory for checkpoints and logs')
  workdir = os.path.abspath(os.path.expanduser(workdir))
  config = resolved_config(config)
  mesh = partitioning.make_mesh(config.mesh, devices)
  train_lib.check_batch_layout(config.train.batch_size, config.train.grad_accum_steps, mesh,
                               jax.process_count())
  with workdir_lib.Lock(workdir, 'train.py'):  # before anything is written
    workdir_lib.check_resume_config(workdir, config, checkpoints.has_complete_step(workdir))
    return _train_and_evaluate(config, workdir, mesh)


def _train_and_evaluate(config, workdir: str, mesh) -> dict:
  tc = config.train
  is_chief = jax.process_index() == 0
  logging.info('mesh %s over %d devices, %d processes', dict(mesh.shape), jax.device_count(),
               jax.process_count())

  # ---- Model, optimizer, shardings, the jitted step (nothing allocated yet). ----
  program = train_lib.pretraining_program(config, mesh)
  model, tx = program.model, program.tx
  batch_shapes, abstract, shardings = program.batch_shapes, program.abstract, program.shardings
  seq_len = config.data.max_seq_length

  # ---- Restart: this workdir's checkpoint, else init_checkpoint params, else scratch. ----
  make_input = make_input_fn(config, workdir)
  train_iter = make_input('train', config.seed)
  manager = checkpoints.make_manager(workdir, keep=tc.keep_checkpoints)
  latest = checkpoints.latest_complete_step(manager)
  if latest is not None:
    if latest > tc.num_steps:
      raise ValueError(f'{workdir} holds a checkpoint at step {latest}, past '
                       f'train.num_steps={tc.num_steps}; give train.num_steps >= {latest} '
                       '(a run may be extended on resume, not shortened)')
    logging.info('resuming from %s/checkpoints/%d', workdir, latest)
    tree, data_state = checkpoints.restore(manager, latest, abstract.to_checkpoint(),
                                           data_checkpoint_args(train_iter, 'restore'))
    state = train_lib.TrainState.from_checkpoint(tree)
    set_data_state(train_iter, data_state)
  else:
    state, _ = train_lib.create_train_state(model, tx, batch_shapes, mesh, config.seed)
    if tc.init_checkpoint:
      params, missing = checkpoints.restore_params(tc.init_checkpoint, abstract.params)
      params = jax.tree.map(lambda new, old: old if new is None else new, params,
                            state.params, is_leaf=lambda x: x is None)
      state = state.replace(params=params, opt_state=jax.jit(
          tx.init, out_shardings=shardings.opt_state)(params))
      logging.info('initialized params from %s (%d kept fresh)', tc.init_checkpoint,
                   len(missing))
  start_step = int(state.step)
  # Every check has passed (config, model, checkpoint): the workdir now describes this run.
  checkpoints.write_config(workdir, config)
  machine.record(workdir)
  writer = metrics_lib.create_writer(workdir, jax.process_index())

  # ---- Compiled steps. ----
  train_step, loss_fn = program.train_step, program.loss_fn
  eval_step = train_lib.make_eval_step(loss_fn, mesh=mesh, params_sharding=shardings.params,
                                       metrics_cls=metrics_lib.PretrainingEvalMetrics)

  budget = (None if program.budget_schedule is None else
            TimeBudget(config, program.budget_schedule, workdir, start_step))

  def evaluate(step: int) -> dict:
    started = time.time()
    try:
      return _evaluate(step)
    finally:
      if budget is not None:  # evaluation does not spend the training budget
        budget.exclude(time.time() - started)

  label_counts = train_lib.make_label_counts(mesh, config.model.vocab_size)
  baselines = {}  # the majority predictors' accuracies on the evaluation batches (fixed)

  def _evaluate(step: int) -> dict:
    eval_iter = make_input('eval', config.seed)  # the same batches at every evaluation
    collected, counts = None, None
    for _ in range(tc.eval_steps):
      batch = train_lib.global_batch(next(eval_iter), mesh)
      collected = metrics_lib.merge(collected, eval_step(state.params, batch))
      if not baselines:
        counts = jax.tree.map(lambda a, b: a + b, counts, label_counts(batch)) if counts else (
            label_counts(batch))
    if not baselines:
      baselines.update(train_lib.majority_baselines(counts))
    values = dict(metrics_lib.to_floats(collected), **baselines)
    writer.write_scalars(step, {f'eval/{k}': v for k, v in values.items()})
    writer.flush()
    return values

  # ---- Performance bookkeeping. ----
  flops = program.flops_per_example
  peak = metrics_lib.peak_flops_per_device(mesh.devices.flat[0],
                                           config.train.get('peak_flops_per_device', None))
  report = periodic_actions.ReportProgress(num_train_steps=tc.num_steps, writer=writer,
                                           every_steps=tc.log_every_steps, every_secs=None)
  hooks = [report]
  if tc.profile_steps and is_chief:
    hooks.append(periodic_actions.Profile(logdir=workdir, num_profile_steps=tc.profile_steps,
                                          first_profile=start_step + 10, every_secs=None))

  def check_finite(step: int, collected_step):
    # The gradient too: a finite loss with an inf gradient has already made the new
    # parameters nan, which the next save would write.
    loss = float(np.asarray(collected_step.loss.compute()))
    grad_norm = float(np.asarray(collected_step.grad_norm.compute()))
    what, value = ('loss', loss) if not np.isfinite(loss) else ('gradient norm', grad_norm)
    if not np.isfinite(value):
      manager.wait_until_finished()
      last = manager.latest_step()
      where = (f'the last good checkpoint is step {last} in {manager.directory}'
               if last is not None else 'no checkpoint was written')
      raise NonFiniteLossError(
          f'{what} became {value} at step {step}; {where}; lower optimizer.learning_rate, '
          f'raise optimizer.warmup_steps or train in float32 (model.dtype)')

  def save(step: int):
    checkpoints.save(manager, step, state.to_checkpoint(),
                     data_checkpoint_args(train_iter, 'save'), force=True)
    if budget is not None:
      budget.save(step)

  # ---- The loop. ----
  summary = {'train': {}, 'eval': {}}
  window, pending = None, None  # metrics since the last log; the unchecked step
  timed_from, window_start = start_step, time.time()
  step = start_step
  with jax.set_mesh(mesh), workdir_lib.StopSignal() as stop:
    while step < tc.num_steps and not (budget is not None and budget.over()):
      batch = train_lib.global_batch(next(train_iter), mesh)
      if budget is None:
        state, step_metrics = train_step(state, batch)
      else:
        state, step_metrics = train_step(state, batch, budget.factor(step))
      step += 1
      if pending is not None:  # check the previous step while this one runs
        check_finite(*pending)
      pending = (step, step_metrics)
      window = metrics_lib.merge(window, step_metrics)
      for hook in hooks:
        hook(step)
      if step == start_step + 1:  # leave compilation out of the throughput
        check_finite(*pending)
        timed_from, window_start = step, time.time()
        if budget is not None:
          budget.start()
      preempted = stop.reached(manager, step)
      last = step == tc.num_steps
      if budget is not None:
        budget.update(step)
        last = last or budget.over()
      if step % tc.log_every_steps == 0 or last:
        check_finite(*pending)
        values = metrics_lib.to_floats(window)
        if budget is not None:
          values['budget_spent_fraction'] = budget.spent / budget.seconds
        now = time.time()
        if step > timed_from:
          values.update(metrics_lib.throughput(
              steps=step - timed_from, seconds=now - window_start,
              global_batch_size=tc.batch_size, seq_len=seq_len, flops_per_example=flops,
              num_devices=mesh.size, peak_flops=peak))
        writer.write_scalars(step, values)
        writer.flush()
        summary['train'] = values
        window, timed_from, window_start = None, step, now
      if step % tc.checkpoint_every_steps == 0 or last or preempted:
        check_finite(*pending)
        save(step)
      if tc.eval_steps > 0 and (step % tc.eval_every_steps == 0 or last):
        check_finite(*pending)
        summary['eval'] = evaluate(step)
      if preempted:
        logging.warning('stop signal: saved step %d in %s; run the same command to resume',
                        step, manager.directory)
        summary['preempted'] = step
        break
      if last:
        break
  if budget is not None:
    summary['time_budget'] = {'minutes': budget.seconds / 60, 'spent_minutes':
                              budget.spent / 60, 'steps': step}
    if budget.over():
      logging.info('time budget of %.1f minutes spent after step %d of at most %d',
                   budget.seconds / 60, step, tc.num_steps)
  manager.wait_until_finished()
  manager.close()
  writer.close()
  return summary


# --------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------

# Kept under its old name: tests and scripts launch processes through it.
maybe_initialize_distributed = distributed.maybe_initialize


def check_launch():
  """--compile_for: compile the step for a TPU slice or the local devices and report."""
  from realformer import launch

  launch.ensure_unlimited_stack(sys.argv)  # XLA:TPU's compiler may need more than 8 MiB

  def compile_and_report():
    if flags.FLAGS.compile_for != 'local':
      launch.tpu_target(flags.FLAGS.compile_for)  # errors and the CPU host, before jax starts
    else:  # every host of a multi-host TPU VM or SLURM job, as train.py would see them
      distributed.initialize_from_flags()
    launch.run(resolved_config(flags.FLAGS.config), flags.FLAGS.compile_for,
               max_batch=flags.FLAGS.find_max_batch, measure_steps=flags.FLAGS.measure_steps,
               json_path=flags.FLAGS.launch_json, max_compiles=flags.FLAGS.max_compiles,
               batch_multiple=flags.FLAGS.batch_multiple)
  cli.run_main(compile_and_report, also=(OSError,))


def main(argv):
  logging.get_absl_handler().addFilter(cli.QuietLibraries())
  if len(argv) > 1:
    cli.fail(f'unexpected arguments {argv[1:]}; settings go in --config.*')
  if flags.FLAGS.compile_for:
    check_launch()
    return
  for name in ('find_max_batch', 'launch_json', 'max_compiles', 'batch_multiple'):
    if flags.FLAGS[name].present:
      cli.fail(f'--{name} needs --compile_for (a TPU slice such as v5e:2x2, or '
                           f'local); without it train.py trains')
  if not flags.FLAGS.workdir:
    cli.fail('--workdir is required: the directory for checkpoints and logs '
                         '(e.g. --workdir /tmp/bert_tiny)')
  host_memory.keep_freed_memory()  # CPU-only runs: no page faults per step (logs if applied)
  distributed.initialize_from_flags()
  workdir_lib.exit_on_sigterm()  # the loop's own handler saves first
  summary = cli.run_main(train_and_evaluate, flags.FLAGS.config, flags.FLAGS.workdir,
                         also=(NonFiniteLossError,))
  if 'preempted' in summary:
    workdir_lib.exit_not_finished(summary['preempted'])
  logging.info('done: %s', summary)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
