"""Sweeps: products of config overrides and seeds, one workdir per run, run locally one after
another or printed as launch commands, and summarised over seeds.

A sweep is a list of runs, each a dict of `--config.<key>` overrides (plus 'seed'). Build it
from the command line (`--sweep model.variant=postln,realformer --seeds 3`) or from a Python
file whose `get_hyper(h)` combines these (after big_vision's convention):

  def get_hyper(h):
    return h.product([
        h.sweep('model.variant', ['postln', 'preln', 'realformer']),
        h.zip(h.sweep('optimizer.learning_rate', [1e-4, 2e-4]),
              h.sweep('optimizer.warmup_steps', [100, 50])),
        h.fixed('train.num_steps', 2000),
    ])

A run's workdir is `<root>/<name>`, the name its overrides in a fixed order
(`model.variant=realformer,seed=1`); a run whose overrides a folder of the root already
records (an earlier sweep that varied fewer keys) keeps that folder. Programs run from the
repository root. A run that finished (is_done: a DONE marker, written after the program
exits 0, a fine-tuning's results.json, or a complete checkpoint at its train.num_steps or
past its time budget) is skipped; one that was interrupted is started again in its workdir,
where train.py / finetune.py resume from the newest checkpoint. A run another live sweep
process is running (its LOCK: an flock with the holder's host and pid, or in a bucket a
leased object) is skipped too, so two sweeps over one root never write into the same
workdir.
"""

import csv
import io
import itertools
import json
import os
import re
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from realformer import cli
from realformer import storage
from realformer.train import checkpoints
from realformer.train import metrics_jsonl
from realformer.train.run_dir import RunDir
from realformer.train import workdir as workdir_lib
from realformer.train.workdir import EXIT_NOT_FINISHED

Run = Dict[str, Any]
_LEASES: Dict[str, Any] = {}  # the lock objects this process holds, by workdir (gs://)
_LOCK_FDS: Dict[str, int] = {}  # the flocked LOCK files this process holds, by workdir
RUNNING_ELSEWHERE = -1000  # run_all's code for a run that another sweep process holds
OTHER_RUN = -1001  # run_all's code for a run whose directory holds a run of other overrides
_ROOT = cli.REPO  # where programs run


class Hyper:
  """The combinators of a sweep file; each returns a list of runs (dicts)."""

  @staticmethod
  def sweep(key: str, values: Iterable[Any]) -> List[Run]:
    return [{key: v} for v in values]

  @staticmethod
  def fixed(key: str, value: Any) -> List[Run]:
    return [{key: value}]

  @staticmethod
  def product(lists: Sequence[List[Run]]) -> List[Run]:
    runs = [{}]
    for options in lists:
      twice = sorted({k for r in runs for k in r} & {k for o in options for k in o})
      if twice:  # one list's values would silently replace the other's
        raise ValueError(f'{twice[0]} is set by two of the lists the sweep combines (two '
                         '--sweep/--set of it, or --sweep and the sweep file); give all its '
                         'values in one')
      runs = [dict(r, **o) for r in runs for o in options]
    return runs

  @staticmethod
  def zip(*lists: List[Run]) -> List[Run]:
    if len({len(x) for x in lists}) > 1:
      raise ValueError(f'h.zip needs lists of equal length, got {[len(x) for x in lists]}')
    keys = [sorted({k for run in runs for k in run}) for runs in lists]
    twice = sorted({k for ks in keys for k in ks if sum(k in other for other in keys) > 1})
    if twice:  # one list's values would silently replace the other's
      raise ValueError(f'{twice[0]} is set by two of the lists h.zip pairs; give all its '
                       'values in one')
    return [dict(itertools.chain.from_iterable(d.items() for d in ds)) for ds in zip(*lists)]


def parse_value(text: str, kind: type = type(None)) -> Any:
  """The value of `text` for a field of type `kind`: a str field's is the text as given; a
  bool field's true/false (or 1/0); a float field's a float ('0' -> 0.0: one run, whichever
  way it is written), an int field's an int; a field of another or no set type takes the
  first that reads: 'true'/'false' -> bool, '3' -> 3, '1e-4' -> 0.0001, else the text."""
  low = text.lower()
  if kind is str:
    return text
  if kind in (int, float):  # (a value the type cannot read: check_keys names the field)
    if low in ('none', 'null'):
      return None  # (which check_keys refuses: a default of None is had by leaving it out)
    try:
      return kind(text)
    except ValueError:
      pass
    if kind is int:  # a whole number written as a float: 1e3 -> 1000, 10.0 -> 10
      try:
        number = float(text)
      except ValueError:
        number = float('nan')
      if number.is_integer():
        return int(number)
  if kind is bool:
    if low not in ('true', 'false', '1', '0'):
      raise ValueError(f'{text!r} is not true or false, which this bool field takes')
    return low in ('true', '1')
  if low in ('true', 'false'):
    return low == 'true'
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def assignment_key(item: str) -> str:
  """'config.model.variant=x' (or without 'config.') -> 'model.variant'."""
  return item.partition('=')[0].removeprefix('config.')


def parse_assignments(items: Sequence[str], *, multi: bool,
                      types: Optional[Dict[str, type]] = None) -> List[List[Run]]:
  """['a=1,2', 'b=x'] -> [h.sweep('a', [1, 2]), h.sweep('b', ['x'])]; `types` (field_types)
  reads each value as its field's type."""
  out = []
  for item in items or ():
    key, sep, values = item.partition('=')
    if not sep or not key:
      raise ValueError(f'{item!r}: write key=value{",value..." if multi else ""}')
    key = assignment_key(item)
    vals = values.split(',') if multi else [values]
    try:
      out.append(Hyper.sweep(key, [parse_value(v, (types or {}).get(key, type(None)))
                                   for v in vals]))
    except ValueError as e:
      raise ValueError(f'{key}: {e}; fix the {"--sweep" if multi else "--set"} value'
                       ) from None
  return out


def field_types(config: str) -> Dict[str, type]:
  """{dotted key: its type} of the fields of `config` (a config file and its argument, as
  --config takes it); {} for what this cannot read (another program's argument)."""
  cfg = _load(config)
  return {} if cfg is None else {k: holder.get_type(k.rpartition('.')[2])
                                  for k, holder in _fields(cfg).items()}


def _load(config: str):
  """The ConfigDict of `config`, None if it names no Python config file."""
  path = config.partition(':')[0]
  if os.path.isdir(path if os.path.isabs(path) else os.path.join(_ROOT, path)):
    raise ValueError(f'--config {path} is a folder; give a config file such as '
                     'configs/pretrain.py:<variant>,<size>')
  return cli.load_config(config) if path.endswith('.py') else None


def _fields(c, prefix: str = '') -> Dict[str, Any]:
  """{dotted key: the ConfigDict holding it} of every field of `c`."""
  out = {}
  for k, v in c.items():
    out.update(_fields(v, f'{prefix}{k}.') if hasattr(v, 'items') else {f'{prefix}{k}': c})
  return out


def expand(sweeps: Sequence[str] = (), fixed: Sequence[str] = (), seeds: int = 1,
           sweep_file: Optional[str] = None, first_seed: int = 0,
           types: Optional[Dict[str, type]] = None) -> List[Run]:
  """Runs of the command-line sweep (and/or a sweep file), each with a 'seed'; `types`
  (field_types) reads the command line's values as their fields' types."""
  lists = (parse_assignments(sweeps, multi=True, types=types) +
           parse_assignments(fixed, multi=False, types=types))
  if sweep_file:
    if not os.path.isfile(sweep_file):
      raise ValueError(f'--sweep_file {sweep_file} not found; give a Python file that '
                       'defines get_hyper(h)')
    namespace = {}
    try:
      with open(sweep_file) as f:
        exec(compile(f.read(), sweep_file, 'exec'), namespace)  # pylint: disable=exec-used
      if 'get_hyper' not in namespace:
        raise ValueError(f'{sweep_file} defines no get_hyper(h); see realformer/tools/sweep.py')
      hyper = namespace['get_hyper'](Hyper)
      if not isinstance(hyper, list) or not all(isinstance(r, dict) for r in hyper):
        raise ValueError(f'{sweep_file}: get_hyper(h) returned {type(hyper).__name__}, not a '
                         'list of runs; return h.product([...]) (or h.sweep, h.zip)')
      lists.append(hyper)
    except ValueError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(cli.code_error(f'--sweep_file {sweep_file}', e)) from e
  if seeds < 1:
    raise ValueError(f'--seeds={seeds}: need at least one seed')
  if any('seed' in run for runs in lists for run in runs):
    raise ValueError('seed is not a --sweep/--set key: --seeds N runs N seeds of each '
                     f'setting ({first_seed}, {first_seed + 1}, ...)')
  lists.append(Hyper.sweep('seed', range(first_seed, first_seed + seeds)))
  runs = [{k: float(v) if _is_number(v) and (types or {}).get(k) is float else v
           for k, v in run.items()} for run in Hyper.product(lists)]  # a sweep file's 0 too
  names = run_names(runs)
  if len(set(names)) != len(names):
    if len({json.dumps(r, sort_keys=True) for r in runs}) == len(runs):
      first = next(n for n in names if names.count(n) > 1)
      raise ValueError(f'two runs of the sweep would share the folder {first!r} (values that '
                       'differ only in characters a folder name cannot hold); give values '
                       'that differ in letters or digits')
    seen = [json.dumps(r, sort_keys=True) for r in runs]
    twice = next(r for r, s in zip(runs, seen) if seen.count(s) > 1)
    raise ValueError(f'the sweep repeats a run ({run_name(twice)} twice: two values of a '
                     '--sweep key that read the same, such as 1e-4 and 0.0001); check '
                     '--sweep/--set')
  return runs


def _fmt(value: Any) -> str:
  return repr(value) if isinstance(value, float) else str(value)


def varying_keys(runs: Sequence[Run]) -> List[str]:
  """The keys whose value differs between runs (plus 'seed'): what names a run."""
  keys = {k for r in runs for k in r}
  return sorted(k for k in keys
                if k == 'seed' or len({_fmt(r.get(k)) for r in runs}) > 1)


def run_name(run: Run, keys: Optional[Sequence[str]] = None) -> str:
  """Stable, readable, filesystem-safe: the (varying) keys sorted, seed last."""
  keys = [k for k in (run if keys is None else keys) if k in run]
  keys = sorted(k for k in keys if k != 'seed') + (['seed'] if 'seed' in keys else [])
  name = re.sub(r'[^A-Za-z0-9._=,+-]', '_', ','.join(f'{k}={_fmt(run[k])}' for k in keys))
  if len(name) > 200:  # file names stop at 255 bytes
    name = name[:180] + '-' + format(zlib.crc32(name.encode()), '08x')
  return name or 'default'


def run_names(runs: Sequence[Run], always: Sequence[str] = ()) -> List[str]:
  """Names from the varying keys, plus the keys `always` (a grid's axes: one-value grids
  run into the same root then get names of their own)."""
  keys = sorted(set(varying_keys(runs)) | set(always))
  return [run_name(r, keys) for r in runs]


def program_and_config(program: str, config: str) -> Dict[str, str]:
  """What a run's command.json records: the program's file name and the config file (its
  path from the repository root, where runs start) with its argument."""
  file, colon, arg = config.partition(':') if '.py:' in config else (config, '', '')
  if file.endswith('.py'):
    file = os.path.relpath(os.path.join(_ROOT, file), _ROOT)  # (an absolute path too)
  return {'program': os.path.basename(program), 'config': file + colon + arg}


def read_overrides(workdir) -> Optional[Run]:
  """The run <workdir>/overrides.json records (None: no such file); one line naming the
  file and the fix where it is not a JSON object."""
  path = storage.path(workdir) / RunDir.OVERRIDES
  if not path.exists():
    return None
  try:
    run = json.loads(path.read_text())
    if not isinstance(run, dict):
      raise ValueError(f'a JSON {type(run).__name__}, not an object')
  except ValueError as e:
    raise ValueError(f'{path} is not readable JSON ({e}); restore it (the run\'s '
                     '--config.<key>=<value> overrides) or delete its folder') from None
  return run


def other_run(workdir: str, run: Run, command_of: Optional[Dict[str, str]] = None
              ) -> List[str]:
  """How the run recorded in `workdir` differs from `run`, key by key ([] if it does not),
  compared as the command-line text each value becomes (a run sees nothing else), and, given
  `command_of` (program_and_config), by its program and config file."""
  recorded = read_overrides(workdir)
  if recorded is None:
    return []
  mine, theirs = _as_text(run), _as_text(recorded)
  differ = [f'{k} {recorded.get(k)!r} (asked {run.get(k)!r})'
            for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
  command_path = storage.path(workdir) / RunDir.COMMAND
  if command_of and command_path.exists():
    ran = json.loads(command_path.read_text())
    differ += [f'--{k} {ran.get(k)!r} (asked {v!r})' for k, v in command_of.items()
               if ran.get(k) != v]
  return differ


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_text(run: Run) -> Dict[str, str]:
  """The run's values as compared: the text each becomes, a whole float's as an int's (0
  and 0.0 are one value of a float field: an earlier sweep may have recorded either)."""
  return {k: _fmt(int(v) if isinstance(v, float) and v.is_integer() else v)
          for k, v in json.loads(json.dumps(run)).items()}  # (JSON's types)


def command(program: str, config: str, workdir: str, run: Run) -> List[str]:
  """The argv of one run: `python <program> --config C --workdir W --config.k=v ...`."""
  argv = [sys.executable, program, '--config', config, '--workdir', workdir]
  argv += [f'--config.{k}={_fmt(v)}' for k, v in sorted(run.items())]
  return argv


def check_program(program: str, config: str) -> None:
  """One-line errors, before any run starts: a program that is not a file of the repository,
  or train.py / finetune.py given the other's config (cli.check_program)."""
  if not os.path.isfile(os.path.join(_ROOT, program)):
    raise ValueError(f'--program {program}: no such file in {_ROOT}; give train.py or '
                     'finetune.py')
  cfg = _load(config)
  if cfg is not None and os.path.basename(program) in cli.PROGRAMS:
    cli.check_program(cfg, os.path.basename(program))


def check_keys(config: str, runs: Sequence[Run], *, here: bool = True,
               flags: str = '--sweep/--set'):
  """One-line errors, before any run starts (each run would otherwise fail the same way):
  an override key the config does not have, or a value its field cannot take (the runs
  pass values as --config.<key>=<text>, which the field's type parses; None has no text);
  then each run's whole config as its program checks it (a fine-tuning kind's checks only
  `here`, where the runs start: they may read its files). `flags`: where the program's
  overrides come from, as the errors name them."""
  import difflib  # pylint: disable=g-import-not-at-top
  cfg = _load(config)
  if cfg is None:
    return  # not a config file this can read (another program's argument)
  known = _fields(cfg)  # dotted key -> the ConfigDict holding it
  for key in sorted({k for run in runs for k in run}):
    if key not in known:
      close = difflib.get_close_matches(key, sorted(known), n=1)
      hint = f' (did you mean {close[0]}?)' if close else ''
      raise ValueError(f'{key} is not a field of {config}{hint}; fix the {flags} key')

  def kind(key):  # the field's type, also where its default is None (a typed placeholder)
    return known[key].get_type(key.rpartition('.')[2])
  for run in runs:
    for key, value in run.items():
      holder, name = known[key], key.rpartition('.')[2]
      current = holder[name]
      try:
        if value is None:
          raise TypeError
        if kind(key) in (str, type(None)):
          continue  # text (or a field without a set type) takes any value
        if kind(key) is bool:  # absl reads true/false and 1/0 (parse_value: bool, int)
          if value not in (True, False) or isinstance(value, float):
            raise TypeError
        elif isinstance(value, bool):
          raise TypeError  # a bool is an int to Python, not to absl
        elif current is None:
          if not isinstance(value, (int, float) if kind(key) is float else kind(key)):
            raise TypeError
        else:
          holder.copy_and_resolve_references()[name] = value
      except TypeError:
        fix = ('leave the key out of the run (its default stands)' if value is None else
               f'fix the {flags} value')
        raise ValueError(f'{key}={value!r} does not fit the field ({kind(key).__name__}, '
                         f'now {current!r}); {fix}') from None
  def whole(run):  # the run's config, as --config.<key>=<text> would set it
    full = cfg.copy_and_resolve_references()
    for key, value in run.items():
      if key == 'seed':
        continue
      *path, name = key.split('.')
      holder = full
      for part in path:
        holder = holder[part]
      holder[name] = (bool(value) if kind(key) is bool else
                      _fmt(value) if kind(key) is str else value)
    return full

  if 'model' in cfg and 'variant' in cfg.model and 'train' in cfg:  # a pretraining config:
    from data import pretraining  # pylint: disable=g-import-not-at-top
    from realformer import config_checks  # pylint: disable=g-import-not-at-top
    # (a variant, a step count, the warm-up, lengths..., the objective)
    check = lambda full: (config_checks.check_config(full), pretraining.check_objective(full))
  elif 'benchmark' in cfg and 'task' in cfg and here:  # a fine-tuning config: its kind's
    import jax  # pylint: disable=g-import-not-at-top
    from realformer.finetune import registry  # pylint: disable=g-import-not-at-top
    from realformer.train import partitioning  # pylint: disable=g-import-not-at-top
    # Over a mesh of one device, never the machine's: a sweep process that started a GPU
    # backend would hold the memory its runs need (a batch that does not split over the
    # runs' devices stays the run's own one line).
    one = jax.sharding.AbstractMesh((1,) * len(partitioning.MESH_AXES), partitioning.MESH_AXES)
    check = lambda full: registry.get(full.benchmark).checked_config(full, one)
  else:
    return
  for run in runs:
    try:
      check(whole(run))
    except ValueError as e:
      changed = ', '.join(f'{k}={v}' for k, v in run.items() if k != 'seed')
      which = f'the run with {changed}' if changed else f'{config} itself'
      raise ValueError(f'{which}: {e}; fix the {flags} value') from None
  if 'variant' in cfg.get('model', {}):  # pretraining: runs that share a prepared corpus
    from data import pretraining as objectives  # pylint: disable=g-import-not-at-top
    by_dir = {}
    for run in runs:
      full = whole(run)
      if full.data.prepared_dir:
        by_dir.setdefault(str(full.data.prepared_dir), []).append((run, full))
    for folder, shared in by_dir.items():
      kinds = {objectives.of_config(f).instances_name
               for _, f in shared}
      if len(kinds) > 1:
        raise ValueError(f'runs of objectives whose instances differ ({", ".join(sorted(kinds))})'
                         f' share data.prepared_dir={folder}, which holds one kind; leave '
                         'data.prepared_dir empty (each run prepares into its own workdir), '
                         'or give each objective its own (a --sweep_file h.zip of objective '
                         'and data.prepared_dir)')
      seeds = {r.get('seed', cfg.get('seed', 0)) if f.data.get('seed') is None else
               f.data.seed for r, f in shared}  # each preparation's seed
      if len(seeds) > 1:
        raise ValueError(f'the runs of several seeds share data.prepared_dir={folder}, '
                         'whose preparation takes the run\'s seed: --set data.seed=0 to '
                         'prepare it once for every seed (runs a root holds already, '
                         'started without it, are then started again in folders of their '
                         'own: give the new setting its own --root)')


def _log_records(workdir: str) -> List[dict]:
  """<workdir>/metrics.jsonl's records (metrics_jsonl.records: the history of the run the
  workdir holds, past a line cut short by a kill)."""
  return metrics_jsonl.records(storage.join(workdir, RunDir.METRICS))


def last_step(workdir: str) -> int:
  """The largest 'step' in <workdir>/metrics.jsonl (-1 without one)."""
  return max((record['step'] for record in _log_records(workdir)), default=-1)


def is_done(workdir: str, run: Optional[Run] = None) -> bool:
  """Whether the run in `workdir` finished, also when no sweep process saw it end (a printed
  script's run, a sweep killed meanwhile): its DONE marker; a fine-tuning run's results.json
  (written last); a pretraining run's complete checkpoint at its train.num_steps, or, with
  train.time_budget_minutes, one whose time record (time_spent.json) says the budget was
  spent (each the run's override, else its config.json). The last checkpoint is saved after
  the last evaluation, so a run that stopped after logging its last step is not finished."""
  path = storage.path(workdir)
  if (path / RunDir.DONE).exists() or (path / RunDir.RESULTS).exists():
    return True
  run = run or {}
  train = {}
  if (path / RunDir.CONFIG).exists():
    try:
      train = json.loads((path / RunDir.CONFIG).read_text()).get('train', {})
    except (ValueError, AttributeError):
      return False
  steps = run.get('train.num_steps', train.get('num_steps'))
  minutes = run.get('train.time_budget_minutes', train.get('time_budget_minutes'))
  complete = checkpoints.complete_steps(workdir)
  if isinstance(steps, int) and steps in complete:
    return True
  if not (isinstance(minutes, (int, float)) and minutes > 0 and complete and
          (path / RunDir.TIME_SPENT).exists()):
    return False
  spent = json.loads((path / RunDir.TIME_SPENT).read_text())
  return spent.get(str(complete[-1]), 0.0) >= minutes * 60


def acquire(workdir: str) -> bool:
  """Takes <workdir>/LOCK (RunDir.SWEEP_LOCK) for this process; False while another sweep
  process holds it (held_by says who).

  Locally the lock is an flock on LOCK, held while the run runs, with this host and pid
  written in it: two sweep processes on a host never both take it, and one that died lets
  go of it with its process (its record, whose pid may since be another process's, is
  then overwritten). A record naming another host is respected: a folder shared between
  hosts may not carry their flocks (remove the file by hand when that host's sweep is
  gone). A file system without flocks is refused in one line. In a bucket the lock is a
  leased object (storage.Lease), taken over once its lease has expired.
  """
  if storage.is_url(workdir):
    lease = storage.Lease(storage.join(workdir, RunDir.SWEEP_LOCK),
                          storage.holder_record('sweep.py'))
    try:
      lease.take()
    except storage.HeldError:
      return False
    _LEASES[workdir] = lease
    return True
  path = os.path.join(workdir, RunDir.SWEEP_LOCK)
  fd = storage.lock_file(path, wait=False, fix='so two sweeps could run it at once: use a '
                         '--root on a local disk, or a gs:// bucket')
  if fd is None:  # a live sweep process holds it
    return False
  host = os.pread(fd, 256, 0).decode(errors='replace').strip().partition(' ')[0]
  if host and host != socket.gethostname():
    os.close(fd)
    return False
  os.ftruncate(fd, 0)  # free: never held, or its process died
  os.pwrite(fd, f'{socket.gethostname()} {os.getpid()}'.encode(), 0)
  _LOCK_FDS[workdir] = fd
  return True


def held_by(workdir: str) -> str:
  """Who holds the run's lock that acquire did not take, in words."""
  if storage.is_url(workdir):
    return 'another sweep process is running it'
  path = os.path.join(workdir, RunDir.SWEEP_LOCK)
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      host = f.read(256).strip().partition(' ')[0]
  except OSError:
    host = ''
  if host and host != socket.gethostname():
    return (f'a sweep process on {host} is running it (remove {path} if that host\'s '
            'sweep is gone)')
  return 'another sweep process is running it'


def release(workdir: str):
  if workdir in _LEASES:
    _LEASES.pop(workdir).release()
    return
  fd = _LOCK_FDS.pop(workdir, None)
  if fd is None:
    return
  try:
    os.remove(os.path.join(workdir, RunDir.SWEEP_LOCK))  # before the flock goes: never another's
  except FileNotFoundError:
    pass
  os.close(fd)


def holds_nothing(workdir: str) -> bool:
  """Whether a run's folder holds nothing that another run in it could lose: a run a sweep
  ran here, or a printed SLURM job (its log.txt), that failed before its first checkpoint (a
  path mistyped, say), neither finished nor diverged, and that no program holds (a run
  still starting or running elsewhere keeps its folder, as does a printed run never
  started). Its folder goes to the run asked for now, whatever the first one's settings
  were."""
  path = storage.path(workdir)
  keep = (RunDir.DONE, RunDir.RESULTS, RunDir.DIVERGED, RunDir.BEST, RunDir.FINAL, RunDir.DATA)
  lock = path / RunDir.LOCK  # (a run holding it: emptied, or deleted in a bucket, on release)
  log, recorded = path / RunDir.LOG, path / RunDir.OVERRIDES
  try:  # the log of the run its overrides.json records, not of one before it
    ran = storage.mtime(log) >= storage.mtime(recorded)
  except OSError:
    return False
  if 'not finished: stopped by' in log_tail(workdir):
    return False  # stopped to be resumed (a requeued job's, say): its folder, still
  return ran and not (
      any((path / name).exists() for name in keep) or checkpoints.complete_steps(workdir)
      or (lock.exists() and lock.read_bytes().strip()))


def _not_to_start(workdir: str, run: Run, say, command_of: Dict[str, str]) -> Optional[int]:
  """run_all's code for a run it leaves alone, said with `say`; None for one to start."""
  differ = other_run(workdir, run, command_of)
  if differ and holds_nothing(workdir):
    say(f'takes the folder of a run that stopped before its first checkpoint '
        f'({"; ".join(differ)})')
    return None
  if differ:
    say(f'{workdir} holds a run with other overrides ({"; ".join(differ)}); left alone. '
        'Give this sweep its own --root')
    return OTHER_RUN
  if is_done(workdir, run):
    say('finished, skipped')
    return 0
  return None


def run_all(runs: Sequence[Run], *, root: str, program: str, config: str,
            echo=print, always: Sequence[str] = (), counted: Tuple[int, int] = (0, 0),
            label: str = '') -> Dict[str, int]:
  """Runs one after another; returns {name: exit code}: 0 for finished runs (also those
  skipped as finished), RUNNING_ELSEWHERE for runs another live sweep holds, OTHER_RUN for
  names whose directory holds a run with other overrides, or of another program or config
  file (never reused, never resumed). Each line says `[n/N] <label><name>`: `counted`, the
  runs of the same call before these and in all (a grid's tasks; (0, 0): these alone)."""
  codes = {}
  command_of = program_and_config(program, config)
  root = absolute(root)
  names = folder_names(root, runs, always)
  before, total = counted if counted[1] else (0, len(runs))
  for i, (run, name) in enumerate(zip(runs, names)):
    workdir = storage.join(root, name)

    said = set()  # (the look is taken twice, before and after the lock: each line once)

    def say(text, i=i, name=name, said=said):
      if text not in said:
        said.add(text)
        echo(f'[{before + i + 1}/{total}] {label}{name}: {text}')
    if (code := _not_to_start(workdir, run, say, command_of)) is not None:
      codes[name] = code
      continue
    storage.path(workdir).mkdir(parents=True, exist_ok=True)
    if not acquire(workdir):
      say(f'{held_by(workdir)}, skipped')
      codes[name] = RUNNING_ELSEWHERE
      continue
    # Again with the lock held: another sweep may have run it (or another run may have
    # taken the folder) between the look above and the lock.
    if (code := _not_to_start(workdir, run, say, command_of)) is not None:
      release(workdir)
      codes[name] = code
      continue
    try:
      storage.write_text(storage.join(workdir, RunDir.OVERRIDES),
                         json.dumps(run, indent=1, sort_keys=True))
      storage.write_text(storage.join(workdir, RunDir.COMMAND), json.dumps(command_of))
      argv = command(program, config, workdir, run)
      steps = checkpoints.complete_steps(workdir)
      say((f'resumes from step {steps[-1]}: ' if steps else '') + shlex.join(argv)
          + f'  (output: {storage.join(workdir, RunDir.LOG)})')
      code, stopped = _call_logged(argv, storage.join(workdir, RunDir.LOG))
      if code == 0:
        storage.write_text(storage.join(workdir, RunDir.DONE), '')
      else:
        echo(f'  {_why_failed(code, workdir)}; see {workdir}/log.txt')
    finally:
      release(workdir)
    codes[name] = code
    if stopped:  # SIGTERM or Ctrl-C: the run saved (or finished); start no other
      echo(f'not finished: stopped by a signal after {name}; run the same command to go on '
           f'(exit status {EXIT_NOT_FINISHED})')
      sys.exit(EXIT_NOT_FINISHED)
  return codes


def log_tail(workdir: str, size: int = 4000) -> str:
  """The end of the run's log.txt (its last `size` bytes, read alone) as text; '' without
  one."""
  try:
    with storage.open_binary(storage.join(workdir, RunDir.LOG)) as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - size))
      return f.read().decode('utf-8', 'replace')
  except OSError:
    return ''


def mark_diverged(workdir: str) -> bool:
  """After a failed run: True (and <workdir>/diverged.json written) when its log says its
  loss or gradient norm became nan/inf: a result of its settings, which running it again
  would repeat (a study's or a grid's later calls leave it out), not a failure to resume."""
  match = re.search(r'(loss|gradient norm) became (nan|inf|-inf) at step (\d+)',
                    log_tail(workdir))
  if not match:
    return False
  storage.write_text(storage.join(workdir, RunDir.DIVERGED), json.dumps(
      {'what': match.group(1), 'value': match.group(2), 'step': int(match.group(3))}))
  return True


def is_diverged(workdir: str, run: Optional[Run] = None,
                command_of: Optional[Dict[str, str]] = None) -> bool:
  """Whether `workdir` holds a diverged.json (mark_diverged) of `run`: a folder that holds a
  run of other settings (other_run) holds none of this one's."""
  return (storage.path(storage.join(workdir, RunDir.DIVERGED)).exists() and
          not (run and other_run(workdir, run, command_of)))


def diverged(root: str, runs: Sequence[Run], always: Sequence[str] = (),
             command_of: Optional[Dict[str, str]] = None) -> List[bool]:
  """is_diverged of each run in its folder under `root`."""
  names = folder_names(absolute(root), runs, always)
  return [is_diverged(storage.join(absolute(root), n), run, command_of)
          for n, run in zip(names, runs)]


def failed_or_diverged(root: str, codes: Dict[str, int]) -> Tuple[List[str], List[str]]:
  """run_all's codes -> (names of runs that failed, names of runs that diverged: marked by
  mark_diverged). A run held elsewhere has not failed; one refused for a folder of other
  settings (OTHER_RUN) has, and is never marked (the log there is the other run's)."""
  failed, gone = [], []
  for name, code in codes.items():
    if code in (0, RUNNING_ELSEWHERE):
      continue
    if code != OTHER_RUN and mark_diverged(storage.join(root, name)):
      gone.append(name)
    else:
      failed.append(name)
  return failed, gone


def absolute(root: str) -> str:
  """A local root as an absolute path (runs start from the repository root); URLs as given."""
  return root if storage.is_url(root) else os.path.abspath(root)


def _canonical(run: Run) -> str:
  return json.dumps(_as_text(run), sort_keys=True)  # as the command line gives it


def folder_names(root: str, runs: Sequence[Run], always: Sequence[str] = ()) -> List[str]:
  """Each run's folder under `root`: the folder that already records it (its overrides.json:
  an earlier sweep's, named by the fewer keys that varied then), else run_names' name, or,
  where a folder of that name records another run that holds something (a sweep or grid
  extended in its root with another --set, which run_names leaves out of the names), that
  name with the keys the two differ in: folders of its own, the first runs' left alone."""
  recorded, taken = {}, {}
  if storage.path(root).is_dir():
    for path in storage.path(root).iterdir():
      run = read_overrides(path) if path.is_dir() else None
      if run is None:
        continue
      recorded.setdefault(_canonical(run), path.name)
      taken[path.name] = run
  keys = set(varying_keys(runs)) | set(always)
  names = []
  for run in runs:
    name = recorded.get(_canonical(run)) or run_name(run, sorted(keys))
    if (name in taken and _canonical(taken[name]) != _canonical(run)
        and not holds_nothing(storage.join(root, name))):
      mine, theirs = _as_text(run), _as_text(taken[name])
      name = run_name(run, sorted(keys | {k for k in set(mine) | set(theirs)
                                          if mine.get(k) != theirs.get(k)}))
      if name in taken and _canonical(taken[name]) != _canonical(run):  # taken as well
        name += '-' + format(zlib.crc32(_canonical(run).encode()), '08x')
    names.append(name)
  return names


def record_overrides(root: str, runs: Sequence[Run], names: Sequence[str],
                     command_of: Dict[str, str]) -> None:
  """Each run's overrides.json and command.json (`command_of`: program_and_config), before
  it is launched (what collect and run_all read)."""
  for run, name in zip(runs, names):
    path = storage.join(root, name, RunDir.OVERRIDES)
    workdir = storage.join(root, name)
    if not storage.path(path).exists() or (other_run(workdir, run, command_of) and
                                           holds_nothing(workdir)):
      storage.path(workdir).mkdir(parents=True, exist_ok=True)
      storage.write_text(path, json.dumps(run, indent=1, sort_keys=True))
      storage.write_text(storage.join(root, name, RunDir.COMMAND), json.dumps(command_of))


# How often a run's new output reaches its log in a bucket (while it prints, and while it
# is quiet: a long compile, a hung collective).
LOG_UPLOAD_SECONDS = 30.0


def _call_logged(argv, log_path: str) -> Tuple[int, bool]:
  """Runs argv with its output appended to `log_path` (a local file the run writes itself;
  in a bucket, through a local spool that this process uploads every LOG_UPLOAD_SECONDS
  while the run runs and when it ends: _copy_to_bucket); returns (its exit code, whether
  this process was asked to stop meanwhile). A SIGTERM or SIGINT (Ctrl-C) that this
  process gets is passed on to the run as SIGTERM, which saves and exits with the
  not-finished status; if this process dies without passing it on (kill -9), the run gets
  SIGTERM all the same (Linux's parent-death signal), so that no run trains on without its
  sweep, and a local log keeps its last lines (the run's save)."""
  local = not storage.is_url(log_path)
  if local:
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  log = (open(log_path, 'ab') if local else
         storage.GrowingFile(log_path, binary=True, upload_every=LOG_UPLOAD_SECONDS))
  stop = []
  try:
    with subprocess.Popen([sys.executable, '-c', _WITH_PARENT, str(os.getpid())] + argv,
                          cwd=_ROOT, stdout=log if local else subprocess.PIPE,
                          stderr=subprocess.STDOUT) as proc:
      def pass_on(signum, _):
        stop.append(signum)
        proc.send_signal(signal.SIGTERM)
      previous = {}
      if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, pass_on) for sig in workdir_lib.stop_signals()}
      try:
        if local:
          proc.wait()
        else:
          _copy_to_bucket(proc.stdout, log)
      finally:
        for sig, handler in previous.items():
          signal.signal(sig, handler)
    return proc.returncode, bool(stop)
  finally:
    try:
      log.close()
    except Exception as e:  # pylint: disable=broad-except
      if local or storage.fault(e) is None:
        raise
      tail = log.unsent()  # kept in the sweep's own output, which is not lost
      sys.stderr.write(f'sweep: the last {len(tail)} bytes of {log_path} could not be '
                       f'uploaded ({storage.short(e)}); they follow:\n'
                       f'{tail.decode("utf-8", "replace")}\n')


def _copy_to_bucket(out, log: storage.GrowingFile) -> None:
  """A run's output (the pipe `out`) into its log in a bucket as it comes, uploaded also
  while the run is quiet; an upload that fails (a storage fault) is said once and its
  bytes go with the next (the spool keeps them), and the run goes on."""
  said = False
  while True:
    if select.select([out], [], [], log.upload_every)[0]:
      chunk = os.read(out.fileno(), 1 << 16)
      if not chunk:
        return
      log.write(chunk)
    try:
      log.flush()
    except Exception as e:  # pylint: disable=broad-except
      if storage.fault(e) is None:
        raise
      if not said:
        said = True
        sys.stderr.write(f'sweep: uploading {log.path} failed ({storage.short(e)}); its lines '
                         'are kept and sent with the next upload\n')


# Run by a run's own interpreter before its program (this threaded process is never forked):
# asks for SIGTERM when the sweep's process ends (Linux's PR_SET_PDEATHSIG, kept across exec;
# elsewhere nothing), stops if the sweep is gone already, then becomes the program.
_WITH_PARENT = """import ctypes, os, signal, sys
try:
  ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
  pass
if os.getppid() != int(sys.argv[1]):
  sys.exit(75)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _why_failed(code: int, workdir: str) -> str:
  """A failed run's line for the sweep's output: its one-line error from the log's end."""
  if code == EXIT_NOT_FINISHED:
    return f'stopped before its end (exit {code}); run again to resume'
  errors = [l for l in log_tail(workdir, 8000).splitlines() if l.startswith('error: ')]
  if errors:
    return f'exit {code}: {errors[-1]}'
  if code < 0:  # a signal before the run could answer it (while it was starting)
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f'signal {-code}'
    steps = checkpoints.complete_steps(workdir)
    return (f'stopped by {name} (exit {code}), ' +
            (f'its last checkpoint step {steps[-1]}' if steps else 'before its first checkpoint')
            + '; run again to resume')
  return f'exit {code} (run again to resume)'


# Where launch_script's launches go (sweep.py print and study.py --print_only --target).
TARGETS = ('local', 'tpu', 'multislice', 'slurm')


def launch_script(runs: Sequence[Run], *, root: str, program: str, config: str,
                  target: str, tpu: str = '$TPU', zone: str = '$ZONE',
                  always: Sequence[str] = ()) -> str:
  """A shell script, one launch per run, for a TPU pod slice, several slices or a SLURM GPU
  cluster (each run's overrides.json is written into the root now, so that `run` and
  `summarize` know the runs the script starts).

  A run that finished or diverged (is_done, is_diverged) is left out, named in a comment,
  as `run` skips it. tpu: every worker of the slice runs the command in ~/realformer, and
  the root must be a gs:// URL (storage every host sees). multislice: the same on every
  worker of every slice of the queued resource $QR, all $WORKERS of them at once (gcloud's
  --batch-size; a run waits for all its processes). slurm: one task per node driving
  the node's GPUs, SIGTERM two minutes before the time limit and a requeue when the run
  stops to be resumed (exit 75), in this repository's folder (--chdir: a filesystem the
  nodes share, as the root must be); NODES, GPUS and CPUS set --nodes, --gpus-per-node and
  --cpus-per-task, and sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT the
  rest. local: from the repository root."""
  if target not in TARGETS:
    raise ValueError(f'unknown target {target!r}: use {", ".join(TARGETS)}')
  pod = target in ('tpu', 'multislice')
  if pod and not storage.is_url(root):
    raise ValueError(f'--root {root} is a local folder, which each TPU worker would have a '
                     'copy of; give a gs:// URL for runs on a pod slice')
  root = absolute(root)
  names = folder_names(root, runs, always)
  command_of = program_and_config(program, config)
  clashes = [(name, differ) for run, name in zip(runs, names)
             if (differ := other_run(storage.join(root, name), run, command_of))
             and not holds_nothing(storage.join(root, name))]
  if clashes:  # a printed run would resume, in place, the run its folder holds
    name, differ = clashes[0]
    raise ValueError(f'{len(clashes)} of the runs would go into folders of {root} that hold '
                     f'runs with other overrides (e.g. {name}: {"; ".join(differ)}); give this '
                     'sweep its own --root')
  lines = ['#!/usr/bin/env bash', f'# {len(runs)} runs of {program} {config}', 'set -e']
  if target == 'local':
    lines.append(f'cd {shlex.quote(_ROOT)}')
  if target == 'slurm':
    lines.append('# the root and this folder must be on a filesystem the nodes share; sbatch '
                 'reads SBATCH_PARTITION, SBATCH_ACCOUNT and SBATCH_TIMELIMIT from the '
                 'environment')
    if root.startswith(('/tmp/', '/dev/shm/')):
      print(f'warning: --root {root} is node-local on most clusters: the jobs\' compute '
            'nodes would not see it; give a folder on shared storage', file=sys.stderr)
  given = {'tpu': ((tpu, 'TPU', 'the name of the TPU VM'), (zone, 'ZONE', 'its zone')),
           'multislice': (('$QR', 'QR', 'the name of the queued resource'),
                          (zone, 'ZONE', 'its zone'),
                          ('$WORKERS', 'WORKERS', 'the workers of all its slices'))}
  for value, name, what in given.get(target, ()):
    if value == f'${name}':  # (given in the environment)
      lines.append(f': "${{{name}:?set {name} to {what} first}}"')
  for run, name in zip(runs, names):
    workdir = storage.join(root, name)
    if is_diverged(workdir, run, command_of) or is_done(workdir, run):
      lines.append(f'# {name}: {"diverged" if is_diverged(workdir) else "finished"}, '
                   'not launched')
      continue
    argv = command(program, config, workdir, run)
    # The cluster's interpreter, not this one: on a TPU VM the environment venv.sh made
    # in ~/realformer (docs/launching.md); under SLURM the job's own.
    argv[0] = '.venv/bin/python' if pod else 'python'
    cmd = shlex.join(argv)
    if target == 'tpu':
      lines.append(f'gcloud compute tpus tpu-vm ssh {tpu} --zone {zone} --worker=all '
                   f'--command {shlex.quote("cd ~/realformer && " + cmd)}')
    elif target == 'multislice':
      lines.append(f'gcloud compute tpus queued-resources ssh $QR --zone {zone} --node=all '
                   f'--worker=all --batch-size=$WORKERS '
                   f'--command {shlex.quote("cd ~/realformer && " + cmd)}')
    elif target == 'slurm':
      job = f'srun {cmd}; code=$?; [ $code -eq 75 ] && scontrol requeue $SLURM_JOB_ID; exit $code'
      output = ('' if storage.is_url(root) else  # (the job's log in the run's folder)
                f'--output={shlex.quote(storage.join(root, name, RunDir.LOG))} ')
      lines.append('sbatch --nodes=${NODES:-1} --ntasks-per-node=1 --gpus-per-node=${GPUS:-8} '
                   f'${{CPUS:+--cpus-per-task=$CPUS}} --chdir={shlex.quote(_ROOT)} '
                   '--signal=TERM@120 --requeue '
                   f'--open-mode=append {output}--job-name={shlex.quote(name[:100])} '
                   f'--wrap {shlex.quote(job)}')
    else:
      lines.append(cmd)
  record_overrides(root, runs, names, command_of)
  left_out = sum(line.endswith(', not launched') for line in lines)
  if left_out:
    lines[1] += f' ({left_out} finished or diverged, left out)'
  return '\n'.join(lines) + '\n'


# ---------------------------------------------------------------------------- summaries

def final_metrics(workdir: str, split: Optional[str] = 'eval') -> Dict[str, float]:
  """The last record of `split` (None: of every split) in <workdir>/metrics.jsonl, keys
  prefixed with the split (metrics_jsonl.records: the lines of a step merged)."""
  last = {}
  for record in _log_records(workdir):
    if split is None or record.get('split') == split:
      last[record.get('split')] = record
  return {f'{name}/{k}': v for name, record in last.items() for k, v in record.items()
          if k != 'split' and isinstance(v, (int, float))}


# What `sweep.py summarize` reports of pretraining runs without --metrics: the MLM figures of
# either objective (eval/loss adds NSP's under mlm_nsp alone), the majority predictor's
# accuracy on the same batches beside them, and NSP's where there is one.
PRETRAINING_METRICS = ('eval/mlm_accuracy', 'eval/mlm_majority_accuracy', 'eval/mlm_loss',
                       'eval/nsp_accuracy', 'eval/nsp_majority_accuracy')


def default_metrics(logged: Iterable[str]) -> List[str]:
  """The metrics summarised where none are named, from those the runs logged:
  PRETRAINING_METRICS where they logged a pretraining evaluation (or no evaluation at all),
  and fine-tuning's last dev evaluation (every <dev split>/<metric> but its step) where they
  logged one; both where a root holds runs of both programs."""
  logged = set(logged)
  dev = sorted(m for m in logged if m.startswith('dev') and not m.endswith('/step'))
  pretraining = any(m.startswith('eval/') for m in logged) or not dev
  return (list(PRETRAINING_METRICS) if pretraining else []) + dev


def collect(root: str, metrics: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
  """One row per run under root: its overrides, whether it finished ('done') or diverged,
  its program and config file ('command': command.json's, '' without one), its final
  `metrics` (None: default_metrics of what the finished runs logged, or, where none has
  finished, every run; every row holds the same names, in order) and the names of every
  metric it logged ('logged')."""
  rows = []
  if not storage.path(root).is_dir():
    raise FileNotFoundError(f'--root {root} is not a folder; pass the --root of a sweep')
  for name in sorted(p.name for p in storage.path(root).iterdir()):
    workdir = storage.join(root, name)
    run = read_overrides(workdir)
    if run is None:
      continue
    try:
      ran = json.loads((storage.path(workdir) / RunDir.COMMAND).read_text())
      ran = f'{ran["program"]} {ran["config"]}'
    except (OSError, ValueError, KeyError, TypeError):
      ran = ''
    rows.append({'run': run, 'done': is_done(workdir, run), 'command': ran,
                 'diverged': is_diverged(workdir), 'metrics': final_metrics(workdir, None)})
  if metrics is None:
    done = [r for r in rows if r['done']] or rows
    metrics = default_metrics(m for r in done for m in r['metrics'])
  for row in rows:
    values = row['metrics']
    row.update(metrics={m: values.get(m) for m in metrics}, logged=sorted(values))
  return rows


def check_metrics(rows: Sequence[Dict[str, Any]], metrics: Sequence[str], given: bool
                  ) -> List[str]:
  """The metrics to summarize: a one-line ValueError for a `given` metric that no finished
  run logged (a misspelling), or for default ones of which none was (runs of a program that
  logs neither evaluation), naming those the runs did log; the default ones that some run
  logged (not NSP's, of runs of MLM alone)."""
  done = [r for r in rows if r['done']]
  missing = [m for m in metrics if done and all(r['metrics'][m] is None for r in done)]
  if missing and (given or len(missing) == len(metrics)):
    logged = ", ".join(sorted({m for r in done for m in r['logged']})) or "nothing"
    if given:
      raise ValueError(f'--metrics {",".join(missing)}: no finished run logged it; they log '
                       f'{logged}')
    raise ValueError(f'no finished run logged the default metrics ({", ".join(missing)}); '
                     f'they log {logged}: name those to summarise with --metrics')
  return [m for m in metrics if m not in missing]


STATISTICS = ('mean', 'median', 'std', 'min', 'max')


def summarize(rows: Sequence[Dict[str, Any]], metrics: Sequence[str]):
  """Groups runs by their non-seed overrides: (header, table rows) with mean, median, std,
  min, max and n over the finished seeds for each metric, and how many runs of the setting
  are not finished (left out), and, where some did, how many diverged (not run again). Runs
  of several programs or config files (a root given two --config) are grouped apart, a
  'command' column first. Where no setting has two finished seeds, each metric is one
  column of its value (the five statistics would repeat it). A `best` column marks the
  setting of the best mean of the first metric (the lowest for a loss)."""
  groups = {}
  # (runs of before command.json, which records it, go with the root's one command)
  several = len({r.get('command') for r in rows} - {'', None}) > 1
  for row in rows:
    key = tuple(sorted((k, _fmt(v)) for k, v in row['run'].items() if k != 'seed'))
    if several:
      key = (('command', row.get('command') or ''),) + key
    groups.setdefault(key, []).append(row)
  swept = ['command'] * several + [k for k in varying_keys([r['run'] for r in rows])
                                   if k != 'seed']
  gone = any(r.get('diverged') for r in rows)
  header = (swept + ['n'] + [f'{m} {s}' for m in metrics for s in STATISTICS] +
            ['unfinished'] + ['diverged'] * gone)
  table = []
  for key, group in sorted(groups.items()):
    d = dict(key)
    line = [d.get(k, '') for k in swept]
    members = [r for r in group if r['done']]
    diverged = sum(1 for r in group if r.get('diverged') and not r['done'])
    n = 0
    cells = []
    for m in metrics:
      vals = [r['metrics'][m] for r in members if r['metrics'].get(m) is not None]
      n = max(n, len(vals))
      if vals:
        cells += [statistics.mean(vals), statistics.median(vals),
                  statistics.stdev(vals) if len(vals) > 1 else None, min(vals), max(vals)]
      else:
        cells += [None] * 5
    table.append(line + [n] + cells + [len(group) - len(members) - diverged] +
                 [diverged] * gone)
  if all(row[len(swept)] <= 1 for row in table):  # one seed: its values (the mean's column)
    keep = [i for i, h in enumerate(header)
            if not h.endswith(tuple(f' {s}' for s in STATISTICS[1:]))]
    header = [h[:-len(' mean')] if h.endswith(' mean') else h for h in (header[i] for i in keep)]
    table = [[row[i] for i in keep] for row in table]
  return _mark_best(header, table, metrics[0]) if metrics else (header, table)


def _mark_best(header, table, metric: str):
  """A `best` column where two settings or more have a value of `metric` (the first one
  summarised): 'best' at the highest mean (lowest for a loss), 'best (tied)' where
  settings share it."""
  column = header.index(f'{metric} mean' if f'{metric} mean' in header else metric)
  values = [row[column] for row in table if row[column] is not None]
  if len(values) < 2:
    return header, table
  top = (min if 'loss' in metric else max)(values)
  mark = 'best (tied)' if values.count(top) > 1 else 'best'
  at = header.index('unfinished')  # (before the counts of runs left out)
  return (header[:at] + ['best'] + header[at:],
          [row[:at] + [mark if row[column] == top else ''] + row[at:] for row in table])


def to_markdown(header, table) -> str:
  fmt = lambda v: '' if v is None else (f'{v:.4f}' if isinstance(v, float) else str(v))
  out = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  out += ['| ' + ' | '.join(fmt(v) for v in row) + ' |' for row in table]
  return '\n'.join(out) + '\n'


def to_csv(header, table) -> str:
  buf = io.StringIO()
  writer = csv.writer(buf)
  writer.writerow(header)
  writer.writerows(table)
  return buf.getvalue()


if __name__ == '__main__':
  sys.exit('error: realformer/tools/sweep.py is the sweeps\' library; run them with '
           '`python sweep.py run|print|summarize ...` from the repository root')
