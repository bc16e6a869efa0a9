"""The persistent compilation cache: a second start loads its programs and computes the same
losses; a program compiled under another jax, backend, device kind or processor is not
looked up; `off` turns it off, jax's own as well; an entry is written whole or not at all, and
one that cannot be read is replaced. (A cache in a bucket: tests/test_bucket_runs.py.)"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache
from jax._src import lru_cache

from realformer.train import compile_cache
from realformer.train import machine
from tests.conftest import cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(workdir, cache, *extra, **environ):
  args = [sys.executable, 'train.py', f'--workdir={workdir}', f'--compilation_cache={cache}',
          '--config=configs/pretrain.py:postln,tiny,runlocal', '--config.train.num_steps=2',
          '--config.train.log_every_steps=1', '--config.train.eval_steps=0',
          '--config.model.num_layers=1', '--config.model.hidden_size=32',
          '--config.model.num_heads=2', '--config.model.mlp_dim=64', *extra]
  # Every program is written, however fast it compiled (jax's threshold is 1 s).
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', **environ)
  proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr


def _counts(log: str):
  """(programs loaded from the cache, programs compiled and written) over the whole run (the
  log's last count)."""
  line = [l for l in log.splitlines() if ' loaded from it, ' in l][-1]
  loaded = int(re.split(r' programs? loaded from it', line)[0].split()[-1])
  written = int(line.split(' compiled and written')[0].split()[-1])
  assert line.endswith('compiled and written to it')  # (every program is: no threshold said)
  return loaded, written


def test_the_cache_line_says_which_programs_it_does_not_keep(caplog):
  caplog.set_level('INFO', logger='absl')
  least = jax.config.jax_persistent_cache_min_compile_time_secs
  try:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
    compile_cache.log_stats('the run')
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', least)
  assert caplog.text.rstrip().endswith(
      " compiled and written to it (those that compile in under 1 s are not kept, but for the "
      "run's own: its steps, predictions and init)")


def test_a_runs_steps_are_kept_however_fast_they_compile(tmp_path):
  """Under jax's 1 s threshold a program of a few microseconds' compile is not written; in
  compile_cache.kept() it is, and the block counts it compiled; a later compile of the same
  computation (another function object: not jax's in-memory cache) in a block loads it."""
  before = jax.config.jax_compilation_cache_dir
  least = jax.config.jax_persistent_cache_min_compile_time_secs
  x = np.float32(2.0)
  try:
    folder = compile_cache.enable(str(tmp_path))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
    entries = lambda: sorted(n for n in os.listdir(folder) if n.startswith('jit_'))
    jax.jit(lambda v: v * 5.0).lower(x).compile()
    assert entries() == []  # (too fast for the threshold)
    with compile_cache.kept() as block:
      jax.jit(lambda v: v * 13.0).lower(x).compile()
    assert len(entries()) == 1 and block == {'hits': 0, 'misses': 1}
    with compile_cache.kept() as outer:  # (blocks nest: each counts its own and inner ones)
      with compile_cache.kept() as block:
        jax.jit(lambda v: v * 13.0).lower(x).compile()
      jax.jit(lambda v: v * 17.0).lower(x).compile()
    assert len(entries()) == 2 and block == {'hits': 1, 'misses': 0}
    assert outer == {'hits': 1, 'misses': 1}
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0  # (restored)
  finally:
    jax.config.update('jax_compilation_cache_dir', before)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', least)
    jax_cache.reset_cache()


def _losses(workdir) -> list:
  return [r['loss'] for r in map(json.loads, open(os.path.join(workdir, 'metrics.jsonl')))
          if r['split'] == 'train' and 'loss' in r]


def test_a_second_start_loads_its_programs_and_computes_the_same_losses(tmp_path):
  cache = tmp_path / 'cache'
  first = _train(tmp_path / 'a', cache)
  loaded, written = _counts(first)
  assert written > 0  # (a program built twice in one process is loaded the second time)
  assert f'compilation cache: {cache}' in first and 'Resetting cache' not in first  # (jax's)
  (folder,) = os.listdir(cache)  # one machine: one subfolder
  assert folder == compile_cache.fingerprint(compile_cache.machine_facts())
  assert len(os.listdir(cache / folder)) > 0
  second = _train(tmp_path / 'b', cache)
  assert _counts(second) == (loaded + written, 0)  # everything loaded, nothing compiled
  assert _losses(tmp_path / 'a') == _losses(tmp_path / 'b') and _losses(tmp_path / 'a')
  # Off, also where jax's own variable names a cache (as a user's shell may): nothing there.
  off = _train(tmp_path / 'c', 'off', JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'jax_own'))
  assert 'compilation cache: off' in off and ' loaded from it' not in off
  assert not (tmp_path / 'jax_own').exists() or not os.listdir(tmp_path / 'jax_own')
  # (Programs of another jax version beside: test_another_machines_programs_are_not_read.)


def test_the_cache_keeps_gpu_autotuning_results_in_its_folder(tmp_path):
  """The compile options jax builds for any backend, once the cache is on, point XLA's
  per-fusion GPU autotuning cache into the cache's folder (process 0 writes it): a second
  start on a GPU autotunes nothing it tuned before. (Also after a disable(): enable() turns
  the cache on again.)"""
  from jax._src import compiler  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir
  min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
  try:
    compile_cache.disable()
    jax.jit(lambda x: x * 7.0)(np.float32(1.0))  # a compile with the cache off
    folder = compile_cache.enable(str(tmp_path))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    jax.jit(lambda x: x * 11.0)(np.float32(1.0))
    assert any(name.startswith('jit__lambda') for name in os.listdir(folder))  # written
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    debug = options.executable_build_options.debug_options
    assert debug.xla_gpu_per_fusion_autotune_cache_dir == os.path.join(
        folder, 'xla_gpu_per_fusion_autotune_cache_dir')
    assert 'UPDATE' in str(debug.xla_gpu_experimental_autotune_cache_mode)
  finally:
    jax.config.update('jax_compilation_cache_dir', before)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', min_seconds)
    jax_cache.reset_cache()


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
  """This process's cache turned on in a folder of the test's own, every program written;
  the run's cache, and jax's own cache class, back afterwards."""
  monkeypatch.setattr(jax_cache, 'LRUCache', jax_cache.LRUCache)  # (undone after the test)
  names = ('jax_compilation_cache_dir', 'jax_enable_compilation_cache',
           'jax_persistent_cache_enable_xla_caches',
           'jax_persistent_cache_min_compile_time_secs')
  before = {name: getattr(jax.config, name) for name in names}
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  try:
    yield compile_cache.enable(str(tmp_path / 'cache'))
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()


def test_another_machines_programs_are_not_read_nor_touched(own_cache):
  """This machine's programs, as if written by another jax version (their folder renamed to
  that version's fingerprint, beside this machine's): a start compiles anew into its own
  folder, loads nothing, and leaves the other folder as it was."""
  x = np.arange(12, dtype=np.float32).reshape(3, 4)

  def start():  # a new process: the program traced anew, the cache folder opened anew
    jax_cache.reset_cache()
    counts = compile_cache.stats()
    y = jax.jit(lambda x: jnp.sin(x) @ x.T + 2.0)(x)
    after = compile_cache.stats()
    return y, after['hits'] - counts['hits'], after['misses'] - counts['misses']

  expected, loaded, written = start()
  assert (loaded, written) == (0, 1) and len(os.listdir(own_cache)) == 1
  root = os.path.dirname(own_cache)
  assert os.path.basename(own_cache) == compile_cache.fingerprint(compile_cache.machine_facts())
  other = os.path.join(root, compile_cache.fingerprint(
      dict(compile_cache.machine_facts(), jax='0.0.1')))
  os.rename(own_cache, other)
  files = {f: os.path.getmtime(os.path.join(other, f)) for f in os.listdir(other)}
  assert compile_cache.enable(root) == own_cache
  y, loaded, compiled = start()
  assert (loaded, compiled) == (0, written) and jnp.array_equal(y, expected)
  assert {f: os.path.getmtime(os.path.join(other, f)) for f in os.listdir(other)} == files
  assert [f for f in os.listdir(own_cache) if f.startswith('jit__lambda')] == list(files)


def test_the_local_launch_check_says_when_its_step_came_from_the_cache(own_cache):
  """`--compile_for local` with the compilation cache on: a second check of the same step
  loads it, and the report says so rather than "compiled"."""
  from realformer.tools import launch  # pylint: disable=g-import-not-at-top
  from tests.test_train import tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(eval_steps=0)
  target = launch.local_target()
  target.devices = target.devices[:1]
  config.mesh.data = 1
  texts = []
  for _ in range(2):
    report, _ = launch.compile_step(config, target)
    texts.append(launch.format_report(config, target, report))
  assert 'sequence; compiled in' in texts[0]
  assert 'sequence; loaded from the compilation cache in' in texts[1], texts[1]


def test_an_entry_that_cannot_be_read_is_compiled_again_and_replaced(own_cache):
  """jax keeps an entry that is there: one cut short by an earlier start would be read in
  vain (a warning), compiled anew and kept, at every start; and jax's check whether a key
  is in the cache (profile-guided compiles use it) would take it for a program."""
  x = np.arange(48, dtype=np.float32).reshape(6, 8) / 48  # (the one program: the jitted one)

  def start():  # a new process: the program traced anew, the cache folder opened anew
    jax_cache.reset_cache()
    counts = compile_cache.stats()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      y = jax.jit(lambda x: jnp.tanh(x) @ x.T * 3.0 + 0.25)(x)
    after = compile_cache.stats()
    jax_warnings = [str(w.message) for w in caught if 'persistent compilation' in str(w.message)]
    return y, after['hits'] - counts['hits'], after['misses'] - counts['misses'], jax_warnings

  expected, _, written, _ = start()
  backend = jax.devices()[0].client
  assert isinstance(jax_cache._get_cache(backend), compile_cache.WholeEntries)  # pylint: disable=protected-access
  entries = sorted(os.listdir(own_cache))
  assert written == len(entries) == 1 and entries[0].endswith('-cache')
  key = entries[0][:-len('-cache')]
  assert jax_cache.is_executable_in_cache(backend, key)
  size = os.path.getsize(os.path.join(own_cache, entries[0]))
  os.truncate(os.path.join(own_cache, entries[0]), size // 2)  # as a write cut short leaves it
  assert not jax_cache.is_executable_in_cache(backend, key)
  y, loaded, compiled, jax_warnings = start()
  assert (loaded, compiled, jax_warnings) == (0, written, [])
  assert sorted(os.listdir(own_cache)) == entries  # (replaced; no temporary file left)
  y2, loaded, compiled, jax_warnings = start()
  assert (loaded, compiled, jax_warnings) == (written, 0, [])  # rewritten whole: loaded
  assert jnp.array_equal(y, expected) and jnp.array_equal(y2, expected)
  # Another folder, in the same process: the programs go there from now on.
  before = sorted(os.listdir(own_cache))
  other = compile_cache.enable(os.path.join(os.path.dirname(own_cache), '..', 'other'))
  jax.jit(lambda x: jnp.cos(x) * 5.0)(x)
  assert [e.split('-')[0] for e in os.listdir(other)] == ['jit__lambda']
  assert sorted(os.listdir(own_cache)) == before


def test_a_start_removes_what_writers_killed_half_way_left(own_cache, monkeypatch):
  old, fresh = (os.path.join(own_cache, f'k-cache.{n}{compile_cache.PART}') for n in 'ab')
  os.makedirs(own_cache)
  for part in (old, fresh):
    with open(part, 'wb') as f:
      f.write(b'half')
  an_hour_ago = time.time() - compile_cache.STALE_PART_SECONDS - 60
  os.utime(old, (an_hour_ago, an_hour_ago))
  assert compile_cache.enable(os.path.dirname(own_cache)) == own_cache
  assert os.listdir(own_cache) == [os.path.basename(fresh)]  # (it may be a writer's, now)
  # One that is not this process's to remove (a shared folder) is left, and the start goes on.
  os.utime(fresh, (an_hour_ago, an_hour_ago))
  def refuse(path):
    raise PermissionError(13, 'Permission denied', path)
  monkeypatch.setattr(compile_cache.os, 'remove', refuse)
  assert compile_cache.enable(os.path.dirname(own_cache)) == own_cache
  assert os.listdir(own_cache) == [os.path.basename(fresh)]


@pytest.mark.parametrize('cache_class,max_size', [
    (compile_cache.WholeEntries, -1), (compile_cache.WholeEntries, 1 << 20),  # (1 MiB: LRU)
    (lru_cache.LRUCache, -1)])
def test_a_write_that_fails_half_way_leaves_no_entry(tmp_path, cache_class, max_size):
  """The disk full half way through an entry (a file size limit, as a full disk fails the
  write): no entry, no part of one, with jax's size limit or without. (jax's own class, the
  last case, leaves half an entry: what WholeEntries is for.)"""
  cache = cache_class(str(tmp_path), max_size=max_size)
  entries = lambda: sorted(f for f in os.listdir(tmp_path) if f != '.lockfile')
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (the write fails instead)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limits[1]))
  try:
    with pytest.raises(OSError):
      cache.put('program', jax_cache.compress_executable(os.urandom(1 << 17)))
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)
  if cache_class is lru_cache.LRUCache:
    assert entries() == ['program-cache'] and len(cache.get('program')) == 1 << 16
    return
  assert entries() == [] and cache.get('program') is None
  whole = jax_cache.compress_executable(b'a program')
  cache.put('program', whole)  # and the next write, with room, is the entry
  assert cache.get('program') == whole
  assert entries() == (['program-atime'] if max_size > 0 else []) + ['program-cache']


def test_programs_of_another_machine_are_in_another_folder():
  facts = compile_cache.machine_facts()
  here = compile_cache.fingerprint(facts)
  for key, other in (('jax', '0.0.1'), ('device_kind', 'TPU v5 lite'), ('backend', 'gpu'),
                     ('cpu', 'another processor'), ('isa', 'x86_64 avx2')):
    assert compile_cache.fingerprint(dict(facts, **{key: other})) != here, key
  assert compile_cache.fingerprint(dict(facts, time='later', host='elsewhere')) == here
  # A GPU's or a TPU's programs are the same whatever the host's processor: a job's hosts
  # share one folder (process 0 writes it for all of them).
  for backend, kind in (('gpu', 'NVIDIA H100 80GB HBM3'), ('tpu', 'TPU v5p')):
    accelerator = dict(facts, backend=backend, device_kind=kind)
    assert compile_cache.fingerprint(dict(accelerator, cpu='another processor',
                                          isa='x86_64 avx2')) == \
        compile_cache.fingerprint(accelerator), backend


GRAVITON2 = ('processor\t: 0\nBogoMIPS\t: 243.75\n'
             'Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid '
             'asimdrdm lrcpc dcpop asimddp ssbs\n'
             'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n'
             'CPU part\t: 0xd0c\nCPU revision\t: 1\n\nprocessor\t: 1\n')
GRACE = GRAVITON2.replace('0xd0c', '0xd4f').replace('ssbs', 'ssbs sve sve2 bf16 i8mm')


def test_two_arm_processors_get_two_folders(tmp_path, monkeypatch):
  """/proc/cpuinfo on Arm names no model and none of the x86 features: the key reads the
  processor's part number and its features (Graviton2 against Grace, which adds SVE)."""
  keys = []
  for text in (GRAVITON2, GRACE):
    (tmp_path / 'cpuinfo').write_text(text)
    monkeypatch.setattr(machine, 'CPUINFO', str(tmp_path / 'cpuinfo'))
    keys.append(machine.instruction_set())
    assert 'CPU part=' in keys[-1] and 'asimd' in keys[-1]
  assert keys[0] != keys[1] and 'sve2' in keys[1]
  facts = compile_cache.machine_facts()
  assert len({compile_cache.fingerprint(dict(facts, isa=k)) for k in keys}) == 2


def test_the_tests_cache_is_trimmed_oldest_first_on_every_machine(tmp_path):
  """tests/conftest.py keeps the tests' compiled programs for the next run, within a budget:
  an entry cut short (a process killed while jax's own class wrote it) goes, then the oldest
  files, whichever machine's subfolder holds them."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  files = [('cpu-a', 'old-cache', 400), ('cpu-b', 'mid-cache', 300), ('cpu-a', 'new-cache', 200),
           ('cpu-b', 'cut-cache', 500)]
  sizes = {}
  for age, (sub, name, size) in enumerate(files):
    (tmp_path / sub).mkdir(exist_ok=True)
    path = tmp_path / sub / name
    whole = jax_cache.compress_executable(os.urandom(size))
    path.write_bytes(whole[:len(whole) // 2] if name == 'cut-cache' else whole)
    os.utime(path, (1000 + age, 1000 + age))
    sizes[name] = path.stat().st_size
  kept = lambda: sorted(p.name for p in tmp_path.rglob('*-cache'))
  everything = sizes['old-cache'] + sizes['mid-cache'] + sizes['new-cache']
  conftest.trim(str(tmp_path), everything)
  assert kept() == ['mid-cache', 'new-cache', 'old-cache']  # (the cut one, the newest, gone)
  conftest.trim(str(tmp_path), everything - 1)
  assert kept() == ['mid-cache', 'new-cache']
  conftest.trim(str(tmp_path), sizes['new-cache'])
  assert kept() == ['new-cache']
  # Each entry is read once, in the run after it was written (the last trim's start on)
  cut = jax_cache.compress_executable(os.urandom(100))[:20]
  (tmp_path / 'cpu-a' / 'read-cache').write_bytes(cut)
  os.utime(tmp_path / 'cpu-a' / 'read-cache', (1000, 1000))  # (as if before that trim)
  (tmp_path / 'cpu-a' / 'later-cache').write_bytes(cut)
  conftest.trim(str(tmp_path), conftest.KEPT_PROGRAMS_BYTES)
  assert kept() == ['new-cache', 'read-cache']
  conftest.trim(str(tmp_path / 'missing'), 0)  # (a first run: no folder yet)
  assert not (tmp_path / 'missing').exists()
