"""One run per workdir, and a workdir that keeps describing its own checkpoints. A run holds
its workdir through RunDir.hold (realformer/train/run_dir.py: the first two lines below),
and the trainer writes the config once every check has passed:

    with workdir.Lock(path):                      # before anything is written
      changed = workdir.check_resume_config(path, config, has_checkpoint)
      ...                                         # every other check, the restore
      checkpoints.write_config(path, config)      # only then

The lock: <workdir>/.lock, held for the whole run by process 0 (the only process that writes
files other than checkpoint shards). It records host, pid and start time, so a second run is
refused with one line naming the holder. In a local (or NFS) folder it is held with flock(2):
a run that dies leaves the file but not the flock (the kernel drops it with the process), so
on the same host the next run takes it over and says so; a record left by another host
(network filesystems do not always carry flock) is refused, naming the file to delete if that
run is dead. On Cloud Storage (gs://) it is an object created only if absent and kept alive
by a lease (storage.Lease). A clean exit empties the file, or deletes the object.

On resume (the workdir has a checkpoint), the stored config.json is compared with the new
config: every field must match except the ones listed in RESUMABLE, which change how a run
is executed or reported but not what it computes; their changes are logged.
"""

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from typing import Dict, List, Optional

import jax
from absl import logging

from realformer import cli
from realformer import storage
from realformer.model.spec import preset_fields
from realformer.run_names import RunNames
from realformer.train import distributed


# Exit status of a run stopped by SIGTERM (preemption) after saving: not finished, to be
# run again (sysexits.h EX_TEMPFAIL). docs/launching.md shows how schedulers use it.
EXIT_NOT_FINISHED = 75

# Fields that may change when a run resumes (prefix match on dotted keys). Everything else
# (model, data, optimizer, seed, batch size) defines the run and must match its checkpoint.
RESUMABLE = (
    'train.num_steps',            # run longer or shorter (the schedule follows num_steps)
    'train.time_budget_minutes',  # likewise, in wall time
    'train.log_every_steps', 'train.eval_every_steps', 'train.eval_steps',
    'train.checkpoint_every_steps', 'train.keep_checkpoints', 'train.profile_steps',
    'train.peak_flops_per_device',
    'train.init_checkpoint',      # read only when a run starts from nothing (config.json keeps
    # the one that began it: RunDir.write_config)
    'train.grad_accum_steps',     # the same gradient in fewer or more microbatches (with
    # dropout, other masks: each microbatch draws its own)
    'mesh.',                      # checkpoints are restored into any sharding
    'model.remat_policy', 'model.fused_attention', 'model.dense_impl',  # how, not what
    'data.read_threads', 'data.prepared_dir', 'data.prepare_workers',  # (not worker_count:
    # grain's saved iterator state holds its workers' positions)
    'data.blocks_per_file', 'data.records_per_file',  # the prepared files' layout, not
    # the stream they give
    'data.tfds_data_dir',         # where TFDS keeps a dataset, not which
    'data.seed',                  # None -> the run's seed given as a number: the prepared
    # data's fingerprint refuses any that would prepare other instances
    # fine-tuning (finetune.py)
    'eval_batch_size', 'log_every_steps', 'keep_best', 'keep_optimizer_state',
    'compile_in_background',
    # how later batches are padded (a resumed run refuses a change in mid-epoch: the epoch's
    # batches are already drawn; finetune/task.length_buckets)
    'length_buckets', 'group_by_length', 'bucket_multiple', 'bucket_compile_seconds',
    'bucket_flops_per_second',
)


class WorkdirInUseError(cli.UserError):
  """Another run holds the workdir."""


def _read(fd: int) -> Optional[dict]:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 65536).decode('utf-8', 'replace').strip()
  if not text:
    return None
  try:
    return json.loads(text)
  except ValueError:
    return {'pid': '?', 'host': '?', 'since': '?', 'program': 'unreadable lock record'}


# What this process holds, as the calls that release it: exit_on_sigterm's immediate exit
# runs them as a clean exit does, so the requeued run takes the workdir without a take-over
# warning (a local lock record emptied, a lock object deleted).
_HELD = {}


class Lock:
  """One run per workdir, taken by process 0 for the life of the run: flock on <workdir>/.lock
  for a local (or shared-filesystem) folder, a leased lock object for gs:// (storage.Lease).
  With several processes every process learns whether it was taken, so all of them stop
  with the one line (the others would otherwise run on and wait for process 0 at the first
  collective), and a local workdir must be one folder for all of them: each process must
  see process 0's lock record there (a path on each host's own disk is refused)."""

  def __init__(self, workdir: str, program: str = 'train.py'):
    self.workdir, self.program = os.fspath(workdir), program
    self.path = (f'{self.workdir.rstrip("/")}/{RunNames.LOCK}' if storage.is_url(self.workdir)
                 else os.path.join(self.workdir, RunNames.LOCK))
    self._fd, self._created, self._lease = None, False, None
    self._record = b''  # what process 0 wrote into a local lock file
    self._held = False  # between a successful __enter__ and __exit__, in every process

  @property
  def lost(self) -> Optional[str]:
    """Why the lock is no longer this run's (a lease taken over), else None."""
    return self._lease.lost if self._lease is not None else None

  @property
  def not_held(self) -> Optional[str]:
    """Why this run may not write to the workdir now (released, or lost), else None."""
    return None if self._held and not self.lost else (
        self.lost or f'the lock of {self.workdir} was released')

  def __enter__(self):
    if jax.process_count() == 1:
      self._take()
      self._held = True
      return self
    error = None
    if jax.process_index() == 0:
      try:
        self._take()
      except Exception as e:  # pylint: disable=broad-except  (re-raised after the broadcast)
        error = e
    # 0: taken; 1: another run holds it; 2: process 0 failed otherwise (its log says why).
    code = 0 if error is None else 1 if isinstance(error, WorkdirInUseError) else 2
    code = distributed.from_process_zero(code)
    if error is not None:
      raise error
    if code == 1:
      raise WorkdirInUseError(f'process 0 could not take the lock of {self.workdir} (its log '
                              'names the holder); wait for that run to finish or stop it, or '
                              'use another --workdir')
    if code == 2:
      raise ValueError(f'process 0 could not set up the workdir {self.workdir}; its log says '
                       'why')
    # Every process sees the lock process 0 took (its record, not an older run's lock file):
    # a local path on each host's own disk is a folder per host, each of whose checkpoints
    # would hold a part of every step.
    if not storage.is_url(self.workdir):
      record = distributed.from_process_zero(zlib.crc32(self._record) & 0x7fffffff)
      blind = [i for i, seen in enumerate(distributed.gathered(_appears(self.path, record)))
               if not seen]
      if blind:
        self.__exit__()  # (process 0's; the others hold nothing)
        raise ValueError(f'--workdir {self.workdir} is not one folder for every process '
                         f'(process {blind[0]} of {jax.process_count()} did not see the lock '
                         f'process 0 took there in {SHARED_FILE_SECONDS:.0f} s: a folder on '
                         'each host\'s own disk?); give a folder they share: a gs:// bucket or '
                         'a shared file system')
    self._held = True
    return self

  def _take(self):
    if storage.is_url(self.workdir):
      self._lease = storage.Lease(self.path, storage.holder_record(self.program))
      try:
        self._lease.take()
      except storage.HeldError as e:
        raise WorkdirInUseError(str(e).replace('use another folder', 'use another --workdir')
                                ) from None
      _HELD[id(self)] = self._lease.release
      return self
    self._created = not os.path.exists(self.workdir)
    try:
      os.makedirs(self.workdir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # it, or a folder above it, is a file
      raise ValueError(f'--workdir {self.workdir} cannot be a folder: it or a folder above it '
                       'is a file; choose another --workdir') from None
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)  # else: no flock on this file system
      holder = (_read(fd) or {}) if held else {}
      os.close(fd)
      if not held:  # (and no empty workdir left behind)
        if self._created and _holds_only_the_lock(self.workdir):
          shutil.rmtree(self.workdir, ignore_errors=True)
        raise ValueError(f'--workdir {self.workdir} is on a file system that cannot lock files '
                         f'({os.strerror(e.errno)}), so two runs could write it at once; use a '
                         'folder on a local disk, or a gs:// bucket') from None
      raise WorkdirInUseError(
          f'{self.workdir} is in use by {storage.describe_holder(holder)}; wait for that run to finish '
          f'or stop it, or use another --workdir') from None
    if not _same_file(fd, self.path):  # a run that made this folder removed it meanwhile
      os.close(fd)
      return self._take()
    previous = _read(fd)
    if previous is not None:
      if previous.get('host') != socket.gethostname() and not _requeued(previous):
        os.close(fd)
        raise WorkdirInUseError(
            f'{self.workdir} is locked by {storage.describe_holder(previous)}, another host; if that run '
            f'is no longer running, delete {self.path}')
      logging.warning('taking over the lock of %s in %s: that process is gone',
                      storage.describe_holder(previous), self.workdir)
    # Before the record is written: a SIGTERM from here on empties it.
    _HELD[id(self)] = lambda: os.ftruncate(fd, 0)
    try:
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      self._record = (json.dumps(storage.holder_record(self.program)) + '\n').encode()
      os.write(fd, self._record)
      os.fsync(fd)
    except OSError:  # a full disk: not held (the error goes to the user as one line)
      _HELD.pop(id(self), None)
      os.close(fd)
      raise
    self._fd = fd
    return self

  def __exit__(self, *exc):
    self._held = False
    if self._lease is not None:
      self._lease.release()
      _HELD.pop(id(self), None)
      self._lease = None
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # released (before it leaves _HELD: a SIGTERM between the
      _HELD.pop(id(self), None)  # two still finds the record emptied)
      # A run that failed before writing anything (a file) leaves no workdir behind:
      # removed while the lock is held (a run waiting for it then sees the file is gone).
      if self._created and _holds_only_the_lock(self.workdir):
        try:
          shutil.rmtree(self.workdir)
        except OSError as e:  # never hide the run's own error behind this one
          logging.warning('could not remove the empty workdir %s: %s', self.workdir, e)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


# How long a process looks for a file another host made on a shared file system (a network
# file system's client may answer from its cache that it is not there, for up to a minute).
SHARED_FILE_SECONDS = 60.0


def _appears(path: str, record: int) -> bool:
  """Whether the file `path` holds the lock record whose checksum is `record` (crc32, 31
  bits), now or within SHARED_FILE_SECONDS (its folder listed at each look, which makes a
  network file system's client ask its server again)."""
  deadline = time.monotonic() + SHARED_FILE_SECONDS
  while True:
    try:
      os.listdir(os.path.dirname(path))
      with open(path, 'rb') as f:
        if zlib.crc32(f.read()) & 0x7fffffff == record:
          return True
    except OSError:  # not there (yet)
      pass
    if time.monotonic() > deadline:
      return False
    time.sleep(0.5)


def _requeued(previous: dict) -> bool:
  """Whether this process runs a later start of the SLURM job that wrote `previous` (a job
  requeued after a node failed: SLURM runs one start of a job at a time, and the new one
  may begin on another node)."""
  job = os.environ.get('SLURM_JOB_ID')
  return bool(job) and previous.get('slurm_job') == job and (
      int(os.environ.get('SLURM_RESTART_COUNT') or 0) > int(previous.get('slurm_restart', 0)))


def _same_file(fd: int, path: str) -> bool:
  try:
    return os.path.samestat(os.fstat(fd), os.stat(path))
  except FileNotFoundError:
    return False


def _holds_only_the_lock(workdir: str) -> bool:
  """No file in `workdir` but the lock: at most empty folders (a checkpoint manager's)."""
  def unreadable(e):
    raise e
  try:
    walked = list(os.walk(workdir, onerror=unreadable))
  except OSError:
    return False  # a folder it cannot read may hold anything
  for root, _, files in walked:
    if any(root != workdir or f != RunNames.LOCK for f in files):
      return False
  return True


def flatten(tree, prefix='') -> Dict[str, object]:
  """A nested dict (a config's JSON, ConfigDict.to_dict()) as {dotted name: value}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def _resumable(key: str) -> bool:
  return any(key == r or (r.endswith('.') and key.startswith(r)) for r in RESUMABLE)


# Fields added since runs began, with the value that a config written before them stood
# for: a stored config without the field is compared as if it held that value.
ADDED_DEFAULTS = {'optimizer.name': 'adamw', 'model.gelu': 'erf', 'objective': 'mlm_nsp',
                  'data.seed': None}
# The same for finetune.py's config only (its `model` section, how the pretrained encoder
# computes: '' or None, as pretrained), kept apart from pretraining's fields of those names.
ADDED_FINETUNE_DEFAULTS = {'model.dtype': '', 'model.residual_dtype': '',
                           'model.dropout_rate': None, 'model.attention_dropout_rate': None,
                           'model.remat_policy': '', 'model.fused_attention': '',
                           'model.dense_impl': '', 'model.scan_layers': None,
                           'group_by_length': True, 'ner.document_context': False}


def stored_config(path: str):
  """The config a run was started with, as its program builds configs (configs/run.py):
  `path` is the run's workdir or its config.json (a gs:// URL too). The program's config
  file makes the fields (configs/pretrain.py:<variant>,base or configs/finetune.py:
  <kind>/<task>: their types and references), then each takes the stored value; a field the
  file lacks (added since the run began) takes the value such runs computed
  (ADDED_DEFAULTS), and one it holds that the config no longer has is a one-line error."""
  file = storage.path(path)
  if not str(path).endswith('.json'):
    file = file / RunNames.CONFIG
  if not storage.is_file(file):
    raise ValueError(f'{file} not found; give configs/run.py the workdir of a run (or its '
                     'config.json)')  # (a bad argument of the config file, as a size is)
  try:
    stored = json.loads(file.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{file} is not readable JSON ({e}); give the config.json of a run') from None
  program = cli.program_of(stored) if isinstance(stored, dict) else None
  if program is None:
    raise ValueError(f'{file} is not the config of a train.py or finetune.py run')
  config = cli.load_config(
      f'configs/pretrain.py:{stored["model"]["variant"]},base' if program == 'train.py' else
      f'configs/finetune.py:{stored["benchmark"]}/{stored["task"]}')
  given = flatten(stored)
  added = {**ADDED_DEFAULTS, **(ADDED_FINETUNE_DEFAULTS if program == 'finetune.py' else {})}
  fields = flatten(config.to_dict())
  gone = sorted(set(given) - set(fields))
  if gone:
    raise ValueError(f'{file} holds {len(gone)} field{"s" * (len(gone) > 1)} this '
                     f'{cli.PROGRAMS[program][0]} config has not ({", ".join(gone[:3])}); give '
                     f'{program} its config file ({cli.PROGRAMS[program][1]}) with the '
                     'settings to keep')
  for key in fields:
    if key not in given and key not in added:
      continue  # (a field added since the run began that stands for nothing: as given)
    value = given[key] if key in given else added[key]
    *sections, name = key.split('.')
    node = config
    for section in sections:
      node = node[section]
    if isinstance(node[name], tuple) and isinstance(value, list):
      value = tuple(value)
    node[name] = value
  return config


def _flat_pair(stored: dict, new: dict):
  """Both configs flattened to dotted keys, the stored one with ADDED_DEFAULTS filled in, and
  each one's preset fields as its variant's preset gives them where it leaves them None
  (spec.preset_fields)."""
  def flat(config: dict) -> dict:
    values = flatten(config)
    if isinstance(config.get('model'), dict):
      values.update({f'model.{k}': v for k, v in preset_fields(config['model']).items()})
    return values
  b = flat(new)
  added = {**ADDED_DEFAULTS, **(ADDED_FINETUNE_DEFAULTS if 'benchmark' in new else {})}
  return {**{k: v for k, v in added.items() if k in b}, **flat(stored)}, b


def config_differences(stored: dict, new: dict):
  """(fields that may not change but did, fields that may change and did, fields the
  stored config lacks), each a sorted list of dotted keys (ADDED_DEFAULTS filled in)."""
  a, b = _flat_pair(stored, new)
  changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
  return ([k for k in changed if not _resumable(k)], [k for k in changed if _resumable(k)],
          sorted(b.keys() - a.keys()))


def _check_tokenizer(workdir: str, stored: str, given: str, fixed: List[str]) -> None:
  """A resume's data.tokenizer against the vocabulary its checkpoint stands for: the run's
  copy of it (checkpoints.keep_tokenizer), else the stored path's files. Another path to
  the same files (data.tokenizer.signature: the vocabulary and its casing) is the same
  run (taken out of `fixed`); the stored path whose files are no longer the run's copy
  (retrained there) is a one-line error."""
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from realformer.train import checkpoints  # pylint: disable=g-import-not-at-top
  kept = checkpoints.kept_tokenizer(workdir, stored) if stored else None
  own = kept or (stored if stored and storage.is_file(stored) else None)
  if not own or not given or not storage.is_file(given):
    return
  same = tokenizer_lib.signature(given) == tokenizer_lib.signature(own)
  if given != stored and same:
    if 'data.tokenizer' in fixed:
      fixed.remove('data.tokenizer')
    if given != own:
      logging.info('data.tokenizer %s holds the run\'s vocabulary, %s (the same files)',
                   given, own)
  elif given == stored and not same:
    raise ValueError(f'data.tokenizer {given} holds other files than the run\'s copy of '
                     f'it, {own}, the vocabulary its checkpoint stands for (retrained at '
                     f'that path?); resume with --config.data.tokenizer={own}, or start a '
                     'new --workdir')


def check_resume_config(workdir: str, config, has_checkpoint: bool) -> List[str]:
  """Refuse to resume a checkpoint under another config; log the allowed changes.

  Returns the resumable fields that changed. A workdir without a checkpoint has nothing
  to protect (its config.json is simply replaced later) unless its config.json is another
  program's: a finished fine-tuning run keeps no checkpoint in checkpoints/, yet its
  best/, final/ and metrics would be mixed with a pretraining run's."""
  path = storage.path(workdir) / RunNames.CONFIG
  if not storage.is_file(path):
    if has_checkpoint:  # config.json is written before the first checkpoint: removed since
      raise ValueError(f'{workdir} holds checkpoints but no config.json, so the config they '
                       'were trained with is unknown; restore config.json (a copy of the '
                       'run\'s config) or use another --workdir')
    return []
  try:
    stored = json.loads(path.read_text())
    if not isinstance(stored, dict):
      raise ValueError(f'a JSON {type(stored).__name__}, not an object')
  except ValueError as e:
    if not has_checkpoint:
      return []
    raise ValueError(f'{path} is not readable JSON ({e}), yet {workdir} holds checkpoints; '
                     'restore the file or use another --workdir') from None
  new = json.loads(config.to_json_best_effort())
  fixed, allowed, added = config_differences(stored, new)
  if has_checkpoint and isinstance(stored.get('data'), dict) and 'data' in new:
    _check_tokenizer(workdir, stored['data'].get('tokenizer', ''),
                     new['data'].get('tokenizer', ''), fixed)
  programs = cli.program_of(stored), cli.program_of(new)
  # (a config of another program: told by its sections; a file of neither by the fields it
  # lacks: fields added since are few)
  if None not in programs and programs[0] != programs[1]:
    kind, _ = cli.PROGRAMS[programs[0]]
    hint = (f' (to fine-tune it: --config.init_checkpoint={workdir} and a --workdir of the '
            'fine-tuning run\'s own)' if programs[0] == 'train.py' else '')
    raise ValueError(f'{workdir} is a {kind} run (its {RunNames.CONFIG} is {programs[0]}\'s), '
                     f'not a {cli.PROGRAMS[programs[1]][0]} run; use another --workdir{hint}')
  if len(added) * 2 > len(flatten(new)):  # (a file of neither: told by the fields it lacks)
    where = (f'yet {workdir} holds checkpoints' if has_checkpoint else
             f'so {workdir} is another program\'s run (an older fine-tuning run\'s, say)')
    raise ValueError(
        f'{path} is not a config of this program (it lacks {len(added)} of its '
        f'{len(flatten(new))} fields, e.g. {added[0]}), {where}; use another --workdir')
  if not has_checkpoint:
    return []
  if fixed:
    a, b = _flat_pair(stored, new)
    shown = ', '.join(f'{k}: {a[k]!r} -> {b[k]!r}' for k in fixed)  # every one of them
    phase = ((' (a second phase at another length: a new --workdir with '
              f'--config.train.init_checkpoint={workdir})')
             if 'data.max_seq_length' in fixed and 'train' in new else
             f' (with --config.train.init_checkpoint={workdir} to begin from its weights)'
             if 'train' in new and not any(k.startswith('model.') or k == 'data.tokenizer'
                                           for k in fixed) else '')
    raise ValueError(
        f'{workdir} holds a checkpoint of another config ({len(fixed)} '
        f'field{"s" if len(fixed) > 1 else ""}): {shown}; resume with the '
        f'stored values (--config configs/run.py:{workdir}) or start a new '
        f'--workdir{phase}')
  for k in allowed:
    logging.info('resuming with %s changed: %r -> %r', k, _flat_pair(stored, new)[0][k],
                 flatten(new)[k])
  if added:
    logging.warning('fields absent from the stored config (added since), taken as given: %s',
                    ', '.join(f'{k}={flatten(new)[k]!r}' for k in added))
  return allowed


class StopSignal:
  """Set by SIGTERM (preemption) or Ctrl-C (SIGINT): the trainer's loop saves at the current
  step and returns; the program then calls exit_not_finished. With several processes jax's preemption
  notifier owns SIGTERM, and its sync protocol picks the stop: each process reports how many
  checks it has made, and all stop at the check after the largest count. So the checks are
  counted here from 1 (a resumed run's step numbers would never meet the count a notice
  before the loop agreed on: 1), and checkpoints.make_manager keeps orbax from counting its
  saves' steps too."""

  def __init__(self):
    self.event = threading.Event()
    self._previous = None
    self._checks = 0

  def __enter__(self):
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      self._previous = {sig: signal.signal(sig, self._stop) for sig in stop_signals()}
    return self

  def _stop(self, signum, _):
    self.event.set()
    if signum == signal.SIGINT:  # Ctrl-C saves as SIGTERM does; a second one interrupts
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def __exit__(self, *exc):
    for sig, previous in (self._previous or {}).items():
      signal.signal(sig, previous)

  def reached(self) -> bool:
    """Whether to save and stop now: SIGTERM here, or (several processes, called once a
    step by each) jax's preemption notice, at the same step on every process."""
    if jax.process_count() == 1:
      return self.event.is_set()
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    self._checks += 1
    try:
      return multihost_utils.reached_preemption_sync_point(self._checks)
    except RuntimeError:  # jax's preemption service is off (jax_enable_preemption_service)
      return False


def exit_on_sigterm() -> None:
  """Outside the training loop (preparing the data, compiling, the final evaluation) a
  SIGTERM or Ctrl-C stops the run with the not-finished status, as the loop's StopSignal does after
  saving: a scheduler then requeues it, and the rerun resumes from the last complete
  checkpoint. The exit is immediate, as a kill's (os._exit: an exception raised wherever the
  signal lands could be swallowed, or crash the interpreter's shutdown under XLA's
  threads), and what a kill leaves is what resuming already handles: an unfinished
  checkpoint step is passed over, a preparation keeps its finished workers (its worker
  processes are stopped first), and the lock of a process that is gone is taken over.
  Several processes: jax's preemption notifier owns SIGTERM."""
  def before():
    import multiprocessing  # pylint: disable=g-import-not-at-top
    for child in multiprocessing.active_children():  # a preparation's workers
      child.terminate()
    for release in list(_HELD.values()):  # as on a clean exit (the kernel drops the flock)
      release()
  if jax.process_count() == 1:
    cli.exit_at_once_on(
        stop_signals(), 'not finished: stopped by SIGTERM or Ctrl-C outside the training loop '
        '(preparing, compiling or finishing); run the same command to resume from the last '
        f'complete checkpoint (exit status {EXIT_NOT_FINISHED})', EXIT_NOT_FINISHED, before)


def stop_signals():
  """SIGTERM, and SIGINT (Ctrl-C) unless this process was started with it ignored (a
  background job of a shell script, which Ctrl-C of the script is not meant to stop)."""
  ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
  return (signal.SIGTERM,) + (() if ignored else (signal.SIGINT,))


def exit_not_finished(step: int):
  print(f'not finished: stopped by SIGTERM or Ctrl-C after saving step {step}; run the same '
        f'command to resume (exit status {EXIT_NOT_FINISHED})', file=sys.stderr)
  sys.exit(EXIT_NOT_FINISHED)
