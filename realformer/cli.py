"""Command-line entry points: flag and config-override mistakes as one line, status 1.

    app.run(main, flags_parser=cli.parse_flags)

absl parses `--config.<key>=<value>` overrides while it parses flags; an unknown key raises
ml_collections' AttributeError from deep inside (a 49-line traceback whose last line holds
the suggestion), and a value of the wrong type a two-line "FATAL Flags parsing error".
Both become `error: ...` with the fix. `--verbose_errors` (or REALFORMER_VERBOSE_ERRORS=1)
keeps the traceback.
"""

import contextlib
import difflib
import errno
import logging as logging_std
import os
import re
import signal
import sys
import threading
import traceback
import types
from typing import List, Optional

from absl import flags

from realformer import platforms

# The repository root: where the programs run and config file paths are relative to.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where a message embeds a traceback (ml_collections wraps a config file's own exception in
# one), its last line is the message.
_EMBEDDED = re.compile(
    r'Traceback \(most recent call last\):.*\n(?:\w+\.)*\w+(?:Error|Exception): ', re.S)


def _override_path(key: str) -> str:
  """The dotted path of the command line's --config.<path>=... override that ends in `key`
  (ml_collections names the last key alone), else `key`."""
  paths = {arg[len('--config.'):].split('=', 1)[0] for arg in sys.argv[1:]
           if arg.startswith('--config.')}
  ending = [p for p in paths if p.rpartition('.')[2] == key]
  return ending[0] if len(ending) == 1 else key  # (two that end so: which one is not said)


def _nearest_keys(path: str, default_config: Optional[str]) -> List[str]:
  """The --config file's dotted keys (the command line's, else `default_config`) that an
  unknown override `path` may have meant: those ending in its last part (a field given
  without its section: learning_rate for optimizer.learning_rate), else the closest
  spellings. [] where the file cannot be read."""
  given = [a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--config=')]
  given += [b for a, b in zip(sys.argv[1:], sys.argv[2:]) if a == '--config']
  try:
    config = load_config((given or [default_config])[0])
  except Exception:  # pylint: disable=broad-except  (a hint only: the error stands without)
    return []

  def keys(node, prefix=''):
    for name, value in node.items():
      yield prefix + name
      if hasattr(value, 'items'):
        yield from keys(value, f'{prefix}{name}.')
  known = list(keys(config))
  last = path.rpartition('.')[2]
  return ([k for k in known if k.rpartition('.')[2] == last][:3]
          or difflib.get_close_matches(path, known, n=2, cutoff=0.75))


def _one_line(e: BaseException, default_config: Optional[str] = None) -> str:
  text = _EMBEDDED.sub('', str(e)).strip()
  if isinstance(e, (AttributeError, KeyError)):
    text = text.strip('\'"')
    m = re.search(r"'?\\?'?(\w+)\\?'?.*?Did you mean \"(\w+)\"", text, re.S)
    if m:
      path = _override_path(m.group(1))
      return (f'unknown config key {path!r} (did you mean '
              f'{path[:len(path) - len(m.group(1))] + m.group(2)!r}?); the fields and their '
              f'meaning are in the config file')
    key = re.sub(r'[\\\'"]', '', text.splitlines()[0]) if text else '?'
    path = _override_path(key)
    near = _nearest_keys(path, default_config)
    if near:
      return (f'unknown config key {path!r} (did you mean {" or ".join(map(repr, near))}?); '
              'the fields and their meaning are in the config file')
    return f'unknown config key {path!r}; check its spelling against the config file'
  text = ' '.join(text.split())
  if isinstance(e, flags.IllegalFlagValueError) and text.startswith('flag --config.'):
    text += "; give a value of the field's type (the config file shows it)"
  return text


_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError)


def _verbose(argv) -> bool:
  return '--verbose_errors' in argv or os.environ.get('REALFORMER_VERBOSE_ERRORS') == '1'


@contextlib.contextmanager
def config_overrides(default_config: Optional[str] = None):
  """Around config_flags.DEFINE_config_file(..., default_config), which applies the command
  line's --config.<key>=<value> overrides when it is called (an unknown key fails there)."""
  try:
    yield
  except _ERRORS as e:
    if _verbose(sys.argv):
      raise
    print(f'error: {_one_line(e, default_config)}', file=sys.stderr)
    sys.exit(1)


def fail(message: str):
  """A usage mistake found outside run_main: `error: <message>`, exit status 1."""
  print(f'error: {" ".join(message.split())}', file=sys.stderr)
  sys.exit(1)


# The programs' configs: what each is, and its file.
PROGRAMS = {'train.py': ('pretraining', 'configs/pretrain.py:<variant>,<size>'),
            'finetune.py': ('fine-tuning', 'configs/finetune.py:<kind>/<task>')}


def program_of(config) -> Optional[str]:
  """The program whose config `config` is: train.py (a model and a train section),
  finetune.py (a benchmark), or None (neither)."""
  if 'model' in config and 'train' in config:
    return 'train.py'
  return 'finetune.py' if 'benchmark' in config else None


def check_program(config, program: str) -> None:
  """A one-line ValueError when `config` is another program's (the two config files
  swapped), instead of the KeyError deep in the run that the missing section would raise."""
  theirs = program_of(config)
  if theirs != program:
    what = (f'a {PROGRAMS[theirs][0]} config: run it with {theirs}' if theirs else
            'not a config of train.py or finetune.py')
    raise ValueError(f'--config is {what}, or give {program} a {PROGRAMS[program][0]} config '
                     f'({PROGRAMS[program][1]})')


def refuse_arguments(argv) -> None:
  """train.py and finetune.py take flags only: a stray word (a setting without its
  --config.) would otherwise be ignored while the run trains with the default."""
  if len(argv) > 1:
    fail(f'unexpected arguments {argv[1:]}; settings go in --config.*')


def _config_load_error(e: OSError) -> str:
  """ml_collections' deferred 'Failed loading config file' (a config file that cannot be
  read), without its list of attempted paths."""
  errno = re.findall(r'\[Errno \d+\] (.+)', str(e))
  why = errno[-1] if errno else ' '.join(str(e).split())
  return (f'cannot load the --config file: {why}; pass a config file such as '
          'configs/pretrain.py:<variant>,<size>')


def code_error(what: str, e: BaseException) -> str:
  """A user's Python file (a --config file, a sweep file) failed in its own code: a syntax
  error, an exception while it ran. Where (the innermost frame) and what, in one line."""
  if isinstance(e, SyntaxError):
    where, why = f'{e.filename}, line {e.lineno}', f'SyntaxError: {e.msg}'
  else:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where, why = f'{frame.filename}, line {frame.lineno}', f'{type(e).__name__}: {e}'
  return f'{what} failed ({where}): {why}; fix the file (--verbose_errors shows the traceback)'


def _config_code_error(e: BaseException) -> str:
  return code_error('the --config file', e)


_HELP = ('-h', '--help', '--helpshort', '--helpfull')


def _config_file_of(argv) -> Optional[str]:
  """The path of argv's --config file (without its ':<args>'), or None."""
  given = [a.partition('=')[2] if a.startswith('--config=') else argv[i + 1]
           for i, a in enumerate(argv) if a == '--config' and i + 1 < len(argv)
           or a.startswith('--config=')]
  return os.path.realpath(given[-1].partition(':')[0]) if given else None


def _config_file_mistake(e: BaseException, argv) -> Optional[str]:
  """Where `e` was raised in the code of argv's --config file (get_config's own mistake: a
  field the locked config does not have, a name a module does not have), its one line,
  at the file's line; else None (a mistake of the command line's)."""
  config_file = _config_file_of(argv)
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if config_file and os.path.realpath(f.filename) == config_file]
  if not frames:
    return None
  where = f'{frames[-1].filename}, line {frames[-1].lineno}'
  text = str(e)
  m = re.search(r'Key "(\w+)" does not exist.*?Did you mean "(\w+)"', text, re.S)
  why = (f'the config has no field {m.group(1)!r} (did you mean {m.group(2)!r}?)' if m else
         f'{type(e).__name__}: {" ".join(text.split())[:300]}')
  return (f'the --config file failed ({where}): {why}; fix the file (--verbose_errors shows '
          'the traceback)')


def parse_flags(argv):
  """flags_parser for absl's app.run. A --config file that cannot be read is reported
  here: ml_collections defers that error to the config's first use. While flags are
  parsed the only user code that runs is the --config file, so any other exception is
  that file's own failure (a syntax error, get_config raising). `--help` (or -h) exits 0."""
  platforms.skip_absent_tpu()  # before anything asks jax for its devices
  verbose = _verbose(argv)
  argv = [{'-h': '--help'}.get(a, a) for a in argv if a != '--verbose_errors']
  try:
    try:
      remaining = flags.FLAGS(argv)
    except SystemExit:  # absl's --help prints the flags, then exits 1
      if any(a in _HELP for a in argv[1:]):
        sys.exit(0)
      raise
    for name in flags.FLAGS:
      value = flags.FLAGS[name].value
      if type(value).__name__ == '_ErrorConfig':
        value.lock  # raises the deferred OSError  # pylint: disable=pointless-statement
    return remaining
  except AttributeError as e:
    if verbose:
      raise
    mistake = _config_file_mistake(e, argv)  # (not an unknown key of an override)
    if mistake:
      fail(mistake)
    if re.search(r'has no attribute .?get_config', str(e)):
      fail('the --config file defines no get_config(); give a config file such as '
           'configs/pretrain.py:<variant>,<size>')
    fail(_one_line(e))
  except _ERRORS as e:
    if verbose:
      raise
    mistake = isinstance(e, KeyError) and _config_file_mistake(e, argv)
    if mistake:
      fail(mistake)
    if 'before a value for --config was specified' in str(e):  # (ml_collections' order)
      fail(f'{_one_line(e)}; give --config <file> before its --config.<key> overrides')
    fail(_one_line(e))
  except OSError as e:
    if verbose:
      raise
    if ('Failed loading config file' in str(e) or 'earlier failure to load' in str(e)):
      fail(_config_load_error(e))
    fail(_config_code_error(e))
  except Exception as e:  # pylint: disable=broad-except
    if verbose:
      raise
    fail(_config_code_error(e))


def parse_tool_flags(define, argv=None, *, prog: str, doc: str, positional=()):
  """A tool's command line on absl flags, the flag system of train.py and finetune.py (the
  same `--flag=value` and `--flag value`, `--[no]bool`, repeated multi flags, `--flagfile`).

  define(flag_values) declares the tool's flags on a fresh FlagValues, so that main(argv) can
  run more than once in a process. argv excludes the program's name (sys.argv[1:] when None);
  `positional` names the words it takes besides flags, in order, each optional; a last name
  starting with '*' takes every word left, as a list. Returns (flags as a namespace,
  {positional name: word}). `--help` prints `doc` and the flags and exits 0; a mistake (an
  unknown or missing flag, a bad value, a stray word) is one line, `error: ... (see <prog>
  --help)`, exit status 1."""
  values = flags.FlagValues()
  define(values)
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in _HELP for a in argv):
    words = [f'[{w[1:]}...]' if w.startswith('*') else f'[{w}]' for w in positional]
    print(' '.join(['usage:', prog, *words, '[flags]']))
    print(f'\n{doc.strip()}\n\nflags:')
    for name in sorted(values):
      if values[name].help and name not in ('flagfile', 'undefok'):
        print(f'  --{name}: {values[name].help} (default: {values[name].default_as_str})')
    print('  --verbose_errors: an error\'s traceback too, not only its line')
    sys.exit(0)
  try:
    words = values([prog] + argv)[1:]
  except flags.Error as e:
    text = ' '.join(str(e).split())
    m = re.match(r'flag --(\w+)=None: Flag --\w+ must have a value other than None', text)
    fail((f'--{m.group(1)} is required' if m else text) + f' (see {prog} --help)')
  named = [w for w in positional if not w.startswith('*')]
  if len(words) > len(named) and len(named) == len(positional):
    fail(f'unexpected argument {words[len(named)]!r} (see {prog} --help)')
  args = types.SimpleNamespace(**{name: values[name].value for name in values
                                  if name not in ('flagfile', 'undefok')})
  given = dict(zip(named, words))
  if len(named) < len(positional):
    given[positional[-1]] = words[len(named):]
  return args, given


def command(argv, commands: dict, prog: str):
  """A tool's first word, its command (before the command's flags), as in
  `sweep.py run --root R`: returns (command, the rest of argv). An absent or unknown command
  is one line naming the choices; `--help` alone lists them."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in commands:
    return argv[0], argv[1:]
  if argv and argv[0] in ('-h', '--help'):
    print(f'usage: {prog} {{{",".join(commands)}}} [flags]\n')
    for name, what in commands.items():
      print(f'  {name}: {what}')
    print(f'\n{prog} <command> --help lists its flags')
    sys.exit(0)
  given = f'unknown command {argv[0]!r}' if argv else 'no command given'
  fail(f'{given}; choose one of {", ".join(commands)} (see {prog} --help)')


class QuietLibraries(logging_std.Filter):
  """Keep the console readable: drop orbax's per-save INFO lines, and its warning that an
  item directory has no _CHECKPOINT_METADATA (orbax writes that file per step, not per
  item, and warns about its absence at every restore). Other warnings still show."""

  def filter(self, record):
    if '/orbax/' not in record.pathname:
      return True
    if record.levelno < logging_std.WARNING:
      return False
    return not str(record.msg).startswith('Metadata file does not exist')


@contextlib.contextmanager
def warnings_only():
  """absl's INFO lines off while a tool prints its result (the libraries' progress lines
  would drown it), and the absl logger's level as it was afterwards: a tool's main() called
  from Python leaves the session's logging as it found it."""
  absl_logger = logging_std.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging_std.WARNING)
  try:
    yield
  finally:
    absl_logger.setLevel(level)


def load_config(config: str):
  """`path.py[:arg]` -> the ConfigDict its get_config(arg) returns (paths relative to the
  repository root, where the programs run)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path, _, arg = config.partition(':')
  full = path if os.path.isabs(path) else os.path.join(REPO, path)
  if not os.path.isfile(full):
    raise FileNotFoundError(f'config file {path} not found; give a config file such as '
                            'configs/pretrain.py:<variant>,<size>')
  spec = importlib.util.spec_from_file_location('_config_file', full)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if not hasattr(module, 'get_config'):
      raise ValueError(f'the --config file {path} defines no get_config(); give a config '
                       'file such as configs/pretrain.py:<variant>,<size>')
    return module.get_config(arg) if arg else module.get_config()
  except ValueError:
    raise  # the config's own message for a bad argument (an unknown size, ...)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(code_error(f'the --config file {path}', e)) from e


# The user errors every entry point reports as one line (a bad path, a bad value, a busy
# workdir); anything else is a bug and keeps its traceback.
class UserError(Exception):
  """A state of the user's making whose message says what to do (e.g. a run directory
  held by another run): reported as one line, like the USER_ERRORS."""


USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError, FileExistsError, UserError)

# The fix for an operating system's refusal of a path the user gave (by errno).
_PATH_FIXES = {
    errno.ENOENT: 'check the path',
    errno.EEXIST: 'a file is in the way: choose another path or move the file',
    errno.ENOTDIR: 'a part of the path is a file, not a folder: choose another path',
    errno.EISDIR: 'give a file there, not a folder',
    errno.EACCES: 'choose a path you may write, or change its permissions',
    errno.EPERM: 'choose a path you may write, or change its permissions',
    errno.EROFS: 'the file system is read-only: choose a writable path',
    errno.ENOSPC: 'the disk is full: free space or choose another disk',
}


def _message(e: BaseException) -> str:
  """One line; an OSError straight from the operating system ('[Errno 17] File exists:
  ...') gets the path and the fix."""
  if (isinstance(e, OSError) and e.filename is not None and e.errno in _PATH_FIXES
      and str(e).startswith('[Errno')):
    return f'{e.strerror}: {e.filename!r}; {_PATH_FIXES[e.errno]}'
  return ' '.join(str(e).split())


def _unraised_site(e: BaseException) -> str:
  """Where an error that no `raise` statement made came from (an unpacking, an int() of a
  word, a shape a library refused inside a call), as ' (<Type> at <file>, line <n>; ...)':
  the innermost frame outside Python's installation and its packages (this repository's
  code, a task or component file of one's own), else the innermost. '' for an error raised
  on purpose, whose message names the fix, for one whose line has no source to tell, and
  for the system's refusal of a path (its message names the path)."""
  frames = traceback.extract_tb(e.__traceback__)
  if (not frames or not frames[-1].line or frames[-1].line.startswith('raise')
      or (isinstance(e, OSError) and e.filename is not None)):
    return ''  # (on purpose; a line without source, as exec's; the system's, naming its path)
  installed = tuple({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix)})
  ours = [f for f in frames if not os.path.abspath(f.filename).startswith(installed)
          and 'site-packages' not in f.filename and not f.filename.startswith('<')]
  frame = (ours or frames)[-1]
  where = frame.filename
  if os.path.abspath(where).startswith(REPO + os.sep):
    where = os.path.relpath(where, REPO)
  return (f' ({type(e).__name__} at {where}, line {frame.lineno}; --verbose_errors shows '
          'the traceback)')


EXIT_INTERRUPTED = 130  # the shell's status for a program stopped by SIGINT
STOPPED_BY_CTRL_C = 'stopped by Ctrl-C'


def exit_at_once_on(signals, message: str, status: int, before=None) -> None:
  """From now on each of `signals` ends this process at once: `before()`, `message` on
  stderr, os._exit(status), wherever the signal lands (an exception raised there could be
  swallowed, as in a callback of XLA's compiler, or crash the interpreter's shutdown under
  XLA's threads). Only the main thread may set handlers: elsewhere this does nothing."""
  if threading.current_thread() is not threading.main_thread():
    return

  def stop(*_):
    if before is not None:
      before()
    print(message, file=sys.stderr, flush=True)
    os._exit(status)  # pylint: disable=protected-access
  for sig in signals:
    signal.signal(sig, stop)


def stop_at_once_on_ctrl_c() -> None:
  """For a program that saves nothing (the launch check): Ctrl-C ends it with `stopped by
  Ctrl-C` and status 130 at the next Python instruction of the main thread (at the latest
  when the compile in progress returns), where a KeyboardInterrupt raised in a callback of
  XLA's compiler was swallowed and a search of batch sizes went on compiling. Not where
  SIGINT was ignored at start (a script's background job)."""
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    exit_at_once_on((signal.SIGINT,), STOPPED_BY_CTRL_C, EXIT_INTERRUPTED)


def _absl_format() -> None:
  """A tool's log lines in absl's format (`W1201 10:00:00.123456 4242 file.py:10] ...`), as
  train.py's and finetune.py's. absl's app.run installs its own handler; without it, a
  library that logs through absl first (orbax, as it imports) has Python's basicConfig()
  handler made, which printed `WARNING:absl:...`. That default handler (made here where
  there is none yet) writes absl's format from now on in this process; logging that was
  configured (a level or a format of one's own, absl's handler) is left as it is."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  root = logging_std.getLogger()
  if (root.level != logging_std.WARNING or
      any(isinstance(h, absl_logging.ABSLHandler) for h in root.handlers)):
    return
  if not root.handlers:
    logging_std.basicConfig()
  for handler in root.handlers:
    if getattr(handler.formatter, '_fmt', None) == logging_std.BASIC_FORMAT:
      handler.setFormatter(absl_logging.PythonFormatter())


def run_main(main, *args, also=()):
  """main(*args) with user errors (USER_ERRORS, a busy workdir, and the types in `also`)
  as `error: <message>` and exit status 1, and a Ctrl-C as `stopped by Ctrl-C` and status
  130 (the traceback with --verbose_errors or REALFORMER_VERBOSE_ERRORS=1). Returns main's
  result. Starts no TPU backend on a machine without TPUs (platforms.skip_absent_tpu)."""
  platforms.skip_absent_tpu()
  _absl_format()
  absl_logger = logging_std.getLogger('absl')  # also where absl's app.run does not handle it
  if not any(isinstance(f, QuietLibraries) for f in absl_logger.filters):
    absl_logger.addFilter(QuietLibraries())
  verbose = _verbose(sys.argv)
  if '--verbose_errors' in sys.argv:
    sys.argv.remove('--verbose_errors')
  try:
    return main(*args)
  except KeyboardInterrupt:  # (a training loop saves on Ctrl-C: workdir.stop_signals)
    if verbose:
      raise
    print(STOPPED_BY_CTRL_C, file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)
  except USER_ERRORS + tuple(also) as e:
    if verbose:
      raise
    _storage_fault(e)  # a missing bucket comes as a FileNotFoundError of a URL
    _disk_full(e)
    print(f'error: {_message(e)}{_unraised_site(e)}', file=sys.stderr)
    sys.exit(1)
  except OSError as e:  # a path the system refused (read-only, full, ...); others are bugs
    if verbose or e.errno not in _PATH_FIXES or e.filename is None:
      if not verbose:
        _storage_fault(e)
        _disk_full(e)
      raise
    print(f'error: {_message(e)}', file=sys.stderr)
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except
    if not verbose:
      _storage_fault(e)
      _disk_full(e)
      _peer_lost(e)
    raise


# What a collective's error says when another process of the job stopped: Gloo's connection
# (CPU), NCCL's (GPU: "remote process exited or there was a network error"), the coordination
# service's missed heartbeats.
_PEER_LOST = re.compile(r'Connection (closed|reset) by peer|remote process exited|'
                        r'heartbeat timeout|tasks are unhealthy')


def _peer_lost(e: BaseException) -> None:
  """A collective that failed because another process of a multi-process job stopped (a
  node lost, a process killed): one line, and an exit that skips jax's shutdown barrier
  (which would wait a minute and more for the stopped process, then abort). Returns where
  `e` is not that."""
  jax = sys.modules.get('jax')
  if (jax is None or not isinstance(e, jax.errors.JaxRuntimeError)
      or not _PEER_LOST.search(str(e)) or jax.process_count() == 1):
    return
  first = str(e).strip().splitlines()[0]
  print(f'error: a collective of this job failed ({first[:200]}): another process stopped or '
        'cannot be reached (its log, or its node\'s, says why); run the same command to '
        'resume from the last complete checkpoint', file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def _disk_full(e: BaseException) -> None:
  """A write the disk had no room for, however the library that wrote reports it (an OSError
  of ENOSPC; a checkpoint's tensorstore error, prepared data's array_record error, as text),
  or a prepared data file that reads back damaged (array_record's Riegeli check): one line,
  exit status 1 (what was committed before it is complete and kept). Returns where `e`'s
  chain holds neither."""
  from realformer import storage  # pylint: disable=g-import-not-at-top
  for e in storage.chain(e):
    first = ' '.join((str(e).strip().splitlines() or [''])[0].split())[:300]
    if getattr(e, 'errno', None) == errno.ENOSPC or 'No space left on device' in str(e):
      print(f'error: the disk is full ({type(e).__name__}: {first}); free space or choose '
            'another disk, then run the same command again: what was committed before it (a '
            'checkpoint, prepared data) is kept', file=sys.stderr)
      sys.exit(1)
    if 'Corrupted Riegeli' in str(e):
      print(f'error: a prepared data file is damaged ({type(e).__name__}: {first}); delete the '
            'prepared data (the run\'s data/ folder, or data.prepared_dir) and run the same '
            'command again: it prepares the data anew and resumes', file=sys.stderr)
      sys.exit(1)


def _storage_fault(e: BaseException) -> None:
  """A bucket that does not exist, or object storage that stopped answering: one line, exit
  status 1 (what was committed before it, a checkpoint, prepared data, is complete and
  kept). Returns where `e` is neither."""
  from realformer import storage  # pylint: disable=g-import-not-at-top
  bucket = storage.missing_bucket(e)
  if bucket is not None:
    print(f'error: the bucket gs://{bucket} does not exist, or this machine\'s account cannot '
          f'see it; create it (gcloud storage buckets create gs://{bucket}) or fix the URL',
          file=sys.stderr)
    sys.exit(1)
  cause = storage.fault(e)
  if cause is not None:
    fix = ("give this machine's account access to the bucket, then run the same command "
           'again' if storage.refused(cause) else
           'run the same command again once the storage answers')
    print(f'error: storage failed ({type(cause).__name__}: {_message(cause)}); what was '
          f'committed before it is kept: {fix}', file=sys.stderr)
    sys.exit(1)
