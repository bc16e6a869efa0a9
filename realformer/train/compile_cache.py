"""A persistent compilation cache for every program: a start loads what an earlier one compiled.

    compile_cache.define_flags()        # --compilation_cache, beside the program's flags
    compile_cache.enable_from_flags()   # before anything compiles
    compile_cache.stats()               # {'hits': programs loaded, 'misses': compiled anew}

train.py (also with --compile_for local) and finetune.py use it; the launch check for a TPU
slice turns it off (disable(): its compile-only devices have no client to load a program
into). It is jax's own persistent cache, pointed at a folder: --compilation_cache DIR, else
$REALFORMER_COMPILATION_CACHE, else ~/.cache/realformer/xla; `off` turns it off, also where
jax's own JAX_COMPILATION_CACHE_DIR names a folder. The folder
may be a gs:// URL (jax reads and writes it through etils.epath), which a pod's hosts share.
Every run on a machine shares it (the runs of a sweep or a fine-tuning grid compile the same
programs), and a restarted or preempted run loads its programs instead of compiling them
again.

On a GPU the folder also keeps XLA's autotuning results, per fusion
(<folder>/xla_gpu_per_fusion_autotune_cache_dir): a start that compiles a program anew (a
new shape, another model) skips the autotuning of every fusion an earlier start tuned, and a
second start of the same program loads it whole and autotunes nothing.

A program compiled for another machine is never loaded. jax's key already covers the
computation, the compile options, the XLA flags, the jaxlib version, the backend's platform
version and the device kind. XLA:CPU compiles for the host processor's instruction set,
which that key does not name, so programs live in a subfolder per (jax version, backend,
device kind, and on the CPU backend the processor and every feature it reports):
<dir>/<backend>-<hash of those>. A GPU's or a TPU's programs do not depend on the host's
processor, so hosts of one job with other processors (a GPU cluster's mixed nodes) share
one subfolder: process 0 writes it, every process reads it.

An entry is written whole or not at all, and one that cannot be read counts as missing
(`WholeEntries`). jax writes an entry in place and never replaces one that exists, so a
write cut short (the process killed or preempted, the disk full) would leave a truncated
entry that every later start fails to read (a warning), compiles anew and cannot rewrite.
Here a local entry goes to a temporary file beside it and is renamed over it, so a reader
sees the whole entry or none, and an entry that does not decompress is compiled again and
replaced.

With several processes jax writes the cache from process 0 only and every process reads it,
so a multi-host run wants a folder all hosts share. Only programs that took longer to
compile than jax's threshold are written
(jax_persistent_cache_min_compile_time_secs, 1 s by default), so the many small ones of a
run cost nothing.
"""

import contextlib
import hashlib
import logging as std_logging
import os
import secrets
import threading
import time
from typing import Dict, Optional

import jax
from absl import flags
from absl import logging
from jax._src import compilation_cache as jax_compilation_cache
from jax._src import lru_cache

from realformer import storage
from realformer.train import machine

DEFAULT_DIR = os.path.join('~', '.cache', 'realformer', 'xla')
ENV = 'REALFORMER_COMPILATION_CACHE'
OFF = 'off'
# What jax keeps in the cache folder besides whole programs: GPU autotuning results.
XLA_CACHES = 'xla_gpu_per_fusion_autotune_cache_dir'

_counts = {'hits': 0, 'misses': 0}
_lock = threading.Lock()
_listening = False
_blocks = threading.local()  # the counts of this thread's kept() blocks, innermost last


def define_flags() -> None:
  flags.DEFINE_string('compilation_cache', None,
                      f'Folder of the persistent compilation cache (default: ${ENV}, else '
                      f'{DEFAULT_DIR}); "{OFF}" turns it off.')


def machine_facts() -> Dict[str, object]:
  """machine.facts() and the processor's whole instruction set (machine.instruction_set)."""
  return dict(machine.facts(), isa=machine.instruction_set())


def fingerprint(facts: Dict[str, object]) -> str:
  """The subfolder name for a machine's facts (machine_facts(): jax, backend, device_kind,
  and for the CPU backend cpu and isa): programs compiled under other facts are in another
  subfolder."""
  names = ('jax', 'backend', 'device_kind') + (('cpu', 'isa') if facts.get('backend') == 'cpu'
                                               else ())
  keyed = {k: str(facts.get(k)) for k in names}
  digest = hashlib.sha256(repr(sorted(keyed.items())).encode()).hexdigest()[:16]
  return f'{keyed["backend"]}-{digest}'


def folder(setting: Optional[str] = None) -> Optional[str]:
  """The cache folder for this machine (a local folder or a gs:// URL), or None when the
  setting (flag, else environment, else the default) is `off`."""
  root = setting or os.environ.get(ENV) or DEFAULT_DIR
  if root.strip().lower() == OFF:
    return None
  return storage.join(os.fspath(storage.path(root)), fingerprint(machine_facts()))


def enable(setting: Optional[str] = None) -> Optional[str]:
  """Points jax's persistent cache at folder(setting) and counts its hits and misses.
  Returns the folder (None: off)."""
  path = folder(setting)
  if path is None:
    disable()
    logging.info('compilation cache: off')
    return None
  _open_as_whole_entries(path)
  _remove_stale_parts(path)
  jax.config.update('jax_enable_compilation_cache', True)  # (after a disable())
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_enable_xla_caches', XLA_CACHES)
  _listen()
  logging.info('compilation cache: %s', path)
  return path


def enable_from_flags() -> Optional[str]:
  return enable(flags.FLAGS.compilation_cache)


def disable() -> None:
  """No persistent cache in this process: not jax's own either, which
  $JAX_COMPILATION_CACHE_DIR turns on as jax imports. Call it before anything compiles
  (jax decides once per process whether it uses the cache); enable() turns it on again."""
  jax.config.update('jax_enable_compilation_cache', False)


class WholeEntries(lru_cache.LRUCache):
  """jax's cache folder (lru_cache.LRUCache), whose entries are written whole or not at all
  and whose unreadable entries count as missing.

  put: in a local folder, to a temporary file beside the entry, renamed over it (a process
  killed or a disk full half way leaves no entry; a leftover temporary file is removed by a
  later enable()); in a bucket, as one object, which an object store keeps whole. An entry
  that is there is replaced, where jax's own put keeps it: jax only writes after a compile,
  and here that means the lookup found nothing readable.
  get: an entry that does not decompress (cut short by a writer without this class, or by a
  machine that lost power before the disk held it) is missing: jax compiles the program
  again and the put replaces it. The check costs one more decompression of each entry that
  a start loads."""

  def get(self, key: str) -> Optional[bytes]:
    value = super().get(key)
    if value is None:
      return None
    error = read_error(value)
    if error is not None:
      logging.warning('compilation cache: entry %s is unreadable (%s): compiling its program '
                      'again, which replaces it', key, type(error).__name__)
      return None
    return value

  def put(self, key: str, value: bytes) -> None:
    if self.eviction_enabled and len(value) > self.max_size:
      super().put(key, value)  # (jax refuses it, with its warning)
      return
    if self.eviction_enabled:
      self.lock.acquire(timeout=self.lock_timeout_secs)
    try:
      self._evict_if_needed(additional_size=len(value))
      entry = self.path / f'{key}{lru_cache._CACHE_SUFFIX}'  # pylint: disable=protected-access
      if self._is_local:
        _write_then_rename(os.fspath(entry), value)
      else:
        entry.write_bytes(value)
      if self.eviction_enabled:
        atime = self.path / f'{key}{lru_cache._ATIME_SUFFIX}'  # pylint: disable=protected-access
        atime.write_bytes(time.time_ns().to_bytes(8, 'little'))
    finally:
      if self.eviction_enabled:
        self.lock.release()


def read_error(value: bytes) -> Optional[Exception]:
  """What reading a cache entry's bytes raises (an entry cut short does not decompress), or
  None for a whole entry."""
  try:
    jax_compilation_cache.decompress_executable(value)
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


PART = '.part'  # a temporary file's suffix (not jax's -cache: never taken for an entry)
STALE_PART_SECONDS = 3600  # a temporary file this old was left by a writer that died


def _write_then_rename(entry: str, value: bytes) -> None:
  part = f'{entry}.{secrets.token_hex(8)}{PART}'  # (one writer's own, on any host)
  try:
    with open(part, 'xb') as f:
      f.write(value)
    os.replace(part, entry)
  finally:
    if os.path.exists(part):
      os.remove(part)


def _remove_stale_parts(folder_path: str) -> None:
  """Temporary files that writers killed half way left in a local cache folder (a folder
  this process may not list or change is left as it is: jax reports what it cannot do)."""
  if storage.is_url(folder_path):
    return
  now = time.time()
  try:
    names = os.listdir(folder_path)
  except OSError:
    return  # (not there yet, or not ours to list)
  for name in names:
    if name.endswith(PART):
      part = os.path.join(folder_path, name)
      try:
        if now - os.path.getmtime(part) > STALE_PART_SECONDS:
          os.remove(part)
      except OSError:
        pass  # (its writer finished, another start removed it, or it is not ours to remove)


def _open_as_whole_entries(path: str) -> None:
  """jax builds its cache folder as WholeEntries, at `path`, from the next compile on (it
  builds it at the first compile that looks anything up, and would go on with one built
  before, or with no cache where a compile found it off: both are reset). The classes are jax's private ones, of the pinned version:
  tests/test_compile_cache.py checks that jax still builds its cache through this name."""
  built = jax_compilation_cache._cache  # pylint: disable=protected-access
  # (Also when none was built: a compile after disable() left jax decided against a cache.)
  if not isinstance(built, WholeEntries) or jax.config.jax_compilation_cache_dir != path:
    # (without jax's INFO line "Resetting cache at <empty>.": the reset is ours, and the
    # start already names the cache's folder)
    jax_logger = std_logging.getLogger(jax_compilation_cache.__name__)
    level = jax_logger.level
    jax_logger.setLevel(max(level, std_logging.WARNING))
    try:
      jax_compilation_cache.reset_cache()
    finally:
      jax_logger.setLevel(level)
  jax_compilation_cache.LRUCache = WholeEntries


def _listen() -> None:
  global _listening
  with _lock:
    if _listening:
      return
    _listening = True

  def count(event: str, **kwargs):
    del kwargs
    name = {'/jax/compilation_cache/cache_hits': 'hits',
            '/jax/compilation_cache/cache_misses': 'misses'}.get(event)
    if name:
      with _lock:
        _counts[name] += 1
      for block in getattr(_blocks, 'open', ()):  # (jax counts in the compiling thread)
        block[name] += 1
  jax.monitoring.register_event_listener(count)


@contextlib.contextmanager
def kept():
  """Within, on this thread: every program compiled is written to the cache, however fast it
  compiled (jax keeps only those over its threshold), for a run's own steps, which the next
  run of a grid or a sweep loads. Yields {'hits', 'misses'}: the block's programs loaded
  from the cache and compiled so far (where the cache is on); blocks nest."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  block = {'hits': 0, 'misses': 0}
  if not hasattr(_blocks, 'open'):
    _blocks.open = []
  _blocks.open.append(block)
  try:
    with jax_config.persistent_cache_min_compile_time_secs(0.0):
      yield block
  finally:
    assert _blocks.open[-1] is block  # (blocks nest: the innermost closes first)
    _blocks.open.pop()


def stats() -> Dict[str, int]:
  """Programs of this process loaded from the cache (hits) and compiled and written to it
  (misses: jax writes only those over its compile-time threshold, but in kept())."""
  with _lock:
    return dict(_counts)


def log_stats(what: str) -> None:
  """The log's line of stats(): what process 0 compiled and wrote, or on the others what
  they loaded (jax counts a program compiled where it writes it: process 0 alone)."""
  if _listening:
    counts = stats()
    programs = lambda n: f'{n} program{"" if n == 1 else "s"}'
    if jax.process_index() > 0:
      logging.info('compilation cache after %s: %s loaded from it (process 0 writes those the '
                   'job compiles)', what, programs(counts['hits']))
      return
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    logging.info('compilation cache after %s: %s loaded from it, %d compiled and written to '
                 'it%s', what, programs(counts['hits']), counts['misses'],
                 f' (those that compile in under {least:g} s are not kept, but for the '
                 'run\'s own: its steps, predictions and init)'
                 if least else '')
