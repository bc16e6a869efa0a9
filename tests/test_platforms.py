"""realformer.platforms: with libtpu installed and no TPU attached, a program starts jax on the
machine's own platforms without a word from libtpu; without libtpu, without jax's line on the
TPU backend it could not start; a TPU VM and a user's JAX_PLATFORMS are left alone."""

import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from realformer import platforms
from tests.test_launch import needs_libtpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a program does first (realformer.cli.run_main), then its first device query.
PROGRAM = ('import jax, os; from realformer import cli; '
           'print(cli.run_main(lambda: sorted({d.platform for d in jax.devices()})), '
           'os.environ.get("JAX_PLATFORMS"))')


def _clean_env():
  """This process's environment as a fresh shell on this machine has it: without the tests'
  JAX_PLATFORMS, and without the TPU description the launch check gives libtpu
  (launch.tpu_target sets TPU_* variables in the process that runs it). libtpu's log folder
  stays the run's (tests/conftest.py)."""
  return {k: v for k, v in os.environ.items()
          if k != 'JAX_PLATFORMS' and not (k.startswith('TPU_') and k != 'TPU_LOG_DIR')
          and k != 'ALLOW_MULTIPLE_LIBTPU_LOAD'}


def _start(**env):
  return subprocess.run([sys.executable, '-c', PROGRAM], cwd=REPO, capture_output=True,
                        text=True, timeout=120,
                        env={**_clean_env(), 'TF_CPP_MIN_LOG_LEVEL': '0', **env})


@needs_libtpu
def test_a_cpu_start_with_libtpu_installed_says_nothing_of_tpus(tmp_path):
  proc = _start()
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["['cpu']", 'cpu']
  assert 'tpu' not in proc.stderr.lower(), proc.stderr[-2000:]
  # A script of one's own that imports the package before its first device query: as quiet
  # (the choice made at the import is logged once a program's run_main starts).
  script = subprocess.run(
      [sys.executable, '-c', 'import jax.numpy as jnp; from realformer import models; '
       'print(float(jnp.ones(3).sum()))'], cwd=REPO, capture_output=True, text=True,
      timeout=120, env={**_clean_env(), 'TF_CPP_MIN_LOG_LEVEL': '0'})
  assert script.returncode == 0 and script.stdout.split() == ['3.0'], script.stderr[-2000:]
  assert 'tpu' not in script.stderr.lower(), script.stderr[-2000:]
  program = subprocess.run(
      [sys.executable, '-c', 'from realformer import cli; from absl import logging; '
       'logging.set_verbosity("info"); cli.run_main(lambda: None); cli.run_main(lambda: None)'],
      cwd=REPO, capture_output=True, text=True, timeout=120, env=_clean_env())
  said = [l for l in program.stderr.splitlines() if 'tpu' in l.lower()]
  assert (len(said) == 1 and said[0].endswith(
      'libtpu is installed but no TPU is attached: jax platforms cpu')), program.stderr[-2000:]
  # A worker process of ours (data preparation's) imports the package without jax: its
  # parent chose the platforms.
  worker = tmp_path / 'worker.py'
  worker.write_text(textwrap.dedent('''
      import multiprocessing, sys
      def imports_jax():
        import realformer.config_checks  # pylint: disable=unused-import
        return 'jax' in sys.modules
      if __name__ == '__main__':
        with multiprocessing.get_context('spawn').Pool(1) as pool:
          print(pool.apply(imports_jax))
      '''))
  spawned = subprocess.run([sys.executable, str(worker)], cwd=REPO, capture_output=True,
                           text=True, timeout=120, env={**_clean_env(), 'PYTHONPATH': REPO})
  assert spawned.returncode == 0 and spawned.stdout.split() == ['False'], spawned.stderr
  # Without it, libtpu speaks (the reason for the module): the same start, jax left as it is.
  noisy = subprocess.run(
      [sys.executable, '-c', 'import jax; print(sorted({d.platform for d in jax.devices()}))'],
      cwd=REPO, capture_output=True, text=True, timeout=120, env=_clean_env())
  assert noisy.returncode == 0 and 'tpu' in noisy.stderr.lower()


def test_a_start_without_libtpu_says_nothing_of_tpus(tmp_path):
  """requirements.txt alone: libtpu hidden from the program (a module set to None is one
  Python cannot import), jax's INFO lines shown. jax tries its TPU backend all the same."""
  (tmp_path / 'sitecustomize.py').write_text("import sys\nsys.modules['libtpu'] = None\n")
  env = dict(_clean_env(), TF_CPP_MIN_LOG_LEVEL='0',
             PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')]))
  info = 'import logging; logging.basicConfig(level=logging.INFO); '
  proc = subprocess.run([sys.executable, '-c', info + PROGRAM], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["['cpu']", 'None']  # (no platform chosen for jax)
  assert 'tpu' not in proc.stderr.lower(), proc.stderr[-2000:]
  # The same start, jax left as it is: its line on the TPU backend.
  noisy = subprocess.run(
      [sys.executable, '-c', info + 'import jax; print(jax.devices()[0].platform)'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert noisy.returncode == 0 and noisy.stdout.split() == ['cpu'], noisy.stderr[-2000:]
  assert "Unable to initialize backend 'tpu'" in noisy.stderr
  assert 'libtpu.so' in noisy.stderr  # (it is libtpu that is missing)


@pytest.mark.usefixtures('no_platforms_chosen')
def test_without_libtpu_only_jaxs_line_on_the_missing_library_is_dropped(monkeypatch):
  """Not a TPU backend's other failures, and nothing where TPU_LIBRARY_PATH names a libtpu
  of the user's own (jax loads that one)."""
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  find_spec = platforms.importlib.util.find_spec
  monkeypatch.setattr(platforms.importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'libtpu' else find_spec(name, *a))
  monkeypatch.setattr(hardware_utils, 'num_available_tpu_chips_and_device_id',
                      lambda: (0, None))
  jax_backends = logging.getLogger('jax._src.xla_bridge')
  monkeypatch.setattr(jax_backends, 'filters', [])
  monkeypatch.setenv('TPU_LIBRARY_PATH', '/opt/tpu/libtpu.so')
  assert platforms.skip_absent_tpu() == '' and jax_backends.filters == []
  monkeypatch.delenv('TPU_LIBRARY_PATH')
  assert platforms.skip_absent_tpu() == '' and 'JAX_PLATFORMS' not in os.environ
  (kept,) = jax_backends.filters
  line = lambda msg: logging.LogRecord('jax._src.xla_bridge', logging.INFO, '', 0, msg, (), None)
  assert not kept.filter(line("Unable to initialize backend 'tpu': INTERNAL: Failed to open "
                              "libtpu.so: libtpu.so: cannot open shared object file"))
  assert kept.filter(line("Unable to initialize backend 'tpu': ABORTED: The TPU is already "
                          "in use by process with pid 1234"))
  assert kept.filter(line("Unable to initialize backend 'cuda': no supported devices"))


def test_a_users_platforms_are_left_alone():
  proc = _start(JAX_PLATFORMS='cpu')
  assert proc.returncode == 0 and proc.stdout.split() == ["['cpu']", 'cpu']
  assert platforms.skip_absent_tpu() == ''  # the tests' own JAX_PLATFORMS


@pytest.fixture
def no_platforms_chosen(monkeypatch):
  """This process as a fresh start would have it: neither JAX_PLATFORMS (the tests set it)
  nor jax_platforms."""
  monkeypatch.delenv('JAX_PLATFORMS')
  before = jax.config.jax_platforms
  jax.config.update('jax_platforms', None)
  yield
  jax.config.update('jax_platforms', before)


@pytest.mark.usefixtures('no_platforms_chosen')
def test_an_attached_tpu_or_a_visible_gpu_is_kept(monkeypatch):
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(platforms.importlib.util, 'find_spec',
                      lambda name, *a: object() if name == 'libtpu' else None)
  monkeypatch.setattr(hardware_utils, 'num_available_tpu_chips_and_device_id',
                      lambda: (4, 'v5e'))
  assert platforms.skip_absent_tpu() == ''  # a TPU VM: jax picks the TPU as before
  assert 'JAX_PLATFORMS' not in os.environ
  monkeypatch.setattr(platforms, '_plugins', lambda: {'xla_cuda12'})
  monkeypatch.setattr(hardware_utils, 'has_visible_nvidia_gpu', lambda: True)
  monkeypatch.setattr(hardware_utils, 'num_available_amd_gpus', lambda stop_at=None: 0)
  assert platforms.platforms_here() == 'cuda,cpu'
  monkeypatch.setattr(hardware_utils, 'has_visible_nvidia_gpu', lambda: False)
  assert platforms.platforms_here() == 'cpu'


@needs_libtpu
def test_a_benchmarks_start_says_nothing_of_tpus():
  """Every benchmark imports benchmarks/machine.py before its first device query."""
  proc = subprocess.run(
      [sys.executable, '-c', 'from benchmarks import machine; import jax; '
       'print(sorted({d.platform for d in jax.devices()}))'],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**_clean_env(), 'TF_CPP_MIN_LOG_LEVEL': '0'})
  assert proc.returncode == 0 and proc.stdout.split() == ["['cpu']"], proc.stderr[-2000:]
  assert 'tpu' not in proc.stderr.lower(), proc.stderr[-2000:]


def test_a_tools_warning_is_in_absl_format_as_the_programs_are():
  """A tool (cli.run_main without absl's app.run: sweep.py, the interop, ...) logs
  `W1201 10:00:00.123456 4242 file.py:10] ...` as train.py does, whether a library logged
  through absl before it (orbax as it imports: Python's basicConfig handler, which wrote
  `WARNING:absl:...`) or nothing did."""
  for first in ('', 'import orbax.checkpoint; '):
    code = (first + 'from absl import logging; from realformer import cli; '
            'cli.run_main(lambda: logging.warning("a warning"))')
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r'^W\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ <string>:1\] a warning$',
                     proc.stderr, re.M), proc.stderr[-2000:]
    assert 'WARNING:absl' not in proc.stderr and proc.stderr.count('a warning') == 1
  # Logging configured by the caller (main() run from a script of one's own) is left alone.
  proc = subprocess.run([sys.executable, '-c', 'import logging; from realformer import cli; '
                         'logging.basicConfig(level=logging.INFO); '
                         'cli.run_main(lambda: logging.getLogger("mine").info("mine"))'],
                        cwd=REPO, capture_output=True, text=True, timeout=120, env=_clean_env())
  assert proc.returncode == 0 and 'INFO:mine:mine' in proc.stderr.splitlines(), proc.stderr
