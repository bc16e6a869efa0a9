"""Command lines of the project's programs (`train.py ...`, `-m data.prepare ...`) run as
processes forked from one interpreter that has already imported their libraries.

Each command runs in its own process, as `python <argv>` would: `__main__` is the program,
`sys.argv` and `sys.path[0]` are what the interpreter sets, its exit status is the process's,
its output is its own, atexit handlers run. What the fork saves is the import of jax, flax,
orbax and the project, seconds of a small machine for every command, where the tests of
the programs' one-line errors run dozens. What it cannot see is anything a
program prints while those libraries import; the tests of a quiet start run `python` itself.

    with Preloaded() as commands:
      result = commands.run(['train.py', '--workdir', path])  # in the repository's root
      result.returncode, result.stdout, result.stderr

The server (`python -m tests.preloaded`) reads one JSON command per line on stdin and
answers one JSON line per command; it never initialises a jax backend, so each command
reads XLA_FLAGS and the devices afresh.
"""

import atexit
import dataclasses
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
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

# Read by jax when it is imported: a command may not change them (the server imported jax).
_READ_AT_IMPORT = ('JAX_', 'TF_CPP_')


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
    self._proc.stdin.close()
    self._proc.wait(timeout=60)

  def run(self, argv: Sequence[str], cwd: str = REPO,
          env: Optional[Dict[str, str]] = None) -> Result:
    """`python *argv` in `cwd` with `env` (default: the server's), to its exit."""
    if not (argv[0] == '-m' or str(argv[0]).endswith('.py')):
      raise ValueError(f'{argv[0]!r}: give a .py program or -m and a module')
    env = self.env if env is None else dict(env)
    changed = sorted(k for k in set(env) | set(self.env)
                     if k.startswith(_READ_AT_IMPORT) and env.get(k) != self.env.get(k))
    if changed:
      raise ValueError(f'{changed} are read when jax is imported: start a Preloaded with them')
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
      sys.argv = ['-m'] + argv[2:]  # run_module puts the module's file first
      sys.path[0] = os.getcwd()
      runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
    else:
      sys.argv = list(argv)
      sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
      runpy.run_path(argv[0], run_name='__main__')
    return 0
  except SystemExit as e:
    return _exit_code(e.code)
  except BaseException as e:  # pylint: disable=broad-except
    tb = e.__traceback__  # from the program's own frames, as python prints it
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, '<frozen runpy>'):
      tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    return 1


def _command(request: dict, scratch: str) -> dict:
  out, err = os.path.join(scratch, 'stdout'), os.path.join(scratch, 'stderr')
  pid = os.fork()
  if pid == 0:  # the command's process
    code = 1
    try:
      os.chdir(request['cwd'])
      os.environ.clear()
      os.environ.update(request['env'])
      for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                             (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                             (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(path, mode), fd)
      sys.stdout = sys.__stdout__  # the server had pointed it at stderr
      signal.alarm(TIMEOUT_S)  # a command that hangs is killed (status -14)
      code = _run_as_main(request['argv'])
      atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)  # pylint: disable=protected-access
  _, status = os.waitpid(pid, 0)
  with open(out, errors='replace') as o, open(err, errors='replace') as e:
    return {'returncode': os.waitstatus_to_exitcode(status), 'stdout': o.read(),
            'stderr': e.read()}


def serve() -> None:
  import importlib  # pylint: disable=g-import-not-at-top
  for module in PRELOAD:
    importlib.import_module(module)
  answers = sys.stdout
  sys.stdout = sys.stderr  # nothing a library prints may break the protocol
  # Not a TemporaryDirectory: its clean-up runs at exit, and the commands run the atexit
  # handlers they inherit.
  scratch = tempfile.mkdtemp()
  try:
    for line in sys.stdin:
      answers.write(json.dumps(_command(json.loads(line), scratch)) + '\n')
      answers.flush()
  finally:
    shutil.rmtree(scratch)


if __name__ == '__main__':
  serve()
