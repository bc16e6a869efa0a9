"""The one training loop, shared by pretraining (MLM + NSP), GLUE and SQuAD fine-tuning.

A `Task` supplies what differs between them (its contract fits on one screen: see the
class): the program (train_lib.Program: model, optimizer and schedule, state and its
shardings, init, train and eval steps, FLOPs per example), the batches (fixed-length or
length-bucketed), the evaluation, the input's position a checkpoint keeps, and what a
finished run writes (predictions, results). The `Trainer` owns the rest, once for every
program:

  restart order   1. this run's newest complete checkpoint: the train state and the task's
                     data state, so the run continues exactly where it stopped;
                  2. else the params of a finished run whose optimizer state was dropped
                     (<run>/final): the run is over and is finished again (its outputs
                     written anew); the resume check has made sure its config is the same;
                  3. else the task's init checkpoint: params only (a subtree of them, for
                     fine-tuning's encoder), then a fresh optimizer state for those params;
                  4. else a seeded init.
  ownership       the run directory's lock and resume check before anything is written
                  (train(): before the task is even built); config.json and machine.jsonl
                  once every check of the start has passed.
  the loop        one jitted step per batch; a non-finite loss or gradient norm stops the run
                  (NonFiniteLossError) before anything computed from it is saved or evaluated:
                  each step's values are checked while the next step runs;
                  logging every `log_every` steps, at the end, at the end of each evaluation
                  period (an epoch) when it is named, and when stopping (TensorBoard under
                  train/ and eval splits, and metrics.jsonl): the train metrics averaged over
                  the window, steps/s, examples/s, tokens/s, TFLOP/s per device and MFU, the
                  first step of a start (compilation), evaluations and checkpoint saves left
                  out; evaluation every `eval_every` steps and at the end (also of a run
                  resumed at its end, or cut to it); the best evaluation's params kept in <run>/best when
                  asked; a checkpoint every `checkpoint_every` steps and at the end;
                  SIGTERM (preemption): save the current step and return {'preempted': step},
                  which run_program turns into exit status 75 (a signal at the last step
                  lets the run finish);
                  a time budget (Cramming): train for so many minutes, the learning-rate
                  schedule following the clock (TimeBudget).
  teardown        the finished run's evaluation; optionally the optimizer state dropped
                  (final/ keeps the params); then the task's outputs, whose results file
                  says the run is over; writers and the checkpoint manager closed.
"""

import abc
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import tempfile
import time
import zlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from realformer import cli
from realformer import platforms
from realformer import storage
from realformer.model import attention as attention_lib
from realformer.train import checkpoints
from realformer.train import compile_cache
from realformer.train import distributed
from realformer.train import host_memory
from realformer.train import metrics as metrics_lib
from realformer.train import metrics_jsonl
from realformer.train import partitioning
from realformer.train import train_lib
from realformer.train import workdir as workdir_lib
from realformer.train.run_dir import RunDir

TrainState = train_lib.TrainState
Results = Dict[str, Dict[str, float]]  # {log split, e.g. 'eval' or 'dev_rte': {name: value}}


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became nan/inf; nothing computed from it was saved."""


@dataclasses.dataclass(frozen=True)
class Cadence:
  """When the loop logs, evaluates and saves, and how long it runs (steps count updates)."""
  num_steps: int
  log_every: int
  eval_every: int                      # 0: no evaluation
  checkpoint_every: int
  keep_checkpoints: Optional[int] = 3  # None: keep every checkpoint
  profile_steps: int = 0               # a profile of this many steps after warm-up
  time_budget_minutes: float = 0.0     # > 0: train that long (TimeBudget)
  peak_flops_per_device: float = 0.0   # 0: looked up from the device kind (for MFU)
  keep_best: bool = False              # <run>/best: params of the best task.headline
  keep_optimizer_state: bool = True    # False: a finished run keeps params only (final/)
  eval_period_name: str = ''           # e.g. 'epoch': log train/epoch_seconds per period
  # The config field that sets num_steps, in units of this many steps (for error messages).
  steps_setting: str = 'train.num_steps'
  steps_per_unit: int = 1

  def still_to_come(self, step: int, every: int) -> int:
    """How many evaluations or saves (those of `every` steps, and the last step's) come
    from step `step` on, that one's included."""
    if every <= 0 or step > self.num_steps:
      return 0
    return (self.num_steps // every - (max(step, 1) - 1) // every +
            (self.num_steps % every != 0))

  def check(self):
    for name in ('num_steps', 'log_every', 'checkpoint_every'):
      if getattr(self, name) <= 0:
        raise ValueError(f'{name}={getattr(self, name)}: give a positive number of steps')
    if self.eval_every < 0:
      raise ValueError(f'eval_every={self.eval_every}: give a number of steps (0: never)')
    if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
      raise ValueError(f'keep_checkpoints={self.keep_checkpoints}: keep at least 1 (None: all)')


def make_cadence(fields, steps_per_epoch: int = 0) -> Cadence:
  """The Cadence that a config section's fields set (config.train for pretraining, the
  whole config for fine-tuning), the same names everywhere: log_every_steps,
  profile_steps, peak_flops_per_device, keep_best, keep_optimizer_state and, by steps,
  num_steps, eval_every_steps (with eval_steps > 0), checkpoint_every_steps,
  keep_checkpoints, time_budget_minutes; or, by epochs of `steps_per_epoch` steps,
  num_epochs: an evaluation and the one resume checkpoint at the end of every epoch."""
  get = lambda name, default: fields.get(name, default) or default
  common = dict(log_every=fields.log_every_steps,
                profile_steps=int(get('profile_steps', 0)),
                peak_flops_per_device=float(get('peak_flops_per_device', 0.0)),
                keep_best=bool(get('keep_best', False)),
                keep_optimizer_state=bool(fields.get('keep_optimizer_state', True)))
  if steps_per_epoch:
    return Cadence(num_steps=steps_per_epoch * fields.num_epochs, eval_every=steps_per_epoch,
                   checkpoint_every=steps_per_epoch, keep_checkpoints=1,
                   eval_period_name='epoch', steps_setting='num_epochs',
                   steps_per_unit=steps_per_epoch, **common)
  return Cadence(num_steps=fields.num_steps,
                 eval_every=fields.eval_every_steps if fields.get('eval_steps', 1) > 0 else 0,
                 checkpoint_every=fields.checkpoint_every_steps,
                 keep_checkpoints=fields.keep_checkpoints,
                 time_budget_minutes=float(get('time_budget_minutes', 0.0)), **common)


@dataclasses.dataclass(frozen=True)
class InitCheckpoint:
  """Where a fresh run takes its params from (restart order, step 3)."""
  path: str
  subtree: Tuple[str, ...] = ()  # where in the model's params the checkpoint's go
  allow_missing: bool = True     # parameters the checkpoint lacks keep their fresh init


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What one step processed, for the throughput log (its FLOPs: the program's
  flops_per_example(length) for each example)."""
  examples: int
  length: int                        # the batch's padded sequence length
  real_tokens: Optional[int] = None  # None: not counted (tokens_per_s counts padding)


class DataState(abc.ABC):
  """The input's position, kept in each checkpoint (its 'data' item) so that a resumed run
  reads on exactly where it stopped."""

  @abc.abstractmethod
  def checkpoint_args(self, mode: str) -> Any:
    """The Orbax args that save ('save') or restore ('restore') the position."""

  def restored(self, value) -> None:
    """Takes the restored item (nothing to do for args that restore in place)."""

  def check_restorable(self, step_dir: str) -> None:
    """A one-line error (ValueError) before anything is read if the position kept in
    `step_dir` (a checkpoint's step folder) cannot be restored by this start."""


class Task(abc.ABC):
  """What a program trains; the trainer does the rest. A subclass sets in __init__

    name      the task's name for logs and summaries
    config    the run's config (config.json)
    cadence   when the loop logs, evaluates and saves, and how long it runs (make_cadence)
    program   a train_lib.Program: the model, its optimizer and schedule, the abstract state
              and its shardings, init, the train and eval steps, FLOPs per example, the
              peak learning rate

  and may set init_checkpoint (a fresh run's params), data (a DataState: the input position
  each checkpoint keeps) and params_config. It gives the batches and its evaluation, and may
  say which evaluation is best (headline, best_record), what a finished run writes
  (finish), and act once the start step is known (prepare) and when the run ends (close).
  `command` and `checked_config` are what train() asks of the class before building it
  (a task is built by train(), after its config's checks).
  """
  command: str  # the program's name, for the lock record ('train.py')
  name: str
  config: Any
  cadence: Cadence
  program: train_lib.Program
  init_checkpoint: Optional[InitCheckpoint] = None
  data: Optional[DataState] = None
  # The config.json beside params-only checkpoints (best/, final/); None: self.config.
  params_config: Any = None
  # A run restarted after its last step evaluates again (its outputs need the results).
  needs_final_results: bool = False
  # What to do when the loss or gradient norm becomes nan/inf (ends the error message).
  nonfinite_hint: str = 'lower optimizer.learning_rate'

  @classmethod
  def checked_config(cls, config, mesh):
    """Returns the config the run uses, after one-line errors for everything it alone shows
    (before the run directory is touched)."""
    return config

  @abc.abstractmethod
  def batches(self, start_step: int) -> Iterator[Tuple[Dict[str, jax.Array], StepCost]]:
    """The global batches of steps start_step + 1, start_step + 2, ... with their costs,
    for program.train_step."""

  @abc.abstractmethod
  def evaluate(self, params, step: int) -> Results:
    """Evaluation results by log split (every process takes part; all may compute)."""

  def headline(self, results: Results) -> float:
    """The number that decides the best evaluation (higher is better)."""
    raise NotImplementedError(f'{type(self).__name__} has no headline metric')

  def best_record(self, step: int, results: Results) -> dict:
    """What <run>/best/results.json records of the best evaluation besides its step and
    headline."""
    del step
    return {'results': results}

  def record_headline(self, record: dict) -> float:
    """The headline of a stored best record, by today's rule (a record written under an
    earlier one recorded another number)."""
    return record['headline']

  def finish(self, params, step: int, results: Optional[Results], run: RunDir,
             best: Optional[dict]) -> dict:
    """Outputs of a finished run (predictions, results files); returns summary entries."""
    del params, step, results, run, best
    return {}

  def prepare(self, start_step: int) -> None:
    """Called once the train state is known, before anything is written or any step runs
    (e.g. choose length buckets, and the train step compiled for them)."""

  def close(self) -> None:
    """Called when the run ends, however it ends, from prepare() on (e.g. cancels the
    background compilations still queued)."""


class TimeBudget:
  """Cramming's budget (Geiping & Goldstein 2022): the run trains for cadence.
  time_budget_minutes of wall time and its learning-rate schedule follows the clock,
  reaching its end when the time is spent, so a slower variant gets fewer steps of the
  same schedule.

  Progress is max(step / num_steps, time spent / budget): the configured schedule (warm-up,
  decay) is read at that fraction of num_steps, which stays an upper bound. Time is counted
  from the end of the first step, without evaluation (checkpoint saves, mostly
  asynchronous, count); it is saved beside each checkpoint (<run>/time_spent.json), so a
  resumed run continues the budget. On several hosts, process 0's clock decides, agreed
  every SYNC_EVERY steps. A budgeted run is not bit-reproducible (its steps follow the
  clock).
  """
  SYNC_EVERY = 10
  TABLE = 2 ** 20

  def __init__(self, cadence: Cadence, schedule: optax.Schedule, run: RunDir,
               start_step: int):
    self.seconds = float(cadence.time_budget_minutes) * 60
    self.num_steps = cadence.num_steps
    # The schedule, tabulated once at every step (or, past TABLE steps, at TABLE + 1 even
    # points): read between two steps, it is interpolated, exact at each step.
    self._grid = np.linspace(0.0, self.num_steps, min(self.num_steps, self.TABLE) + 1)
    self._table = np.asarray(jax.vmap(schedule)(self._grid), np.float64)  # (np.interp's)
    self._run = run
    self._record = self.record_of(run)
    recorded = self.recorded_step(self._record, start_step)
    self.before = self.spent_at(self._record, start_step)
    if start_step and recorded != start_step:
      logging.warning('no time record for step %d in %s: counting the budget from %s',
                      start_step, run.path(RunDir.TIME_SPENT),
                      'zero' if recorded is None else f'step {recorded}\'s record')
    self._clock_from, self._excluded, self.spent = None, 0.0, self.before

  @staticmethod
  def record_of(run: RunDir) -> Dict[str, float]:
    """{step: seconds spent by then} of the run's checkpoints (as process 0 reads it)."""
    return distributed.read_on_process_zero(
        lambda: run.read_json(RunDir.TIME_SPENT, {}), f'read {run.path(RunDir.TIME_SPENT)}')

  @staticmethod
  def recorded_step(record: Dict[str, float], step: int) -> Optional[int]:
    """The step whose record counts for `step`: its own, or for a checkpoint without one
    (made before records were written first) the newest before it, which undercounts by
    less than one checkpoint interval; None before the first record."""
    return max((int(k) for k in record if int(k) <= step), default=None)

  @classmethod
  def spent_at(cls, record: Dict[str, float], step: int) -> float:
    """The seconds the run had spent by `step` (recorded_step's record; 0 before any)."""
    recorded = cls.recorded_step(record, step)
    return float(record[str(recorded)]) if recorded is not None else 0.0

  def start(self):
    self._clock_from = time.time()

  def exclude(self, seconds: float):
    self._excluded += seconds

  def update(self, step: int, sync: bool = False) -> float:
    """The budget spent by `step`: this process's clock, or with several processes process
    0's, taken every SYNC_EVERY steps and where `sync` (every process asks it at the same
    steps: the checkpoint steps, whose saves record what all of them will resume from)."""
    spent = self.before
    if self._clock_from is not None:
      spent += time.time() - self._clock_from - self._excluded
    if jax.process_count() > 1:
      if step % self.SYNC_EVERY and not sync:
        return self.spent
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      spent = float(multihost_utils.broadcast_one_to_all(np.float64(spent)))
    self.spent = spent
    return spent

  def learning_rate(self, step: int) -> np.float32:
    """The schedule's learning rate at the run's progress before step + 1."""
    progress = self.progress(step, self.num_steps, self.spent, self.seconds)
    return np.float32(np.interp(progress * self.num_steps, self._grid, self._table))

  @staticmethod
  def progress(step: int, num_steps: int, spent: float, seconds: float) -> float:
    """The share of the run done, where the schedule is read: the larger of the steps' and
    the budget's (`seconds`; 0: none), at most 1."""
    share = step / num_steps
    if seconds > 0:
      share = max(share, spent / seconds)
    return min(1.0, share)

  def over(self) -> bool:
    return self.spent >= self.seconds

  def save(self, step: int):
    """Records the time the loop last read (update), the figure its decision of whether this
    step was the last one used: a checkpoint step's own (the loop syncs there); a stop
    signal's save between two syncs, the last synced one."""
    self._record[str(step)] = self.spent
    self._run.write_json(RunDir.TIME_SPENT, self._record)


class Window:
  """The train metrics and costs of the steps since the last log. Throughput names:
  tokens_per_s counts the real (non-padding) tokens where the task counts them (fine-tuning),
  padded_tokens_per_s then every token computed; where it does not (pretraining, whose
  sequences are mostly full), tokens_per_s counts every token. TFLOP/s and MFU count the
  FLOPs the task gives for each step's batch."""

  def __init__(self):
    self.metrics = None
    self.restart_clock()

  def restart_clock(self):
    """Counts time and costs from now (the metrics so far are kept)."""
    self.start, self.steps, self.examples, self.padded, self.flops = time.time(), 0, 0, 0, 0.0
    self.real: Optional[int] = 0
    self.excluded = 0.0

  def exclude(self, seconds: float):
    """Leaves `seconds` of the window's time out of its throughput (a compilation waited
    for)."""
    self.excluded += seconds

  def add(self, step_metrics, cost: StepCost, flops: float):
    self.metrics = metrics_lib.merge(self.metrics, step_metrics)
    self.steps += 1
    self.examples += cost.examples
    self.padded += cost.examples * cost.length
    self.flops += flops
    self.real = None if cost.real_tokens is None or self.real is None else (
        self.real + cost.real_tokens)

  def values(self, num_devices: int, peak_flops: Optional[float]) -> dict:
    values = metrics_lib.to_floats(self.metrics)
    seconds = time.time() - self.start - self.excluded
    if self.steps and seconds > 0:
      flops_per_device = self.flops / seconds / num_devices
      values.update(steps_per_sec=self.steps / seconds, examples_per_s=self.examples / seconds,
                    tflops_per_device=flops_per_device / 1e12)
      if self.real is None:  # padding counted
        values['tokens_per_s'] = self.padded / seconds
      else:
        values.update(tokens_per_s=self.real / seconds,
                      padded_tokens_per_s=self.padded / seconds)
      if peak_flops:
        values['mfu'] = flops_per_device / peak_flops
    return values


class _Profile:
  """A jax profiler trace of `num_steps` steps from step start + 10 (warmed up) into `logdir`
  (TensorBoard's profile plugin reads it; for a gs:// run the trace is written to a local
  folder, then copied there); process 0 traces, every process takes part (its start and end
  are collectives, distributed.on_process_zero: a trace that fails stops every process);
  nothing when num_steps is 0. A run that ends inside the window ends the trace (the
  context's exit)."""

  def __init__(self, num_steps: int, logdir: str, start: int):
    self.first = start + 10 if num_steps else None
    self.last, self.logdir, self.tracing = start + 10 + num_steps, logdir, False
    self._local = None

  def step(self, step: int):
    if self.first is not None and step == self.first:
      distributed.on_process_zero(self._start, f'start the profile in {self.logdir}')
      self.tracing = True
    elif self.tracing and step == self.last:
      self.close()

  def close(self):
    if self.tracing:
      self.tracing = False
      distributed.on_process_zero(self._stop, f'write the profile to {self.logdir}')

  def __enter__(self):
    return self

  def __exit__(self, error, *_):
    """The loop's end closes the trace with the others (a collective); an error on process
    0 alone, keeping what it can (the others may not come)."""
    if error is None:
      self.close()
    elif self.tracing and jax.process_index() == 0:
      self.tracing = False
      with contextlib.suppress(Exception):
        self._stop()

  def _start(self):
    if storage.is_url(self.logdir):
      self._local = tempfile.mkdtemp(prefix='realformer-profile-')
    jax.profiler.start_trace(self._local or self.logdir)

  def _stop(self):
    jax.profiler.stop_trace()
    if self._local is not None:
      try:
        storage.copy_tree(self._local, self.logdir)
      finally:
        shutil.rmtree(self._local, ignore_errors=True)


class Trainer:
  """Runs a Task in a RunDir (see the module docstring for what it owns), inside the task's
  mesh (train() enters it)."""

  def __init__(self, task: Task, run: RunDir):
    task.cadence.check()
    self.task, self.run_dir, self.cadence = task, run, task.cadence

  # ---- Restart order.

  def _setting_that_trains_further(self, step: int) -> Optional[str]:
    """Where the run ended at `step` (its last step, or a time budget spent by then: the
    record TimeBudget saved with that checkpoint), the config field that would train it
    further; None where it has steps left."""
    c = self.cadence
    if step >= c.num_steps:
      return c.steps_setting
    if c.time_budget_minutes > 0:
      spent = TimeBudget.spent_at(TimeBudget.record_of(self.run_dir), step)
      if spent >= c.time_budget_minutes * 60:
        section = c.steps_setting.rpartition('.')[0]  # (train. of pretraining's fields)
        return f'{section}.time_budget_minutes' if section else 'time_budget_minutes'
    return None

  def _restore_or_init(self) -> TrainState:
    task, run, manager, program = self.task, self.run_dir, self.manager, self.task.program
    latest = checkpoints.latest_complete_step(manager)
    final = run.path(RunDir.FINAL)
    if latest is not None:
      if latest > self.cadence.num_steps:
        c = self.cadence
        raise ValueError(f'{run} holds a checkpoint at step {latest}, past '
                         f'{c.steps_setting}={c.num_steps // c.steps_per_unit}; give '
                         f'{c.steps_setting} >= {-(-latest // c.steps_per_unit)} '
                         '(a run may be shortened on resume, down to its newest checkpoint)')
      larger = self._setting_that_trains_further(latest)
      if larger:
        logging.info('the run finished at step %d (%s): nothing is left to train (a larger %s '
                     'trains it further)', latest, manager.directory / str(latest), larger)
      else:
        logging.info('resuming from step %d (%s)', latest, manager.directory / str(latest))
      if task.data is not None:  # (every host's own check: all go on, or none)
        distributed.on_every_process(
            lambda: task.data.check_restorable(str(manager.directory / str(latest))),
            f'check the input position saved at step {latest}')
      try:
        tree, data = checkpoints.restore(manager, latest, program.abstract.to_checkpoint(),
                                         self._data_args('restore'))
        if task.data is not None:
          task.data.restored(data['data'])
      except Exception as e:  # pylint: disable=broad-except  (a damaged step: one line)
        error = checkpoints.unreadable(str(run), latest, e)
        if error is e:
          raise
        raise error from e
      if run.resumed_from:  # (a resume with settings changed; the same on every process)
        _say_if_the_rate_moves(run.resumed_from, task, latest,
                               TimeBudget.spent_at(TimeBudget.record_of(run), latest))
      return TrainState.from_checkpoint(tree)
    if distributed.read_on_process_zero(lambda: checkpoints.has_complete_step(str(final)),
                                        f'read {final}'):  # (one path for every process)
      params, missing = checkpoints.restore_params(str(final), program.abstract.params)
      if missing:
        raise ValueError(f'{final} does not match the model: it has no {missing[0]} '
                         f'({len(missing)} missing); remove {final} to train again')
      step = int(os.path.basename(checkpoints.resolve_step_dir(str(final))))
      logging.info('the run finished at step %d: its final params are in %s', step, final)
      state = program.init(params)
      return state.replace(step=jnp.asarray(step, state.step.dtype))
    init = task.init_checkpoint
    if init is None or not init.path:
      return program.init()
    step_dir = checkpoints.resolve_step_dir(init.path)  # (the newest, as process 0 found it)
    loaded, missing = checkpoints.restore_params(
        step_dir, _subtree(program.abstract.params, init.subtree), subtree=init.subtree)
    if missing and not init.allow_missing:
      raise ValueError(f'checkpoint {init.path} does not match the model: it has no '
                       f'{missing[0]} ({len(missing)} missing)')
    # Only what the checkpoint lacks is drawn (the head; `missing`), with the values a whole
    # init gives it.
    unknown = jax.tree.map(lambda _: None, program.abstract.params)
    state = program.init(_with_subtree(unknown, init.subtree, loaded))
    logging.info('initialized %s from %s%s', '/'.join(init.subtree) or 'params', step_dir,
                 f' ({len(missing)} of them drawn fresh: the checkpoint lacks them)'
                 if missing else '; the rest drawn fresh' if init.subtree else '')
    if not init.subtree:  # whole params: a head of the checkpoint this model has not
      unused = sorted(set(checkpoints.stored_tree(step_dir)['params']) -
                      set(program.abstract.params))
      if unused:
        logging.info('not used from %s: %s (this model has no such head; e.g. NSP\'s, under '
                     'config.objective=mlm)', step_dir, ', '.join(unused))
    _say_if_unfinished(init.path, os.path.basename(step_dir))
    return state

  def _data_args(self, mode: str) -> Dict[str, Any]:
    """The checkpoint's items besides 'state': the task's data state."""
    return {} if self.task.data is None else {'data': self.task.data.checkpoint_args(mode)}

  # ---- The run.

  def run(self) -> dict:
    """Trains to the end (or the budget, or a stop signal); returns the summary:
    {'step', 'train': last logged values, 'eval': last results, ...task.finish's entries,
    'preempted': step (stopped by a signal after saving), 'time_budget': {...}}."""
    task, run, c = self.task, self.run_dir, self.cadence
    self.started = time.time()
    self.manager = run.checkpoint_manager(
        c.keep_checkpoints, ('state',) + (('data',) if task.data is not None else ()))
    self.state = self._restore_or_init()
    start = int(self.state.step)
    self.writer, self.budget = None, None
    self.results: Optional[Results] = None
    self.last_logged: Dict[str, float] = {}
    # The last evaluation's and save's seconds, for the ETA: 0 until a second one (the first
    # after a start compiles its program and opens its files).
    self.seconds_of = {'evaluation': 0.0, 'save': 0.0}
    self._timed = collections.Counter()
    try:  # (from prepare on: the task may have started work that close() stops)
      task.prepare(start)
      # Every check has passed (config, model, checkpoint): the run directory describes it.
      run.write_config(task.config)
      run.record_machine()
      self.writer = run.metric_writer(start)
      self.best = BestParams(run, task, enabled=c.keep_best, start=start)
      if c.time_budget_minutes > 0:
        self.budget = TimeBudget(c, task.program.schedule, run, start)
      preempted = self._train(start)
      # A save whose lease was lost fails on process 0 alone, which the others would wait
      # for in _finish: the lock first, then the wait, which stops all if it fails on one.
      self.run_dir.check_held()
      distributed.on_every_process(self.manager.wait_until_finished,
                                   f'finish saving the checkpoints of {run}')
      summary = self._finish(preempted)
      compile_cache.log_stats('the run')  # the background compiles and predictions too
    except BaseException as e:
      # The logs so far and a checkpoint being saved are kept (in a bucket, the lines not
      # yet uploaded are the ones before a divergence), unless another run now holds the
      # workdir (its logs and checkpoints are the workdir's); the error raised stays the one
      # reported. (With several processes the save is left: its commit waits for every
      # process, and the others may be stuck in the step that this one left.)
      # A failed save raises again as it is waited for: the logs are closed all the same.
      if not (isinstance(e, workdir_lib.WorkdirInUseError) or self.run_dir.lock_lost()):
        if jax.process_count() == 1:
          with contextlib.suppress(Exception):
            self.manager.close()  # (waits for the save)
        if self.writer is not None:
          with contextlib.suppress(Exception):
            self.writer.close_alone()
      raise
    finally:
      task.close()
    self.run_dir.check_held()  # the logs' last lines are uploaded by close
    self.manager.close()
    self.writer.close()
    return summary

  def _train(self, start: int) -> Optional[int]:
    """The loop, from step `start`; returns the step a stop signal saved, else None."""
    task, c, budget, program = self.task, self.cadence, self.budget, self.task.program
    if start >= c.num_steps:
      return None
    train_step = program.train_step
    rates, rng = train_lib.LearningRates(program.schedule), program.dropout_key()
    waited = getattr(train_step, 'waited', lambda: 0.0)  # compilations, not training
    profile = _Profile(self.cadence.profile_steps, str(self.run_dir), start)
    window, pending, step = Window(), None, start  # pending: the step not yet checked
    first_call = 0.0  # when the first step was called (its batch at hand)
    self.period_start = time.time()
    with workdir_lib.StopSignal() as stop, profile:
      batches = task.batches(start)
      while step < c.num_steps and not (budget is not None and budget.over()):
        batch, cost = next(batches)
        rate = np.float32(rates(step) if budget is None else budget.learning_rate(step))
        if step == start:
          first_call = time.time()
        # (the first call compiles: kept however fast, for a sweep's next run to load)
        with compile_cache.kept() if step == start else contextlib.nullcontext():
          self.state, step_metrics = train_step(self.state, batch, rate, rng)
        window.exclude(waited())
        step += 1
        if pending is not None:  # check the previous step while this one runs
          self._check_finite(*pending)
        pending = (step, step_metrics)
        window.add(step_metrics, cost, program.flops_per_example(cost.length) * cost.examples)
        profile.step(step)
        if step == start + 1:  # compiled and done: throughput and budget count from here
          self._check_finite(*pending)
          logging.info('first step: %.1f s (tracing, compiling or loading, and running it)',
                       time.time() - first_call)
          compile_cache.log_stats('compiling the train step')
          # The host's metric ops (adding two steps' metrics, computing their values)
          # compile at their first use: here, not in the first logged window's time.
          metrics_lib.to_floats(metrics_lib.merge(step_metrics, step_metrics))
          window.restart_clock()
          if budget is not None:
            budget.start()
        last = step == c.num_steps
        if budget is not None:  # (synced where a save follows: it records this figure)
          budget.update(step, sync=step % c.checkpoint_every == 0 or last)
          last = last or budget.over()
        evaluating = c.eval_every > 0 and (step % c.eval_every == 0 or last)
        logging_now = step % c.log_every == 0 or last or (evaluating and
                                                           bool(c.eval_period_name))
        if logging_now or evaluating:
          self._check_finite(*pending)
        if logging_now:
          self._log(step, window, whole_period=evaluating and step - c.eval_every >= start)
          window = Window()
        if evaluating:
          evaluated = time.time()
          self._evaluate(step)
          window.exclude(self._timed_since(evaluated, 'evaluation'))  # (for a stop's log)
        # After the evaluation: a signal that came during it is seen at this step.
        stopping = stop.reached() and not last
        if stopping and not logging_now:  # the steps since the last log, before leaving
          self._check_finite(*pending)
          self._log(step, window, whole_period=False)
        if step % c.checkpoint_every == 0 or last or stopping:
          self._check_finite(*pending)
          saving = time.time()
          self._save(step)
          window.exclude(self._timed_since(saving, 'save'))  # (not training time either)
        if stopping:
          return step
        if evaluating:  # evaluation is not training time (the window's metrics stay)
          window.restart_clock()
          self.period_start = time.time()
    return None

  def _timed_since(self, start: float, what: str) -> float:
    """The seconds since `start` of an evaluation or a save, kept for the ETA from the second
    of its kind on."""
    seconds = time.time() - start
    self._timed[what] += 1
    if self._timed[what] > 1:
      self.seconds_of[what] = seconds
    return seconds

  def _check_finite(self, step: int, step_metrics):
    # The gradient too: a finite loss with an inf gradient has already made the new
    # parameters nan, which the next save would write.
    for name, what in (('loss', 'loss'), ('grad_norm', 'gradient norm')):
      value = float(np.asarray(getattr(step_metrics, name).compute()))
      if not np.isfinite(value):
        self.manager.wait_until_finished()
        last = self.manager.latest_step()
        where = (f'the last good checkpoint is step {last} in {self.manager.directory}'
                 if last is not None else 'no checkpoint was written')
        peak = self.task.program.peak_learning_rate
        raise NonFiniteLossError(f'{what} became {value} at step {step}; {where}; the peak '
                                 f'learning rate is {peak:g}: {self.task.nonfinite_hint}')

  def _log(self, step: int, window: 'Window', whole_period: bool):
    """The window's train metrics and throughput, to the writer and the log."""
    self.run_dir.check_held()  # a run whose lease was lost writes nothing more
    # A checkpoint's save in the background that failed (a full disk) stops the run now, not
    # at the next save, which may be thousands of steps on.
    distributed.on_every_process(self.manager.check_for_errors,
                                 f'save a checkpoint of {self.run_dir}')
    c, mesh = self.cadence, self.task.program.mesh
    values = window.values(mesh.size, metrics_lib.peak_flops_per_device(
        mesh.devices.flat[0], c.peak_flops_per_device))
    values['uptime'] = time.time() - self.started  # seconds since this process started the run
    if self.budget is not None:
      values['budget_spent_fraction'] = self.budget.spent / self.budget.seconds
    if whole_period and c.eval_period_name:  # a whole period (epoch) ran in this process
      values[f'{c.eval_period_name}_seconds'] = time.time() - self.period_start
    self.writer.write_scalars(step, {f'train/{k}': v for k, v in values.items()})
    self.writer.flush()
    if self.budget is not None:  # its run ends when the budget is spent (num_steps bounds it)
      seconds_left = max(0.0, self.budget.seconds - self.budget.spent)
    elif 'steps_per_sec' in values:  # the steps, and the evaluations and saves still to come
      seconds_left = ((c.num_steps - step) / values['steps_per_sec'] +
                      c.still_to_come(step, c.eval_every) * self.seconds_of['evaluation'] +
                      c.still_to_come(step, c.checkpoint_every) * self.seconds_of['save'])
    else:
      seconds_left = None
    _log_progress(step, c.num_steps, values, seconds_left)
    self.last_logged = values

  def _evaluate(self, step: int):
    started = time.time()
    self.results = self.task.evaluate(self.state.params, step)
    self.run_dir.check_held()  # a lease lost during a long evaluation: nothing is written
    for split, values in self.results.items():
      self.writer.write_scalars(step, {f'{split}/{k}': v for k, v in values.items()})
      logging.info('step %d %s: %s', step, split, metrics_lib.format_scalars(values))
    self.writer.flush()
    self.best.offer(self.state.params, step, self.results)  # before the resume point moves
    if self.budget is not None:  # evaluation does not spend the training budget
      self.budget.exclude(time.time() - started)

  def _save(self, step: int):
    self.run_dir.check_held()
    # The logs up to a checkpoint reach a bucket before it (and a storage that stopped
    # answering is found here, before a checkpoint is begun).
    self.writer.flush(force=True)
    if self.budget is not None:  # first: a checkpoint never commits without its time record
      self.budget.save(step)
    checkpoints.save(self.manager, step, self.state.to_checkpoint(), self._data_args('save'),
                     force=True)

  def _logged(self, step: int) -> Results:
    """What metrics.jsonl holds for `step`, {split: {name: value}} (a finished run started
    again trains and evaluates nothing: its summary is what it logged), as process 0 reads
    it (a collective)."""
    path = self.run_dir.path(RunDir.METRICS)
    return distributed.read_on_process_zero(lambda: metrics_jsonl.logged_at(str(path), step),
                                            f'read {path}')

  def _finish(self, preempted: Optional[int]) -> dict:
    """The summary; a finished run's last evaluation, outputs and lean params."""
    task, c = self.task, self.cadence
    self.run_dir.check_held()  # what follows writes results, predictions, final/
    step = int(self.state.step)
    logged = ({} if preempted is not None or (self.last_logged and self.results) else
              self._logged(step))
    summary: Dict[str, Any] = {'step': step,
                               'train': self.last_logged or logged.get('train', {})}
    if self.budget is not None:
      summary['time_budget'] = {'minutes': self.budget.seconds / 60,
                                'spent_minutes': self.budget.spent / 60, 'steps': step}
      if self.budget.over():
        logging.info('time budget of %.1f minutes spent after step %d of at most %d',
                     self.budget.seconds / 60, step, c.num_steps)
    if preempted is not None:
      logging.warning('stop signal: saved step %d in %s; run the same command to resume',
                      preempted, self.manager.directory)
      return dict(summary, preempted=preempted, eval=self.results or {})
    evaluated = any(split != 'train' for split in logged)  # (at this step, earlier)
    # Resumed at the end (or cut to it: a shorter num_steps or time budget), nothing evaluated
    # in this process: the end is evaluated as the loop would have, if the run evaluates.
    if self.results is None and (task.needs_final_results or
                                 (c.eval_every > 0 and not evaluated)):
      if evaluated:  # logged already: evaluated again only for the outputs
        self.results = task.evaluate(self.state.params, step)
      else:
        self._evaluate(step)
    summary['eval'] = self.results or {k: v for k, v in logged.items() if k != 'train'}
    if (not c.keep_optimizer_state and
        checkpoints.latest_complete_step(self.manager) is not None):
      _drop_optimizer_state(self.manager, self.state.params, step, self.run_dir, self.best,
                            task)
    # The task's outputs last: a results file says the run is over (a sweep skips it), so a
    # stop before it (a SIGTERM while final/ is written) leaves a run that the same command
    # finishes.
    summary.update(task.finish(self.state.params, step, self.results, self.run_dir,
                               self.best.summary()))
    return summary


def train(workdir: str, task_cls: type, config, devices=None) -> Tuple['Task', dict]:
  """A run of `task_cls` (a Task) in `workdir`, resuming what it holds: the mesh of
  config.mesh over `devices` (default: all), the config as task_cls.checked_config passes
  it, then the run directory's lock, after refusing a resume under another config
  (RunDir.hold), before anything is written; then the task is built and trained
  (Trainer.run), all within the mesh. Returns (the task, the trainer's summary)."""
  run = RunDir(workdir)
  mesh = partitioning.make_mesh(config.mesh, devices)
  config = _with_kept_tokenizer(config, run)
  # (each host checks its own view: a file only some of them see stops all of them)
  checked = distributed.on_every_process(lambda: task_cls.checked_config(config, mesh),
                                         'check the config')
  if checked is None:
    raise TypeError(f'{task_cls.__name__}.checked_config returned None: return the config')
  config = checked
  distributed.same_on_every_process(  # (what each host resolved: its vocabulary's size, ...)
      lambda: zlib.crc32(config.to_json_best_effort(sort_keys=True).encode()), 'the config',
      'give every host the same command line, files and environment')
  slices = partitioning.slice_count(mesh.devices.flat)
  logging.info('mesh %s over %d devices, %d processes%s', dict(mesh.shape), mesh.size,
               jax.process_count(), f', {slices} slices (data across them)' if slices > 1 else '')
  with run.hold(task_cls.command, config), jax.set_mesh(mesh):
    task = task_cls(config, mesh, run)
    spec = getattr(task.program.model, 'spec', None)
    if spec is not None:
      with partitioning.traced_on(mesh):  # (the heads' axis decides whether a kernel runs)
        logging.info('encoder: %s; attention: %s; %s', spec.summary,
                     attention_lib.paths(spec), _parameter_count(task.program.abstract.params))
    return task, Trainer(task, run).run()


def _with_kept_tokenizer(config, run: RunDir):
  """`config`, or for a resume whose data.tokenizer is gone (the folder of an import it came
  from moved or deleted), a copy that reads the run's own copy of it (checkpoints.
  write_config keeps one beside config.json): the vocabulary its checkpoint stands for, so
  that the same command goes on. As process 0 finds the files, for every process; a fresh
  start never takes a file a failed start left."""
  data = config.get('data')
  tokenizer = data.get('tokenizer') if data is not None else None
  if not tokenizer:
    return config
  kept = distributed.read_on_process_zero(
      lambda: None if storage.is_file(tokenizer) or not run.has_checkpoint() else
      checkpoints.kept_tokenizer(str(run), tokenizer), f'look for {tokenizer}')
  if kept is None:
    return config
  logging.info('data.tokenizer %s is gone: reading the run\'s copy of it, %s', tokenizer, kept)
  config = config.copy_and_resolve_references()
  config.data.tokenizer = kept
  return config


def _parameter_count(params) -> str:
  """'110,106,428 parameters (85,054,464 in the encoder's layers)': the model's, as its
  abstract params give them (the papers compare variants by these counts)."""
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  layers = {k: v for k, v in params.get('encoder', {}).items()
            if k == 'layers' or k.startswith('layers_')}
  return f'{count(params):,} parameters ({count(layers):,} in the encoder\'s layers)'


def define_flags(config_file: str, config_help: str, workdir_help: str) -> None:
  """A training program's flags: --config (`config_file`, a config file and its argument;
  an unknown --config.<key> is a one-line error), --workdir, and those of the multi-host
  set-up and of the compilation cache."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  with cli.config_overrides(config_file):
    config_flags.DEFINE_config_file('config', config_file, config_help, lock_config=True)
  flags.DEFINE_string('workdir', None, workdir_help)
  distributed.define_flags()
  compile_cache.define_flags()
  for name in ('config', 'workdir'):  # the program's --help lists them (and the two below)
    flags.declare_key_flag(name)
  flags.adopt_module_key_flags(distributed)
  flags.adopt_module_key_flags(compile_cache)


def run_program(fn: Callable[..., dict], *args) -> dict:
  """A training program's main, once its flags are checked: the host's set-up (malloc
  settings on CPU-only runs, joining the other hosts, then the compilation cache, which asks
  for the devices), then fn(*args), with a SIGTERM outside the training loop stopping the
  run with the not-finished status (workdir.exit_on_sigterm), user errors and a non-finite
  loss as one line with status 1 (cli.run_main), and a summary that says a stop signal ended
  the run after saving ('preempted') exiting with the not-finished status (75), so that a
  scheduler requeues it."""
  platforms.skip_absent_tpu()
  host_memory.keep_freed_memory()
  distributed.initialize_from_flags()
  compile_cache.enable_from_flags()
  workdir_lib.exit_on_sigterm()
  summary = cli.run_main(fn, *args, also=(NonFiniteLossError,))
  if 'preempted' in summary:
    workdir_lib.exit_not_finished(summary['preempted'])
  return summary


def _say_if_the_rate_moves(stored: Optional[dict], task: Task, step: int,
                           spent: float = 0.0) -> None:
  """A warning when a resume with another train.num_steps, time budget or optimizer setting
  (the peak rate, the warm-up, the schedule) moves the learning rate at the step it resumes
  from: the schedule follows the new settings, which a
  run extended in place may not expect (a rate that jumps back up). Under a budget the
  schedule is read at max(step, the budget's spent share of num_steps) (TimeBudget); `spent`:
  the seconds the run had spent by `step`."""
  config = task.config
  if not stored or 'train' not in stored or 'train' not in config:
    return
  import ml_collections  # pylint: disable=g-import-not-at-top

  def rate(optimizer, train) -> float:
    num_steps, minutes = int(train['num_steps']), float(train.get('time_budget_minutes') or 0)
    progress = TimeBudget.progress(step, num_steps, spent, minutes * 60)
    schedule = train_lib.make_schedule(ml_collections.ConfigDict(dict(optimizer)), num_steps)
    return float(schedule(progress * num_steps))
  try:
    before = rate(stored['optimizer'], stored['train'])
  except (KeyError, TypeError, ValueError):
    return  # (a stored config this version's schedule cannot read)
  after = rate(config.optimizer.to_dict(), config.train.to_dict())
  if abs(after - before) > 1e-3 * max(abs(before), 1e-12):
    changed = [f'{k} {stored["train"].get(k) or 0} -> {config.train.get(k) or 0}'
               for k in ('num_steps', 'time_budget_minutes')
               if (stored['train'].get(k) or 0) != (config.train.get(k) or 0)]
    if changed:
      logging.warning('resumed at step %d with train.%s: the learning rate there moves from '
                      '%.3g to %.3g (the schedule, warm-up included, follows the new %s)',
                      step, ', '.join(changed), before, after,
                      'budget' if any('budget' in c for c in changed) else 'length')
    else:
      logging.warning('resumed at step %d with other optimizer settings: the learning rate '
                      'there moves from %.3g to %.3g', step, before, after)


def _say_if_unfinished(path: str, step_name: str) -> None:
  """A warning when an init checkpoint's pretraining run had not reached its
  train.num_steps (still running, or stopped) nor spent its time budget: its step and its
  run's length in one line. Not for an import's (step 0), a fine-tuned encoder's (best/,
  final/: a step of the fine-tuning), a step folder's (chosen, not the run's newest)."""
  # (path: a workdir, its checkpoints/ folder or one step's folder)
  folder = storage.path(path)
  found = [f / RunDir.CONFIG for f in (folder, folder.parent, folder.parent.parent)
           if (f / RunDir.CONFIG).exists()]
  if found and found[0] == folder.parent.parent / RunDir.CONFIG:
    return  # (a step folder: that checkpoint was asked for)
  try:
    config = json.loads(found[0].read_text())
    num_steps = int(config['train']['num_steps'])
    step = int(step_name)
  except (IndexError, OSError, ValueError, KeyError, TypeError):
    return  # (no run to compare with)
  budget = config['train'].get('time_budget_minutes')
  if 'finetuned' in config or budget:  # (a budget's run may end before num_steps)
    return
  if 0 < step < num_steps:
    logging.warning('%s is at step %d of its run\'s %d: a run not finished (still '
                    'training, or stopped); its newest checkpoint is what this run starts '
                    'from', path, step, num_steps)


def _params_config(task: Task):
  return task.config if task.params_config is None else task.params_config


def _subtree(tree, keys: Tuple[str, ...]):
  for key in keys:
    tree = tree[key]
  return tree


def _with_subtree(tree, keys: Tuple[str, ...], value):
  """`tree` with the subtree at `keys` replaced by `value` (dicts copied, not changed)."""
  if not keys:
    return value
  return dict(tree, **{keys[0]: _with_subtree(tree[keys[0]], keys[1:], value)})


# The figures that _log_progress's headline gives in words.
_HEADLINE = ('loss', 'steps_per_sec', 'examples_per_s', 'tokens_per_s', 'padded_tokens_per_s',
             'tflops_per_device', 'mfu', 'uptime')


def _log_progress(step: int, num_steps: int, values: dict, seconds_left: Optional[float]):
  """One line for a logged step: the loss, the speed and the ETA in words (`seconds_left`,
  None where the window has no speed), then every other scalar of the window as
  'name=value'."""
  rest = metrics_lib.format_scalars({k: v for k, v in values.items() if k not in _HEADLINE})
  if 'steps_per_sec' not in values:
    logging.info('step %d/%d: loss %.4f; %s', step, num_steps, values['loss'], rest)
    return
  eta = datetime.timedelta(seconds=int(seconds_left))
  real = (f' ({values["tokens_per_s"] / values["padded_tokens_per_s"]:.0%} of the padded)'
          if 'padded_tokens_per_s' in values else '')
  logging.info('step %d/%d: loss %.4f, %.2f steps/s, %.1f examples/s, %.0f tokens/s%s, '
               '%.3f TFLOP/s per device%s, ETA %s; %s', step, num_steps, values['loss'],
               values['steps_per_sec'], values['examples_per_s'], values['tokens_per_s'], real,
               values['tflops_per_device'],
               f', MFU {values["mfu"]:.1%}' if 'mfu' in values else '', eta, rest)


class BestParams:
  """<run>/best: the params of the evaluation with the best task.headline so far, as a
  params-only checkpoint with the task's params_config as config.json (so another run can
  start from it) and best/results.json (its step and results). A run that starts at step
  `start` removes a best/ from a later step: an earlier run's in the same directory (a start
  from 0), or one from the stretch after the checkpoint it resumes from, which it trains
  again (a best of its own comes back when it is reached again); and one whose record is
  not of its params (a kill between the two writes). `record`: best/results.json's
  ({'step', 'headline', ...}), or None before a best."""

  def __init__(self, run: RunDir, task: Task, enabled: bool, start: int):
    self.run, self.task, self.enabled = run, task, enabled
    self.dir = run.sub(RunDir.BEST)
    self.record = None

    def look():  # (why best/ goes, its record)
      if not self.dir.root.exists():
        return None, None
      stored = self.dir.read_json(RunDir.RESULTS)
      saved = checkpoints.complete_steps(str(self.dir))
      return ('an earlier run in this directory' if start == 0 else
              'params without their record (a save cut short)' if not saved or not stored
              or stored.get('step') != saved[-1] else
              'the stretch after its last checkpoint' if saved[-1] > start else None), stored
    # As process 0 finds them (a host that looked after process 0 removed it, or through a
    # file system's cache, would see otherwise, and save or link where the others do not).
    why, stored = distributed.read_on_process_zero(look, f'read {self.dir}')
    if why:
      logging.warning('removing %s, where this run starts at step %d: %s', self.dir, start,
                      why)
      run.remove(RunDir.BEST)
    elif stored is not None and enabled:
      self.record = dict(stored, headline=task.record_headline(stored))

  def offer(self, params, step: int, results: Results):
    if not self.enabled:
      return
    headline = self.task.headline(results)
    if not np.isfinite(headline) or (self.record is not None and
                                     headline <= self.record['headline']):
      return
    self.dir.check_held()
    manager = self.dir.checkpoint_manager(1, ('state',))
    for old in manager.all_steps():  # a period redone after a kill saves its step again
      if old >= step:
        checkpoints.delete_step(manager, old)
    checkpoints.save(manager, step, {'step': step, 'params': params}, force=True)
    manager.wait_until_finished()
    manager.close()
    self.dir.write_config(_params_config(self.task))
    self.record = {'step': step, 'headline': headline, **self.task.best_record(step, results)}
    self.dir.write_json(RunDir.RESULTS, self.record, indent=2)
    logging.info('best %s so far at step %d: params saved to %s', self.task.name, step,
                 self.dir)

  def summary(self) -> Optional[dict]:
    return dict(self.record, dir=str(self.dir)) if self.record else None


def _drop_optimizer_state(manager, params, step: int, run: RunDir, best: BestParams,
                          task: Task):
  """A finished run needs no optimizer state: keep its params in <run>/final (a
  params-only checkpoint that a rerun evaluates and another run can start from; on a local
  disk a link to best/ when the last evaluation was the best) and delete the resume
  checkpoint."""
  run.check_held()
  final = run.path(RunDir.FINAL)
  # (as process 0 finds it: a host that looks after process 0 linked it would find it)
  if distributed.read_on_process_zero(
      lambda: os.path.islink(final) or checkpoints.has_complete_step(str(final)),
      f'read {final}'):
    pass  # written by an attempt killed before the resume checkpoint was deleted
  elif best.record is not None and best.record['step'] == step and not storage.is_url(final):
    distributed.on_process_zero(lambda: os.symlink(RunDir.BEST, final), f'link {final}')
  else:
    checkpoints.save_params(str(final), params, _params_config(task), step=step)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.sync_global_devices('final params saved')
  for old in manager.all_steps():
    checkpoints.delete_step(manager, old)
  logging.info('finished: final params in %s; the optimizer state was dropped', final)
