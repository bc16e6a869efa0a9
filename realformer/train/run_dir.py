"""The run directory: every file of one training or fine-tuning run, in one place.

    run = RunDir('/tmp/bert_tiny')
    with run.hold('train.py', config):        # the lock, then the resume check
      ...                                      # restore or init
      run.write_config(config)                 # once every check has passed

The name of every file and folder of a run is a class attribute (RunNames, the layout):
programs and readers ask RunDir for them, never spelling them.

The root is a local folder or a gs:// URL; paths are `etils.epath.Path`s, the path type
Orbax itself uses (storage.py says how each kind of file reaches a bucket). Only process 0
writes the small files; every process may read them. JSON files are replaced whole, so a
reader never sees half a file.
"""

import contextlib
import functools
import json
import os
from typing import Any, Optional, Tuple

import jax
from absl import logging
from etils import epath

from realformer.train import checkpoints
from realformer.train import distributed
from realformer.train import machine
from realformer.train import metrics as metrics_lib
from realformer import storage
from realformer.train import workdir as workdir_lib
from realformer.run_names import RunNames


class RunDir(RunNames):
  """The files of one run under `root` (a local folder, `~` expanded; or a gs:// URL); their
  names are RunNames'."""

  def __init__(self, root):
    if root is None or not os.fspath(root):
      raise ValueError('--workdir is required: the directory for checkpoints and logs')
    storage.check_location(root, '--workdir')
    self.root = storage.path(root)
    self._lock: Optional[workdir_lib.Lock] = None
    self.resumed_from: Optional[dict] = None  # (hold)

  def __str__(self) -> str:
    return os.fspath(self.root)

  def path(self, *names: str) -> epath.Path:
    return self.root.joinpath(*names)

  def sub(self, name: str) -> 'RunDir':
    """A folder of this run that is itself a params-only run directory (best/, final/),
    written under this run's lock."""
    sub = RunDir(self.path(name))
    sub._lock = self._lock  # pylint: disable=protected-access
    return sub

  # ---- Ownership: one run per directory, and a directory that describes its checkpoints.

  @contextlib.contextmanager
  def hold(self, command: str, config):
    """Holds the lock for the body (its record naming `command`, e.g. 'train.py'), after
    refusing a resume under another config; `resumed_from` is then the stored config (a
    dict) of a run resumed with resumable fields changed, else None."""
    with workdir_lib.Lock(str(self), command) as lock:
      # (as process 0 finds the workdir: a check that fails there stops every process)
      changed, self.resumed_from = distributed.read_on_process_zero(
          lambda: self._resume_check(config), f'check the config against {self}\'s')
      self._lock = lock
      try:
        yield self
      finally:
        self._lock = None

  def _resume_check(self, config):
    """(the resumable fields a resume changes, the stored config then, else None)."""
    changed = workdir_lib.check_resume_config(str(self), config, self.has_checkpoint())
    return changed, json.loads(self.path(self.CONFIG).read_text()) if changed else None

  def lock_lost(self) -> Optional[str]:
    """Why this process's lock was taken over, or None: this process's own view, no
    collective (for an error handler, where the other processes may not come)."""
    return None if self._lock is None else self._lock.lost

  def check_held(self) -> None:
    """Raises WorkdirInUseError if the lock this run holds was taken over (a lease on
    object storage that could not be refreshed in time): nothing more may be written. With
    several processes, process 0 (the holder) decides for all of them, so they stop
    together (a collective: every process calls this at the same step)."""
    if self._lock is None:
      return
    lost = self._lock.lost
    if jax.process_count() > 1 and storage.is_url(self.root):
      if distributed.from_process_zero(lost is not None):
        lost = lost or f'process 0 lost the lock of {self}'
    if lost:
      raise workdir_lib.WorkdirInUseError(f'{lost}; this run stopped without saving (only '
                                          'one run may write to a workdir); once no other run '
                                          'holds it, run the same command to resume from its '
                                          'last complete checkpoint')

  def has_checkpoint(self) -> bool:
    """A complete resume checkpoint, or the final params of a finished run."""
    return (checkpoints.has_complete_step(str(self)) or
            checkpoints.has_complete_step(str(self.path(self.FINAL))))

  def checkpoint_manager(self, keep: Optional[int], item_names: Tuple[str, ...]):
    """The run's CheckpointManager; a step is committed only while the run holds its lock
    (checkpoints.make_manager's fence)."""
    lock = self._lock
    return checkpoints.make_manager(
        str(self), keep=keep, item_names=item_names,
        fence=None if lock is None else functools.partial(_fence, lock))

  # ---- Small files and the logs: process 0 writes (JSON replaced whole). With several
  # processes each write (and remove) is a collective that every process makes at the same
  # point, raising on all of them if process 0's failed (distributed.on_process_zero).

  def write_json(self, name: str, value: Any, indent: Optional[int] = None) -> epath.Path:
    path, text = self.path(name), json.dumps(value, indent=indent)
    distributed.on_process_zero(lambda: storage.write_text(path, text), f'write {path}')
    return path

  def read_json(self, name: str, default: Any = None) -> Any:
    path = self.path(name)
    return json.loads(path.read_text()) if path.exists() else default

  def write_config(self, config) -> epath.Path:
    """config.json, and beside it a copy of the files of its data.tokenizer
    (checkpoints.write_config): written only once every check of a start has passed. A
    resume keeps the stored train.init_checkpoint, the one that began the run (it reads its
    own checkpoint: another value given now was never read)."""
    began = (self.resumed_from or {}).get('train', {}).get('init_checkpoint')
    if began is not None and config.get('train', {}).get('init_checkpoint') != began:
      logging.info('train.init_checkpoint=%r is not read on a resume (the run\'s own checkpoint '
                   'is): config.json keeps %r, which began the run',
                   config.train.init_checkpoint, began)
      config = config.copy_and_resolve_references()
      config.train.init_checkpoint = began
    return checkpoints.write_config(str(self), config)

  def record_machine(self) -> None:
    distributed.on_process_zero(lambda: machine.record(str(self)),
                                f'write {self.path(self.MACHINE)}')

  def metric_writer(self, start_step: int):
    """TensorBoard + console + metrics.jsonl (process 0; the others log to the console), for
    a start at `start_step` (metrics_jsonl: what the logs hold past it is forgotten)."""
    return metrics_lib.create_writer(str(self), self.path(self.METRICS), start_step)

  def remove(self, name: str) -> None:
    """Deletes a file or folder of the run (process 0)."""
    path = self.path(name)

    def remove():
      if path.exists():
        if path.is_dir():
          path.rmtree()
        else:
          path.unlink()

    distributed.on_process_zero(remove, f'remove {path}')


def _fence(lock: workdir_lib.Lock) -> None:
  """On orbax's thread, before a commit: this process's own view of the lock (no collective:
  check_held's broadcast stays on the main thread). A save still in flight when its run
  released the lock (an error, then the process lived on) is not committed either."""
  why = lock.not_held
  if why:
    raise workdir_lib.WorkdirInUseError(f'{why}; this run stopped without committing the '
                                        'checkpoint it was saving (only one run may write to '
                                        'a workdir); once no other run holds it, run the same '
                                        'command to resume from its last complete checkpoint')
