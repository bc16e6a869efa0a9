"""Host memory on CPU-only runs: keep freed memory mapped, so steps stop page-faulting.

On a CPU backend XLA allocates each step's temporaries with glibc's malloc. Large blocks come
from mmap (or from per-thread arenas that glibc trims with MADV_DONTNEED) and go back to the
kernel when freed, so every step touches fresh pages (minor page faults by the hundred
thousand, and system time, in a BERT-base step). With one malloc arena, no mmap and no
trimming, the memory freed by one step serves the next, and warmed-up steps take almost no
page faults. BENCHMARKS.md has the figures. The price: the process keeps
its peak heap (data preparation's included) instead of returning it to the system, the heap
can fragment (a few tens of percent more resident memory in tests/test_host_memory.py's
program), and all threads share one malloc lock (measured on 2 cores only).

`keep_freed_memory()` does this with mallopt(3), before JAX starts its thread pools (threads
that already own an arena keep it). It changes nothing where an accelerator backend is
installed or selected (the host's malloc is not on the step's path there), on a C library
other than glibc, when the user tunes malloc through the environment (MALLOC_* or
GLIBC_TUNABLES) or preloads another allocator (LD_PRELOAD), or when REALFORMER_MALLOC=default.
"""

import ctypes
import importlib.metadata
import importlib.util
import os

from absl import logging

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_applied = None


def _accelerator_possible() -> bool:
  """True when JAX may pick a GPU/TPU backend (selected by JAX_PLATFORMS or installed)."""
  platforms = os.environ.get('JAX_PLATFORMS', '').strip().lower()
  if platforms:
    return any(p.strip() not in ('', 'cpu') for p in platforms.split(','))
  if importlib.util.find_spec('libtpu') is not None:
    return True
  try:
    plugins = importlib.metadata.entry_points(group='jax_plugins')
  except Exception:  # pylint: disable=broad-except
    plugins = ()
  if len(plugins):
    return True
  spec = importlib.util.find_spec('jax_plugins')
  return bool(spec and spec.submodule_search_locations and any(
      os.listdir(p) for p in spec.submodule_search_locations if os.path.isdir(p)))


def _glibc() -> bool:
  try:
    return os.confstr('CS_GNU_LIBC_VERSION').startswith('glibc')
  except (AttributeError, ValueError, OSError):
    return False


def keep_freed_memory() -> bool:
  """Configure glibc's malloc for CPU-only runs (see the module docstring); idempotent.

  Returns whether the settings are in effect. Call it before the first JAX computation.
  """
  global _applied
  if _applied is not None:
    return _applied
  _applied = False
  if os.environ.get('REALFORMER_MALLOC', '').strip().lower() in ('default', 'off', '0'):
    return False
  user_tuned = any(k.startswith('MALLOC_') or k in ('GLIBC_TUNABLES', 'LD_PRELOAD')
                   for k in os.environ)
  if user_tuned or not _glibc() or _accelerator_possible():
    return False
  libc = ctypes.CDLL(None)
  settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim
  results = [libc.mallopt(param, value) == 1 for param, value in settings]  # apply all
  _applied = all(results)
  if _applied:
    logging.info('CPU-only run: glibc malloc keeps freed memory (realformer/train/host_memory.py)')
  return _applied
