"""One header line naming the machine a benchmark ran on.

CPU figures are only comparable on the same processor: the 2-core development box has been
an Intel Sapphire Rapids (AMX: bf16 matmuls at 1.3-1.6 TFLOP/s) on one day and an AMD EPYC
Zen 4 (AVX512-BF16, no AMX; float32 matmuls at ~105 GFLOP/s a core) on another, and the
ratio to PyTorch moved with it. Every benchmark prints this line first.
"""

import datetime
import os
import platform

import jax

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


def describe() -> str:
  """Date, host, processor, cores and JAX's device, as one '# ...' line."""
  device = jax.devices()[0]
  return (f'# {datetime.date.today()} {platform.node()}: {cpu()}, {os.cpu_count()} cores; '
          f'jax {jax.__version__} on {device.device_kind} x{jax.device_count()}')
