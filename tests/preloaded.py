"""Command lines of the project's programs (`train.py ...`, `-m data.prepare ...`) run as
processes forked from one interpreter that has already imported their libraries.

Each command runs in its own process, as `python <argv>` would: `__main__` is the program
(its absolute `__file__`), `sys.argv` and `sys.path[0]` are what the interpreter sets, its
exit status is the process's, its output is its own, its threads are joined and its atexit
handlers run at exit. What the fork saves is the import of jax, flax, orbax and the project,
seconds of a small machine for every command, where the tests of the programs' one-line
errors run dozens. What it cannot see is what happens while those libraries import: a
program that fails or prints there, or the environment variables read then (a command may
not change those: `run` refuses). So every program also starts from `python` itself in the
tests (tests/test_workdir.py), and the tests of a quiet start run `python`.

    with Preloaded() as commands:
      result = commands.run(['train.py', '--workdir', path])  # in the repository's root
      result.returncode, result.stdout, result.stderr

The server (`python -m tests.preloaded`) reads one JSON command per line on stdin and
answers one JSON line per command; it never initialises a jax backend, so each command
reads XLA_FLAGS and finds its devices afresh.
"""

import atexit
import builtins
import dataclasses
import importlib
import importlib.machinery
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the programs import: the libraries and the project's packages, not the programs
# themselves (their absl flags are defined when each runs as __main__).
PRELOAD = ('jax', 'jax.numpy', 'flax.linen', 'optax', 'orbax.checkpoint', 'ml_collections',
           'absl.app', 'absl.flags', 'absl.logging', 'realformer.cli',
           'realformer.train.pretraining', 'realformer.train.trainer',
           'realformer.train.compile_cache', 'realformer.train.distributed',
           'realformer.finetune.registry', 'realformer.tools.analysis',
           'realformer.tools.sweep')

TIMEOUT_S = 240

# Environment variables read by the interpreter or while PRELOAD imports (by prefix): the
# server's values hold for every command, so a command may not change them.
READ_AT_START = ('PYTHON', 'LANG', 'LC_', 'TMPDIR', 'OMP_', 'OPENBLAS_', 'JAX_', 'TF_CPP_',
                 'FLAX_', 'NNX_', 'ABSL_', 'TPU_', 'REALFORMER_STORAGE_SECONDS')


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str
  stderr: str


class Preloaded:
  """The server process, started on entering and stopped on leaving."""

  def __init__(self, env: Optional[Dict[str, str]] = None):
    self.env = dict(os.environ if env is None else env)
    self._proc = None

  def __enter__(self) -> 'Preloaded':
    self._proc = subprocess.Popen([sys.executable, '-m', 'tests.preloaded'], cwd=REPO,
                                  env=self.env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    return self

  def __exit__(self, *exc):
    try:
      self._proc.stdin.close()
      self._proc.wait(timeout=60)
    finally:
      if self._proc.poll() is None:
        self._proc.kill()
        self._proc.wait()

  def run(self, argv: Sequence[str], cwd: str = REPO,
          env: Optional[Dict[str, str]] = None) -> Result:
    """`python *argv` in `cwd` with `env` (default: os.environ now), to its exit."""
    if not (argv[0] == '-m' or str(argv[0]).endswith('.py')):
      raise ValueError(f'{argv[0]!r}: give a .py program or -m and a module')
    if not os.path.isdir(cwd):
      raise FileNotFoundError(f'cwd {cwd!r} is not a directory')
    env = dict(os.environ if env is None else env)
    changed = sorted(k for k in set(env) | set(self.env)
                     if k.startswith(READ_AT_START) and env.get(k) != self.env.get(k))
    if changed:
      raise ValueError(f'{changed} are read as the server starts: run python, or start a '
                       'Preloaded with them')
    self._proc.stdin.write(json.dumps({'argv': [str(a) for a in argv], 'cwd': str(cwd),
                                       'env': env}) + '\n')
    self._proc.stdin.flush()
    line = self._proc.stdout.readline()
    if not line:
      raise RuntimeError(f'the preloaded server exited ({self._proc.wait()})')
    return Result(**json.loads(line))


def _exit_code(code) -> int:
  """The status `python` gives for SystemExit(code)."""
  if code is None:
    return 0
  if isinstance(code, int):
    return code
  print(code, file=sys.stderr)
  return 1


def _run_as_main(argv: List[str]) -> int:
  """What the interpreter does with `python *argv` once it has started."""
  try:
    if argv[0] == '-m':
      import runpy  # pylint: disable=g-import-not-at-top
      sys.argv = ['-m'] + argv[2:]  # run_module puts the module's file first
      sys.path[0] = os.getcwd()
      runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
    else:
      path = os.path.abspath(argv[0])
      sys.argv = list(argv)
      sys.path[0] = os.path.dirname(path)
      main = types.ModuleType('__main__')
      main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                           __loader__=importlib.machinery.SourceFileLoader('__main__', path))
      sys.modules['__main__'] = main  # the program's, for its atexit handlers too
      with open(path, 'rb') as f:
        code = compile(f.read(), path, 'exec', dont_inherit=True)
      exec(code, main.__dict__)  # pylint: disable=exec-used
    return 0
  except SystemExit as e:
    return _exit_code(e.code)
  except BaseException as e:  # pylint: disable=broad-except
    tb = e.__traceback__  # from the program's own frames, as python prints it
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, '<frozen runpy>'):
      tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1


def _child(request: dict, out: str, err: str, answers: int) -> None:
  """The command's process, from the fork to its exit."""
  code = 1
  try:
    try:
      os.close(answers)
      os.chdir(request['cwd'])
      os.environ.clear()
      os.environ.update(request['env'])
      for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                             (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                             (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
      sys.stdout = sys.__stdout__  # the server had pointed it at stderr
      sys.modules['numpy'].random.seed()  # its own global draws, as a fresh numpy seeds them
      signal.alarm(TIMEOUT_S)  # a command that hangs is killed (status -14)
      code = _run_as_main(request['argv'])
      threading._shutdown()  # pylint: disable=protected-access  # as python exits: joins
      atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
      for stream in (sys.stdout, sys.stderr):
        try:
          stream.flush()
        except BaseException:  # pylint: disable=broad-except  # a program may close them
          pass
  finally:
    if code == -signal.SIGINT:  # python's end after an uncaught KeyboardInterrupt
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)  # pylint: disable=protected-access


def _command(request: dict, scratch: str, answers: int) -> dict:
  folder = tempfile.mkdtemp(dir=scratch)  # the command's own output files
  out, err = os.path.join(folder, 'stdout'), os.path.join(folder, 'stderr')
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    _child(request, out, err, answers)
  _, status = os.waitpid(pid, 0)
  try:
    with open(out, errors='replace') as o, open(err, errors='replace') as e:
      return {'returncode': os.waitstatus_to_exitcode(status), 'stdout': o.read(),
              'stderr': e.read()}
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def serve() -> None:
  # The answers go to a copy of fd 1, and fd 1 becomes stderr before anything imports:
  # nothing printed (by Python or C) can break the protocol.
  answers = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  for module in PRELOAD:
    importlib.import_module(module)
  # Not a TemporaryDirectory: its clean-up is an atexit handler, which commands inherit.
  scratch = tempfile.mkdtemp()
  try:
    for line in sys.stdin:
      answers.write(json.dumps(_command(json.loads(line), scratch, answers.fileno())) + '\n')
      answers.flush()
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
  serve()
