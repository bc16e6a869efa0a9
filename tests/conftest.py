"""Test setup: 8 fake CPU devices (sharding tests) compiling at -O0, libtpu's compiles at
XLA's lowest effort, the repository root on sys.path, a compilation cache shared by the run's
workers and kept for the next run on this machine (in pytest's cache folder), and a garbage
collector that leaves the imports alone."""
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid


def cpu_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process (this one, and the programs the tests start) with
  `devices` CPU devices. The CPU backend compiles at LLVM's -O0: a tiny model's train step is
  thousands of small fusions, whose optimisation took most of the suite's time (about half
  of each compile, at the same HLO: XLA's own passes still run); the values agree with the
  optimised build's to rounding. TPU compiles ignore it (see JAX_OPTIMIZATION_LEVEL)."""
  return (f'--xla_force_host_platform_device_count={devices} '
          '--xla_backend_optimization_level=0')


os.environ.setdefault('XLA_FLAGS', cpu_xla_flags(8))
# XLA:TPU's compiler at its lowest effort for the launch check's compiles (libtpu, here and
# in the programs the tests start): a tiny train step for v5e:2x2 compiles in about half the
# time, and the point of each test (it compiles, it fits, its FLOPs are the model's, its
# kernels are there) is the same; the bytes it reports are the unoptimised program's. The
# CPU backend ignores it (its -O0 is in XLA_FLAGS). tests/test_launch.py's stack test keeps
# the default effort, where the compiler needed the larger stack.
os.environ.setdefault('JAX_OPTIMIZATION_LEVEL', 'O0')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
os.environ.setdefault('CUDA_VISIBLE_DEVICES', '')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# One OpenMP thread for torch (the HF references, the device suite's HF contenders) and
# OpenBLAS: pytest-xdist runs a test process per core, and a pool of two spin-waits for the
# core that the other worker holds (the smoke's HF fine-tuning epoch took 23 s instead of 5).
os.environ.setdefault('OMP_NUM_THREADS', '1')
# Nothing is downloaded in the tests: Hugging Face datasets come from local directories.
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
# Nothing asks a cloud metadata server: Google credential discovery (google-auth, gcsfs)
# would try 169.254.169.254; here it finds a closed loopback port at once, and google-auth
# does not look for one at all (NO_GCE_CHECK: without it, its three tries back off for 3 s
# before a missing-credentials error).
os.environ['GCE_METADATA_HOST'] = os.environ['GCE_METADATA_IP'] = '127.0.0.1:9'
os.environ['NO_GCE_CHECK'] = 'true'


SYSTEM_TEMP = tempfile.gettempdir()


def _run_folder() -> str:
  """A folder of this test run's own, one for all of pytest-xdist's workers (named by the
  run's id, which every worker has), else one for this process."""
  run = os.environ.get('PYTEST_XDIST_TESTRUNUID')
  if not run:
    return tempfile.mkdtemp(prefix='realformer_tests_', dir=SYSTEM_TEMP)
  path = os.path.join(SYSTEM_TEMP, f'realformer_tests_{run}')
  os.makedirs(path, exist_ok=True)
  return path


RUN_FOLDER = _run_folder()
# The storage tests' server is on 127.0.0.1: a request it does not answer in 10 s never will
# (the tests that stop it wait for the run to give up).
os.environ.setdefault('REALFORMER_STORAGE_SECONDS', '10')
# Local copies of bucket data (prepared shards) go to a folder of this run's (removed at its end).
os.environ.setdefault('REALFORMER_CACHE', os.path.join(RUN_FOLDER, f'cache_{os.getpid()}'))
# libtpu, loaded by the launch check's compiles, writes its logs to /tmp/tpu_logs unless told
# otherwise: here, to this run's folder.
os.environ.setdefault('TPU_LOG_DIR', os.path.join(RUN_FOLDER, 'tpu_logs'))
# torch (imported by transformers: the HF references) makes its inductor's cache folder in
# the temporary folder: here, in this run's.
os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', os.path.join(RUN_FOLDER, 'torchinductor'))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# PyPI's torch for Python 3.12 (the tests' HF reference) brings OpenAI's Triton, which torch
# imports if it is there; loading its compiler into a process where jax has already lowered a
# Pallas kernel to Triton (jaxlib's own) crashes the process. The tests use neither torch's
# GPU code nor Triton's package: `import triton` fails here, and torch goes without it.
sys.modules['triton'] = None

# Every program is written to the compilation cache (programs_folder, below), however fast it
# compiled: the next run on this machine loads the thousands of eager operations' programs too.
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'

# Python's cyclic garbage collector: jax's objects (imported here), alive for the whole run,
# are moved out of its view (gc.freeze), and it runs after 50,000 new container objects
# instead of 700: tracing makes many short-lived ones, and collecting them every 700 cost
# several percent of the suite. Reference counting still frees at once everything that is
# not in a cycle.
# pylint: disable=g-import-not-at-top,wrong-import-position
import gc
import jax  # pylint: disable=unused-import
from realformer.train import compile_cache
# pylint: enable=g-import-not-at-top,wrong-import-position
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 20)

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


# What the tests' compilation cache may hold on the disk between runs (pytest_configure trims it).
KEPT_PROGRAMS_BYTES = 2 * 1024 ** 3
CHECKED = '.checked'  # (trim's record of its last start)


def pytest_configure(config):
  """The run's id chosen here, where pytest-xdist's workers would have it chosen for them:
  the main process then knows their folder. The run's compilation cache opened (before any
  test compiles, and before its workers start: programs_folder). ml_collections' config_flags
  loads a config file with importlib's deprecated load_module (its warning is the library's
  to fix)."""
  main = not hasattr(config, 'workerinput')
  if main and getattr(config.option, 'testrunuid', '') is None:
    config.option.testrunuid = uuid.uuid4().hex
  root = programs_folder(config)
  if main and getattr(config, 'cache', None) is not None:
    if config.getoption('cacheclear'):
      shutil.rmtree(root, ignore_errors=True)
    trim(root, KEPT_PROGRAMS_BYTES)
    # (pytest's own files in its folder, CACHEDIR.TAG among them, come with its first record)
    config.cache.set('realformer/compilation_cache', root)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = compile_cache.enable(root)
  config.addinivalue_line('filterwarnings',
                          r'ignore:the load_module\(\) method is deprecated:DeprecationWarning')


def programs_folder(config) -> str:
  """The compilation cache of every program compiled in the run: the tests' own, and those
  of the processes they start, on both workers. A test that trains, stops and resumes, in
  this process or in children, or several tests building the same tiny model, compile each
  program once. The processes that choose their own cache (train.py's --compilation_cache)
  still do; the others open it through compile_cache.enable(), whose entries another process
  reads whole or not at all (with jax's own class one worker could read the other's
  half-written entry, warn and compile again), or through jax's variable (set here).

  It is `xla` in pytest's cache folder (.pytest_cache/xla, beside --lf's records), so the
  next run on this machine loads what this one compiled: a program's key covers its
  computation, XLA's flags and jax's version, and compile_cache's subfolder the processor
  (programs compiled for another processor are never read). `--cache-clear` empties it
  first (pytest_configure, in the main process: outside pytest's own d/ and v/, which every
  pytest-xdist worker clears again as it starts, when the other may be writing); two runs
  at once in one checkout share it, so one's --cache-clear there costs the other warnings
  of entries it could not write. Without pytest's cache (`-p no:cacheprovider`) the cache
  is the run's own, in its temporary folder, and goes with it. (Assigned, not defaulted: a
  cache the user's shell names is not the run's.)"""
  if getattr(config, 'cache', None) is not None:
    cache_dir = os.path.expandvars(os.path.expanduser(config.getini('cache_dir')))
    root = os.fspath(config.rootpath / cache_dir / 'xla')  # (as pytest resolves it)
  else:
    root = os.path.join(RUN_FOLDER, 'programs')
  os.environ['REALFORMER_COMPILATION_CACHE'] = root
  return root


def trim(folder: str, limit: int) -> None:
  """Prepares a compilation cache folder (every machine's subfolder) for a run: removes the
  entries written since the last trim that do not decompress, then the oldest files until it
  holds at most `limit` bytes (by the time each was written: the programs of the oldest
  code, and those that every run loads, which the run writes again).

  An entry that does not decompress was cut short by a process killed while jax's own cache
  class wrote it (the tests' programs that open the cache through JAX_COMPILATION_CACHE_DIR,
  not compile_cache.enable(); some are killed on purpose): that class never replaces an
  entry, and each process reading it would warn. (Each entry is read once, in the run after
  it was written: `folder`/CHECKED's time is the last trim's start.)"""
  checked = os.path.join(folder, CHECKED)
  try:
    since = os.stat(checked).st_mtime
  except FileNotFoundError:
    since = 0.0
  started = time.time()
  files = []
  for parent, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(parent, name)
      try:
        stat = os.stat(path)
        if name.endswith('-cache') and stat.st_mtime >= since and not _decompresses(path):
          os.remove(path)
          continue
      except FileNotFoundError:  # (a temporary file another run's writer renamed)
        continue
      files.append((stat.st_mtime, stat.st_size, path))
  total = sum(size for _, size, _ in files)
  for _, size, path in sorted(files):
    if total <= limit:
      break
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    total -= size
  if os.path.isdir(folder):
    with open(checked, 'w'):
      pass
    os.utime(checked, (started, started))


def _decompresses(path: str) -> bool:
  with open(path, 'rb') as f:
    return compile_cache.read_error(f.read()) is None


def pytest_unconfigure(config):
  """The main process, last to finish, removes the run's folders (its workers' and its own):
  a run leaves nothing in the temporary folder."""
  if hasattr(config, 'workerinput'):
    return
  run = getattr(config.option, 'testrunuid', None)
  if run:
    shutil.rmtree(os.path.join(SYSTEM_TEMP, f'realformer_tests_{run}'), ignore_errors=True)
  shutil.rmtree(RUN_FOLDER, ignore_errors=True)


@pytest.fixture(scope='session', autouse=True)
def temporary_files_in_the_run_folder(tmp_path_factory):
  """The temporary files that the tests' libraries make in this process go to the run's
  folder, removed at its end: tfds leaves an empty tmp*tfds folder behind for each builder
  of a dataset not prepared yet. (pytest's tmp_path folders stay in pytest's own, chosen
  first, where it keeps the last runs' for a failed test's inspection.)"""
  tmp_path_factory.getbasetemp()
  saved, tempfile.tempdir = tempfile.tempdir, RUN_FOLDER
  yield
  tempfile.tempdir = saved


@pytest.fixture(scope='session')
def commands():
  """Runs the project's command lines (`commands.run(['train.py', ...])`) as processes
  forked from an interpreter that has imported their libraries (tests/preloaded.py): one per
  worker, for the tests that start many short commands."""
  from tests.preloaded import Preloaded  # pylint: disable=g-import-not-at-top
  with Preloaded() as server:
    yield server
