"""Which of jax's backends a program starts: TPUs only where a TPU is attached.

libtpu, once installed (requirements-tpu.txt: for TPU VMs, and for compiling for TPU slices
anywhere), makes jax try a TPU backend at its first device query on every machine, and on a
machine without TPUs libtpu prints its failure to stderr ("Failed to find host bounds for
accelerator type", "could not determine TPU accelerator type", "unexpected worker hostname")
before jax falls back: it reads as a broken install. `skip_absent_tpu()`, called before the
first device query, limits jax to the platforms this machine has when no TPU chip is on its
PCI bus (jax's own probe, the one it uses to decide whether it runs on a TPU VM): NVIDIA or
AMD GPUs where one is visible and jax's plugin for it is installed, and the CPU. A TPU VM,
and any JAX_PLATFORMS the user set, are left alone. Every program calls it first: through
realformer.cli (parse_flags, run_main) and trainer.run_program; and importing the package
does where libtpu is installed (realformer/__init__.py), for scripts of one's own.

Without libtpu (requirements.txt alone) jax still tries its TPU backend and logs, at INFO,
"Unable to initialize backend 'tpu': ... Failed to open libtpu.so", which a program's INFO
log shows. Where no TPU chip is attached and no TPU_LIBRARY_PATH names a libtpu, that one
line is dropped and nothing else changes; on a machine with a TPU chip and no libtpu it
stays, beside jax's own warning that libtpu is missing.
"""

import importlib.metadata
import importlib.util
import logging as logging_std
import os
import pkgutil

from absl import logging


def _plugins() -> set:
  """Names of jax's installed PJRT plugins (entry points and jax_plugins modules)."""
  names = set()
  try:
    names.update(ep.name for ep in importlib.metadata.entry_points(group='jax_plugins'))
  except Exception:  # pylint: disable=broad-except
    pass
  spec = importlib.util.find_spec('jax_plugins')
  if spec and spec.submodule_search_locations:
    names.update(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
  return names


def platforms_here() -> str:
  """The JAX_PLATFORMS this machine supports without a TPU: 'cuda,cpu', 'rocm,cpu' or
  'cpu'."""
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  plugins = ' '.join(_plugins())
  found = []
  if 'cuda' in plugins and hardware_utils.has_visible_nvidia_gpu():
    found.append('cuda')
  if 'rocm' in plugins and hardware_utils.num_available_amd_gpus(stop_at=1):
    found.append('rocm')
  return ','.join(found + ['cpu'])


class _NoAbsentTpuBackend(logging_std.Filter):
  """Drops jax's INFO line on the TPU backend it could not start for want of libtpu.so."""

  def filter(self, record):
    message = record.getMessage()
    return not (message.startswith("Unable to initialize backend 'tpu'") and
                'libtpu.so' in message)


def skip_absent_tpu(say: bool = True) -> str:
  """Limit jax to platforms_here() where libtpu is installed, no TPU chip is attached and
  neither JAX_PLATFORMS nor jax_platforms says otherwise; before the first device query.
  Returns the platforms set, or '' where nothing was changed. Sets JAX_PLATFORMS too, so
  that worker processes start the same way, and logs the choice where `say` (not where the
  package is imported: absl's first log line would take the root logger from the importer's
  own logging.basicConfig). Without libtpu and a TPU chip, only jax's line on the TPU
  backend it cannot start is dropped."""
  if os.environ.get('JAX_PLATFORMS', '').strip():
    if say and _UNSAID:  # chosen as the package was imported: a program's log says it now
      _log_choice(_UNSAID.pop())
    return ''
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if jax.config.jax_platforms:
    return ''
  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    return ''
  if importlib.util.find_spec('libtpu') is None:
    if os.environ.get('TPU_LIBRARY_PATH'):  # (a libtpu of the user's own: its errors show)
      return ''
    jax_backends = logging_std.getLogger('jax._src.xla_bridge')
    if not any(isinstance(f, _NoAbsentTpuBackend) for f in jax_backends.filters):
      jax_backends.addFilter(_NoAbsentTpuBackend())
    return ''
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    return ''  # (too late: libtpu has spoken)
  platforms = platforms_here()
  os.environ['JAX_PLATFORMS'] = platforms
  jax.config.update('jax_platforms', platforms)
  if say:
    _log_choice(platforms)
  else:
    _UNSAID.append(platforms)
  return platforms


_UNSAID: list = []  # the platforms chosen in this process and not logged yet


def _log_choice(platforms: str) -> None:
  logging.info('libtpu is installed but no TPU is attached: jax platforms %s', platforms)
