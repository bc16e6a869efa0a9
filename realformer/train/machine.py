"""What machine a run or a benchmark ran on.

CPU figures are only comparable on the same processor (matrix units such as AMX or
AVX512-BF16 change speeds and ratios to peers; BENCHMARKS.md), and results move too: the same
run on two processors ends a few masked tokens apart, while on one machine it is
bit-identical (docs/study.md). So every benchmark prints `describe()` first, and the trainer
appends `record(workdir)` to <workdir>/machine.jsonl each time a run starts (a resumed run
shows every machine it ran on).
"""

import datetime
import json
import os
import platform

import jax

MACHINE_FILE = 'machine.jsonl'

# ISA features that decide which matmul kernels XLA:CPU and PyTorch can use.
_FLAGS = ('avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile')


def cpu() -> str:
  """'AMD EPYC (vendor AuthenticAMD family 25 model 17; avx512f avx512_bf16)' or the arch."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      info = {}
      for line in f:
        if not line.strip():
          break  # the first processor is enough
        key, _, value = line.partition(':')
        info[key.strip()] = value.strip()
  except OSError:
    return platform.processor() or platform.machine()
  flags = set(info.get('flags', '').split())
  have = ' '.join(f for f in _FLAGS if f in flags) or 'none of ' + ' '.join(_FLAGS)
  return (f"{info.get('model name', '?')} (vendor {info.get('vendor_id', '?')} family "
          f"{info.get('cpu family', '?')} model {info.get('model', '?')}; {have})")


def facts() -> dict:
  """The machine as one JSON-able record (process 0's view of the job)."""
  return {'time': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'host': platform.node(), 'cpu': cpu(), 'cores': os.cpu_count(),
          'jax': jax.__version__, 'backend': jax.default_backend(),
          'device_kind': jax.devices()[0].device_kind, 'devices': jax.device_count(),
          'processes': jax.process_count()}


def describe() -> str:
  """facts() as one '# <date> <host>: <cpu>, <cores> cores; jax <v> on <device> x<n>' line."""
  f = facts()
  return (f"# {f['time'][:10]} {f['host']}: {f['cpu']}, {f['cores']} cores; "
          f"jax {f['jax']} on {f['device_kind']} x{f['devices']}")


def record(workdir: str) -> None:
  """Appends facts() to <workdir>/machine.jsonl (process 0 only)."""
  if jax.process_index() == 0:
    from realformer import storage  # pylint: disable=g-import-not-at-top
    f = storage.GrowingFile(storage.path(workdir) / MACHINE_FILE)
    f.write(json.dumps(facts()) + '\n')
    f.close()
