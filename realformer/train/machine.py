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
from typing import Dict

import jax

from realformer.run_names import RunNames

CPUINFO = '/proc/cpuinfo'

# ISA features that decide which matmul kernels XLA:CPU and PyTorch can use.
_FLAGS = ('avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile')
# What names a processor model in /proc/cpuinfo: x86, then Arm.
_IDENTITY = ('vendor_id', 'cpu family', 'model', 'CPU implementer', 'CPU architecture',
             'CPU variant', 'CPU part')


def _first_processor() -> Dict[str, str]:
  """/proc/cpuinfo's first block ({} where there is none)."""
  info = {}
  try:
    with open(CPUINFO, encoding='utf-8') as f:
      for line in f:
        if not line.strip():
          break
        key, _, value = line.partition(':')
        info[key.strip()] = value.strip()
  except OSError:
    pass
  return info


def cpu() -> str:
  """'AMD EPYC (vendor AuthenticAMD family 25 model 17; avx512f avx512_bf16)' or the arch."""
  info = _first_processor()
  if not info:
    return platform.processor() or platform.machine()
  flags = set(info.get('flags', '').split())
  have = ' '.join(f for f in _FLAGS if f in flags) or 'none of ' + ' '.join(_FLAGS)
  return (f"{info.get('model name', '?')} (vendor {info.get('vendor_id', '?')} family "
          f"{info.get('cpu family', '?')} model {info.get('model', '?')}; {have})")


def instruction_set() -> str:
  """What XLA:CPU compiles for: the architecture, the processor's identity and every feature
  it reports (x86 'flags', Arm 'Features'), so that two processors that differ in any of them
  differ here (cpu() names x86 models only, and four of their features)."""
  info = _first_processor()
  identity = [f'{k}={info[k]}' for k in _IDENTITY if k in info]
  features = sorted(set((info.get('flags') or info.get('Features') or '').split()))
  return ' '.join([platform.machine()] + identity + features)


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
    f = storage.GrowingFile(storage.path(workdir) / RunNames.MACHINE)
    f.write(json.dumps(facts()) + '\n')
    f.close()
