r"""Launch facts before a slice is paid for: train.py's step compiled ahead of time.

    python train.py --config configs/pretrain.py:realformer,large --compile_for v5p:4x4x4 \
        --config.model.dtype=bfloat16 --config.mesh.fsdp=4 [--find_max_batch]
    python train.py --config ... --compile_for local     # this machine's devices: compile,
                                                         # then time a few steps

For a TPU slice, the compile-only devices of the named topology come from libtpu
(`pip install -r requirements-tpu.txt`) on any machine, the TPU's own devices unattached:
jax runs on the CPU (JAX_PLATFORMS=cpu is set) and XLA:TPU compiles for the slice. A
multi-host slice (v5p:4x4x4 is 64 chips on 16 hosts) compiles from one process. What is
compiled is exactly train.py's step (pretraining.program): the config's mesh over
the slice's devices, the batch shapes of the data config, gradient accumulation, dtype,
remat, scan and last_layer, with the backend-dependent 'auto' choices made for the target
platform (spec.platform), not for the compiling host.

Printed per chip: parameter + optimizer bytes, the compiled program's arguments, outputs
and temporaries (memory_analysis) and their total against the HBM a program may use
(USABLE_HBM_GIB: the chip's HBM less what the runtime keeps), a
verdict (the TPU compiler itself refuses a program that does not fit: that is "does not
fit" too); the compiled matmul FLOPs per step (hlo_stats, loop bodies times their trip
counts) against train_lib.flops_per_example (their ratio: 1 up to the partitioner's
redundant work, above 1 with remat, which recomputes the forward pass); the collectives of
the compiled HLO with their counts and bytes per step. --find_max_batch searches the
largest global batch that fits: a line through the compiles' memory (close to affine in
the batch) says which to try next, with longer steps where the compiler squeezes a program
near the limit, and bisection where the line keeps missing (find_max_batch); every answer
is a compile.
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional

import jax
import numpy as np

from realformer.layers import flash_attention as flash_lib
from realformer.model import attention as attention_lib
from realformer.model.spec import resolve
from realformer.tools import hlo_stats
from realformer.train import compile_cache
from realformer.train import metrics as metrics_lib
from realformer.train import partitioning
from realformer.train import pretraining
from realformer.train import train_lib

GiB = 1024 ** 3

# The dimensions of a generation's slice shapes: v5e and v6e slices are 2-D (AxB), v4 and
# v5p slices 3-D (AxBxC).
_DIMENSIONS = {'v4': 3, 'v5e': 2, 'v5p': 3, 'v6e': 2}
# The TPU generations a topology may name, and what a program may use of a chip's HBM (Google's
# tables give 32, 16, 95 and 32 GiB): the "available HBM" in the TPU compiler's own refusals
# (libtpu 0.0.48.1: "... exceeds available HBM (15.75G)"); the rest is the runtime's. The
# verdict compares a program's total (arguments, outputs, temporaries, code) with this: the
# compiler itself checks only the temporaries, so a program can compile and still not fit.
# A refusal that names another figure replaces it (compile_step).
USABLE_HBM_GIB = {'v4': 30.75, 'v5e': 15.75, 'v5p': 95.73, 'v6e': 31.24}


def shard_fixes(config, target) -> str:
  """What brings a step that does not fit under the HBM at the same batch, for the report's
  verdict: sharding the state further only where the fsdp and tensor axes (which split the
  matrices) do not span the slice together."""
  _, fsdp, tensor = partitioning.mesh_shape(config.mesh, len(target.devices))
  # (each slice of a multi-slice target holds the whole state: fsdp and tensor stay in one)
  per_slice = len(target.devices) // partitioning.slice_count(target.devices)
  further = ('shard the state further (mesh.fsdp)' if fsdp * tensor < per_slice else
             'a slice of more chips with the state sharded over them (mesh.fsdp)')
  return (f'{further}, remat (model.remat_policy=dots_flash, or full) or shorten '
          'data.max_seq_length')


def memory_fixes(config, target) -> str:
  """shard_fixes, after those with a smaller batch."""
  return ('lower train.batch_size (--find_max_batch finds the largest), raise '
          f'train.grad_accum_steps, or {shard_fixes(config, target)}')

# chip_config_name of the generations with two TensorCores per chip: 'megacore' makes one
# device per chip, as jax shows those chips on a TPU VM.
_MEGACORE = ('v4', 'v5p')


class LaunchError(ValueError):
  """A user error with a one-line message naming the fix."""


@dataclasses.dataclass
class Target:
  name: str                    # 'v5p:4x4x4' or 'local'
  platform: str                # 'tpu', 'gpu', 'cpu'
  devices: list
  num_hosts: int
  device_kind: str
  hbm_bytes: Optional[int]     # per chip; None when unknown (CPU)


def _ensure_cpu_host():
  """Compile-only TPU devices need jax on the CPU: a host with libtpu would otherwise try
  to start a TPU backend. Only possible before jax has started a backend."""
  try:
    jax.config.update('jax_platforms', 'cpu')
  except Exception:  # a backend is already up (e.g. tests): fine if it is the CPU
    pass


STACK_ENV = 'REALFORMER_STACK_RAISED'


def ensure_unlimited_stack(argv) -> None:
  """Re-run this program with an unlimited stack (`ulimit -s unlimited`), once, before jax
  starts: XLA:TPU's compiler overflows the default 8 MiB stack on some programs (bfloat16
  with remat 'full' or 'dots_no_batch': a segmentation fault, libtpu 0.0.42.1). The limit
  is read when the process starts, so raising it needs a new process. Where the hard limit
  forbids it, say so and go on."""
  soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
  if soft == resource.RLIM_INFINITY or os.environ.get(STACK_ENV):
    return
  if hard != resource.RLIM_INFINITY:
    print(f'note: the stack limit is {soft >> 20} MiB and may not be raised (hard limit); if '
          'the compile crashes with a segmentation fault, run it where `ulimit -s unlimited` '
          'is allowed', file=sys.stderr)
    return
  resource.setrlimit(resource.RLIMIT_STACK, (resource.RLIM_INFINITY, hard))
  os.environ[STACK_ENV] = '1'
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable] + list(argv))


# Cloud TPU accelerator type names: v4 and v5p count TensorCores (two a chip), v5e and v6e
# count chips.
_ACCELERATOR_TYPE = {'v4': lambda chips: f'v4-{2 * chips}',
                     'v5e': lambda chips: f'v5litepod-{chips}',
                     'v5p': lambda chips: f'v5p-{2 * chips}',
                     'v6e': lambda chips: f'v6e-{chips}'}


# v5e and v6e slices of up to 8 chips (1x1, 2x2, 2x4) are one VM with all of them (the
# ct5lp/ct6e -1t, -4t, -8t machine types); larger slices are 4-chip VMs, which is what
# libtpu's compile-only topologies assume for every shape (so 2x4 would be two hosts and
# 1x1 would not divide).
_SINGLE_HOST_UP_TO = {'v5e': 8, 'v6e': 8}


def _shape_of(chips: int, dimensions: int) -> str:
  """A slice shape of `chips` chips in `dimensions` dimensions, for a message, written as
  Cloud TPU's tables write them (2x2x1 for 4 chips in 3, 2x2x4 for 16, 4x8 for 32 in 2): the
  chips split as evenly as powers of two allow, ascending, ones last."""
  dims = [1] * dimensions
  while math.prod(dims) < chips and chips % (2 * math.prod(dims)) == 0:
    dims[dims.index(min(dims))] *= 2
  dims[-1] *= chips // math.prod(dims)
  return 'x'.join(map(str, sorted(dims, key=lambda n: (n == 1, n))))


# The slice shapes Cloud TPU can create (its accelerator-types tables; libtpu compiles for
# any shape its hosts divide, v5p:4x4x5 included): v5e and v6e a fixed list; v4 and v5p four
# small shapes, then AxBxC with A <= B <= C, each a multiple of 4 (v4's at most 16), up to
# the generation's largest slice (v4 4096 chips, v5p 8960). A rule, not the list of every
# shape sold: it refuses what no slice has.
_OFFERED_2D = ('1x1', '2x2', '2x4', '4x4', '4x8', '8x8', '8x16', '16x16')
_SMALL_3D = ('2x2x1', '2x2x2', '2x2x4', '2x4x4')
_MAX_CHIPS_3D = {'v4': 4096, 'v5p': 8960}
_MAX_DIMENSION_3D = {'v4': 16}  # (v5p's: none but its chips')


def _not_offered(generation: str, dims: list) -> Optional[str]:
  """Why Cloud TPU offers no `generation` slice of shape `dims`, with the nearest name it
  does offer where the dimensions are only out of order; None if it offers one."""
  shape = 'x'.join(map(str, dims))
  if _DIMENSIONS[generation] == 2:
    if shape in _OFFERED_2D:
      return None
    ordered = 'x'.join(map(str, sorted(dims)))
    if ordered in _OFFERED_2D:
      return f'Cloud TPU writes this slice {generation}:{ordered}'
    return f'{generation} slices are {", ".join(_OFFERED_2D)}'
  if shape in _SMALL_3D:
    return None
  ordered = 'x'.join(map(str, sorted(dims, key=lambda n: (n == 1, n))))
  if ordered in _SMALL_3D or (ordered == 'x'.join(map(str, sorted(dims)))
                              and all(n % 4 == 0 for n in dims)
                              and max(dims) <= _MAX_DIMENSION_3D.get(generation, max(dims))
                              and math.prod(dims) <= _MAX_CHIPS_3D[generation]):
    return f'Cloud TPU writes this slice {generation}:{ordered}' if ordered != shape else None
  largest = _MAX_DIMENSION_3D.get(generation)
  return (f'{generation} slices are {", ".join(_SMALL_3D)}, then AxBxC with A <= B <= C, '
          f'each a multiple of 4{f" up to {largest}" if largest else ""}, up to '
          f'{_MAX_CHIPS_3D[generation]} chips (e.g. {generation}:4x4x4, {generation}:4x4x8)')


def tpu_target(name: str) -> Target:
  """The compile-only devices of a TPU slice named '<generation>:<AxB[xC]>', or of N such
  slices joined by the data-center network, '<N>x<generation>:<AxB[xC]>' (a multi-slice
  job: partitioning.make_mesh lays the data axis across them)."""
  many = re.fullmatch(r'(\d+)x(v.*)', name)
  slices, single = (int(many.group(1)), many.group(2)) if many else (1, name)
  if slices < 1:
    raise LaunchError(f'--compile_for={name!r}: give at least one slice (2x{single} is two)')
  generation, _, shape = single.partition(':')
  cloud = re.fullmatch(r'(v4|v5p|v5litepod|v5e|v6e)-(\d+)', single)
  if cloud:  # a Cloud TPU accelerator type (v4-32; v5e's is v5litepod-16): its chips, a shape
    kind = {'v5litepod': 'v5e'}.get(cloud.group(1), cloud.group(1))
    chips = int(cloud.group(2)) // (2 if kind in _MEGACORE else 1)
    raise LaunchError(f'--compile_for={name!r} is a Cloud TPU type ({chips} chips); name its '
                      f'slice as <generation>:<topology> in chips, e.g. '
                      f'{f"{slices}x" if many else ""}{kind}:'
                      f'{_shape_of(chips, _DIMENSIONS[kind])} (gcloud compute tpus '
                      'accelerator-types describe gives its topology)')
  if generation not in USABLE_HBM_GIB:
    raise LaunchError(f'--compile_for={name!r}: {generation!r} is neither a TPU generation '
                      f'({", ".join(USABLE_HBM_GIB)}) nor a GPU ({", ".join(GPUS)}); name a TPU '
                      f'slice as <generation>:<topology> (e.g. v5p:4x4x4, v5e:4x4), GPUs as '
                      f'<gpu>[:<per host>|:<hosts>x<per host>] (e.g. h100:8), or use local')
  if not re.fullmatch(r'\d+x\d+(x\d+)?', shape):
    raise LaunchError(f'--compile_for={name!r}: topology {shape!r} is not AxB or AxBxC '
                      f'(chips per dimension, e.g. v5e:2x2, v5p:2x2x1)')
  if shape.count('x') + 1 != _DIMENSIONS[generation]:
    raise LaunchError(f'--compile_for={name!r}: {generation} slices are '
                      f'{"AxB" if _DIMENSIONS[generation] == 2 else "AxBxC"}, not {shape} '
                      f'(e.g. {generation}:{_shape_of(4, _DIMENSIONS[generation])})')
  why = _not_offered(generation, [int(n) for n in shape.split('x')])
  if why:  # (libtpu compiles it all the same, for a slice nobody can create)
    raise LaunchError(f'--compile_for={name!r}: no such slice: {why}')
  if importlib.util.find_spec('libtpu') is None:
    raise LaunchError('compiling for a TPU slice needs libtpu, which is not installed: '
                      'pip install -r requirements-tpu.txt')
  _ensure_cpu_host()
  chips = math.prod(int(n) for n in shape.split('x'))
  from jax.experimental import topologies
  kw = {'chip_config_name': 'megacore'} if generation in _MEGACORE else {}
  dims = [int(n) for n in shape.split('x')]
  if generation in _SINGLE_HOST_UP_TO and chips <= _SINGLE_HOST_UP_TO[generation]:
    kw['chips_per_host_bounds'] = (dims + [1, 1])[:3]  # one VM holds the whole slice
  # Compiling loads libtpu, which otherwise takes a machine-wide lock: two compiles (or two
  # test workers) at once would fail. libtpu reads a TPU VM's description when it loads;
  # anywhere else, give it one, so that it neither asks the cloud's metadata server nor
  # prints errors about what is missing (the compile follows the topology named here, not
  # these). Set while libtpu loads, and as they were afterwards (the programs this process
  # starts, and a later TPU VM's settings, are not to inherit them).
  vm = {'ALLOW_MULTIPLE_LIBTPU_LOAD': '1', 'TPU_SKIP_MDS_QUERY': '1',
        'TPU_WORKER_HOSTNAMES': 'localhost',
        'TPU_ACCELERATOR_TYPE': _ACCELERATOR_TYPE[generation](chips)}
  given = {k: os.environ.get(k) for k in vm}
  os.environ.update({k: v for k, v in vm.items() if given[k] is None})
  try:
    if slices > 1:
      kw['num_slices'] = slices
    desc = topologies.get_topology_desc(topology_name=single, platform='tpu', **kw)
  except Exception as e:  # libtpu's message: first line only
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if 'INVALID_ARGUMENT' not in first:
      raise LaunchError(f'--compile_for={name!r}: libtpu failed: {first}') from None
    raise LaunchError(f'--compile_for={name!r}: libtpu does not know this topology ({first}); '
                      f'use a slice shape the generation offers (e.g. v5e:2x2, v5e:4x4, '
                      f'v5p:2x2x1, v5p:4x4x4, v4:2x2x4, v6e:4x8)') from None
  finally:
    for k, v in given.items():
      if v is None:
        os.environ.pop(k, None)
  devices = list(desc.devices)
  hosts = len({d.process_index for d in devices})
  return Target(name, 'tpu', devices, hosts, devices[0].device_kind,
                int(USABLE_HBM_GIB[generation] * GiB))


# NVIDIA GPUs the check compiles for without one: XLA's deviceless GPU compile, through jax's
# CUDA plugin (pip install "jax[cuda13]==0.11.2" on any host; no GPU or driver needed). What
# XLA's GPU compiler reads of the device: its compute capability (the instructions), shared
# memory and registers (which bound the Triton kernels' tiles: a block's is the flash
# kernel's table, flash_attention.SHARED_MEMORY), its cores; the memory is nvidia-smi's. A program may use jax's default preallocation of it (75%, or
# $XLA_PYTHON_CLIENT_MEM_FRACTION).
GPUS = {
    'h100': dict(kind='NVIDIA H100 80GB HBM3', capability=9, cores=132, memory_mib=81559,
                 bandwidth=3.35e12, l2=50 << 20, clock=1.98, smem_core=233472, fpus=128),
    'h200': dict(kind='NVIDIA H200', capability=9, cores=132, memory_mib=143771,
                 bandwidth=4.8e12, l2=50 << 20, clock=1.98, smem_core=233472, fpus=128),
    'a100': dict(kind='NVIDIA A100-SXM4-80GB', capability=8, cores=108, memory_mib=81920,
                 bandwidth=2.039e12, l2=40 << 20, clock=1.41, smem_core=167936, fpus=64),
    'a100-40gb': dict(kind='NVIDIA A100-SXM4-40GB', capability=8, cores=108,
                      memory_mib=40960, bandwidth=1.555e12, l2=40 << 20, clock=1.41,
                      smem_core=167936, fpus=64),
}
_GPU_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_block_optin: {smem_block}
  shared_memory_per_core: {smem_core} core_count: {cores} fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth:.0f} l2_cache_size: {l2} clock_rate_ghz: {clock}
  device_memory_size: {memory} registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {capability} }}
}}
platform_name: "CUDA" dnn_version_info {{ major: {dnn_major} minor: {dnn_minor} }}
runtime_version {{ major: {cuda_major} minor: {cuda_minor} }}
device_description_str: "{kind}"
"""


def gpu_target(name: str) -> Target:
  """The compile-only devices of NVIDIA GPUs named '<gpu>[:<per host>|:<hosts>x<per host>]'
  (h100, h200:8, a100:2x8), through jax's CUDA plugin without a GPU."""
  gpu, _, shape = name.partition(':')
  if not re.fullmatch(r'(\d+x)?\d+|', shape):
    raise LaunchError(f'--compile_for={name!r}: give {gpu}, {gpu}:<GPUs> (one host) or '
                      f'{gpu}:<hosts>x<GPUs per host>, e.g. {gpu}:8 or {gpu}:2x8')
  hosts, _, per_host = shape.rpartition('x')
  hosts, per_host = int(hosts or 1), int(per_host or 1)
  if hosts < 1 or per_host < 1:
    raise LaunchError(f'--compile_for={name!r}: give at least one host and one GPU')
  try:
    from jax_cuda13_plugin import _versions  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise LaunchError('compiling for a GPU needs jax\'s CUDA plugin, which is not installed: '
                      'pip install "jax[cuda13]==0.11.2" (it compiles here, without a GPU)'
                      ) from None
  _ensure_cpu_host()  # (the plugin then skips its check of a CUDA driver)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  dnn, cuda = _versions.cudnn_build_version(), _versions.cuda_runtime_build_version()
  g = GPUS[gpu]
  config = _GPU_CONFIG.format(memory=g['memory_mib'] << 20, dnn_major=dnn // 10000,
                              smem_block=flash_lib.SHARED_MEMORY[g['capability'], 0],
                              dnn_minor=dnn // 100 % 100, cuda_major=cuda // 1000,
                              cuda_minor=cuda // 10 % 100, **g)
  try:
    desc = topologies.get_topology_desc(platform='cuda', target_config=config,
                                        topology=f'1x{hosts}x{per_host}')
  except Exception as e:  # the plugin's message: first line only
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise LaunchError(f'--compile_for={name!r}: jax\'s CUDA plugin failed: {first}') from None
  devices = list(desc.devices)
  fraction = float(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 0.75))
  return Target(name, 'gpu', devices, hosts, devices[0].device_kind,
                int(fraction * (g['memory_mib'] << 20)))


def local_target() -> Target:
  """This process's devices (a GPU node, a TPU VM, or the CPU)."""
  devices = jax.devices()
  limit = None
  try:  # (of a device of this host's: on the other hosts of a job devices[0] is not)
    limit = (jax.local_devices()[0].memory_stats() or {}).get('bytes_limit')
  except Exception:  # CPU devices keep no memory statistics
    pass
  return Target('local', jax.default_backend(), devices, jax.process_count(),
                devices[0].device_kind, limit)


def target_for(name: str) -> Target:
  """The devices of --compile_for's target: 'local', a GPU (h100:8) or a TPU slice (v5e:2x2;
  any case)."""
  name = name.lower()
  if name == 'local':
    return local_target()
  return gpu_target(name) if name.partition(':')[0] in GPUS else tpu_target(name)


# --------------------------------------------------------------------------------------
# One compile.
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
  """The facts of one compile, per chip unless said otherwise (bytes, FLOPs)."""
  batch_size: int
  fits: bool
  state_bytes: int = 0           # parameters + optimizer state, this chip's shards
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  temp_bytes: int = 0
  code_bytes: int = 0
  total_bytes: int = 0           # arguments + outputs - aliased + temporaries + code
  hbm_bytes: Optional[int] = None
  compiled_flops: float = 0.0    # matmuls, trip counts applied (hlo_stats)
  selection_flops: float = 0.0   # one-hot row selections (not in flops_per_example)
  model_flops: float = 0.0       # flops_per_example * batch / chips
  xla_flops: float = 0.0         # cost_analysis()['flops'] (loop bodies once)
  collectives: Dict[str, dict] = dataclasses.field(default_factory=dict)
  compile_seconds: float = 0.0
  loaded: bool = False           # the train step came from the compilation cache (local)
  refusal: str = ''              # the compiler's one-line reason when it would not fit
  eval_total_bytes: int = 0      # the evaluation step (the global batch in the train step's
  eval_refusal: str = ''         #   microbatches) beside the train state; 0: not compiled
  refused_temp_bytes: int = 0    # the temporaries it said the program needed, if it said
  attention: str = ''            # the path of each layer's attention (attention.paths)
  unknown_trip_counts: int = 0
  assumed_trip_counts: int = 0
  opaque_kernels: int = 0        # custom-call kernels (cuDNN attention, Pallas) not counted
  kernels: int = 0               # custom-call kernels run per step (the attention's, fused)

  @property
  def flop_ratio(self) -> float:
    return self.compiled_flops / self.model_flops if self.model_flops else float('nan')


def _with_batch(config, batch_size: int):
  config = config.copy_and_resolve_references()
  config.train.batch_size = int(batch_size)
  return config


def _state_bytes(abstract) -> int:
  """Bytes of this chip's shards of the train state (the largest shard per leaf)."""
  total = 0
  for leaf in jax.tree.leaves(abstract):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _out_of_memory(error: Exception) -> Optional[str]:
  """The compiler's refusal of a program too large for the device's memory, or None for
  other errors. A kernel that asks more on-chip memory than there is (a GPU block's shared
  memory, a TPU core's VMEM) is its tiling's fault, not the batch's (no batch fits): a
  one-line LaunchError."""
  text = str(error)
  if 'Shared memory size limit' in text or 'memory space vmem' in text:
    first = next(l.strip() for l in text.splitlines() if 'memory' in l.lower())[:200]
    raise LaunchError(f'a kernel asks more on-chip memory than the device has ({first}): its '
                      'tiling, not the batch; --config.model.fused_attention=off compiles '
                      '(and trains) without the kernels meanwhile: report the config') from None
  if any(k in text for k in ('RESOURCE_EXHAUSTED', 'Ran out of memory', 'out of memory',
                             'exceeds the memory')):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    useful = [l for l in lines if 'memory' in l.lower()] or lines
    return useful[0][:300]
  return None


def _bytes_after(label: str, text: str) -> Optional[int]:
  """'... <label> (15.75G) ...' in a compiler message -> bytes."""
  m = re.search(label + r' \((\d+(?:\.\d+)?)([KMGT]?)B?\)', text)
  if not m:
    return None
  return int(float(m.group(1)) * 1024 ** ('_KMGT'.index(m.group(2) or '_')))


def build(config, target: Target, batch_size: Optional[int] = None):
  """(mesh, program, abstract batch) for `config` on the target's devices; one-line errors
  for a mesh that does not divide the slice and a batch that does not split."""
  if batch_size is not None:
    config = _with_batch(config, batch_size)
  try:
    mesh = partitioning.make_mesh(config.mesh, target.devices)
  except ValueError as e:
    chips = len(target.devices)
    raise LaunchError(f'{e} (the target {target.name} has {chips} '
                      f'chip{"s" if chips > 1 else ""})') from None
  train_lib.check_batch_layout(config.train.batch_size, config.train.grad_accum_steps, mesh,
                               target.num_hosts)
  program = pretraining.program(config, mesh, platform=target.platform)
  data = partitioning.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=data)
           for k, v in program.batch_shapes.items()}
  return mesh, program, batch


def compile_step(config, target: Target, batch_size: Optional[int] = None, *,
                 eval_if_step_fits: bool = False):
  """Compile train.py's step for the target: (Report, compiled executable or None), and its
  evaluation step where it evaluates (train.eval_steps > 0); with `eval_if_step_fits` (the
  batch search's guesses) only where the train step fits, since otherwise the verdict is
  already given (its report then has no eval_total_bytes)."""
  batch_size = int(batch_size or config.train.batch_size)
  mesh, program, batch = build(config, target, batch_size)
  per_example = program.flops_per_example(config.data.max_seq_length)
  report = Report(batch_size=batch_size, fits=False, hbm_bytes=target.hbm_bytes,
                  state_bytes=_state_bytes(program.abstract),
                  model_flops=per_example * batch_size / len(target.devices))
  with partitioning.traced_on(mesh), flash_lib.compiling_for(target.devices):
    report.attention = attention_lib.paths(program.model.spec)
  start, hits = time.time(), compile_cache.stats()['hits']
  with jax.set_mesh(mesh), flash_lib.compiling_for(target.devices):
    lowered = program.train_step.lower(program.abstract, batch,
                                       *train_lib.abstract_step_arguments(mesh))
    try:
      compiled = lowered.compile()
    except Exception as e:  # XLA's errors are not a public type
      reason = _out_of_memory(e)
      if reason is None:
        raise
      report.refusal, report.compile_seconds = reason, time.time() - start
      report.refused_temp_bytes = _bytes_after(r'temporaries', str(e)) or 0
      available = _bytes_after(r'available HBM', str(e))
      if available and target.platform == 'tpu':  # the compiler's own figure rules
        target.hbm_bytes = report.hbm_bytes = available
      return report, None
  report.compile_seconds = time.time() - start
  report.loaded = compile_cache.stats()['hits'] > hits
  mem = compiled.memory_analysis()
  report.argument_bytes = int(mem.argument_size_in_bytes)
  report.output_bytes = int(mem.output_size_in_bytes)
  report.alias_bytes = int(mem.alias_size_in_bytes)
  report.temp_bytes = int(mem.temp_size_in_bytes)
  report.code_bytes = int(mem.generated_code_size_in_bytes)
  report.total_bytes = (report.argument_bytes + report.output_bytes - report.alias_bytes +
                        report.temp_bytes + report.code_bytes)
  if int(config.train.eval_steps) > 0 and not (eval_if_step_fits and
                                                not judge(report, target.hbm_bytes)):
    _compile_eval(program, mesh, batch, report)
  report.fits = judge(report, target.hbm_bytes)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report.xla_flops = float((cost or {}).get('flops', 0.0))
  stats = hlo_stats.analyze(compiled.as_text())
  report.compiled_flops = stats.matmul_flops
  report.selection_flops = stats.selection_flops
  report.unknown_trip_counts = stats.unknown_trip_counts
  report.assumed_trip_counts = stats.assumed_trip_counts
  report.opaque_kernels = stats.opaque_kernels
  report.kernels = stats.kernels
  report.collectives = {k: dataclasses.asdict(v) for k, v in sorted(stats.collectives.items())}
  return report, compiled


def judge(report: Report, hbm_bytes: Optional[int]) -> bool:
  """Fits: both compiled programs (the train step, and the evaluation step when there is
  one) within the HBM a program may use (always, when that is unknown)."""
  if report.refusal or report.eval_refusal:
    return False
  return hbm_bytes is None or max(report.total_bytes, report.eval_total_bytes) <= hbm_bytes


def _compile_eval(program, mesh, batch, report: Report) -> None:
  """train.py's evaluation step: forward only, the global batch in the train step's
  microbatches, while the train state stays in HBM; the verdict covers both."""
  with jax.set_mesh(mesh):
    try:
      compiled = program.eval_step.lower(program.abstract.params, batch).compile()
    except Exception as e:  # XLA's errors are not a public type
      reason = _out_of_memory(e)
      if reason is None:
        raise
      report.eval_refusal = reason
      return
  mem = compiled.memory_analysis()
  params = _state_bytes(program.abstract.params)
  report.eval_total_bytes = int(report.state_bytes + mem.argument_size_in_bytes - params +
                                mem.output_size_in_bytes - mem.alias_size_in_bytes +
                                mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)


def batch_unit(config, target: Target, multiple: int = 1) -> int:
  """The step of valid global batch sizes: microbatches split over data x fsdp and the
  batch over the hosts (and a multiple of `multiple`)."""
  shape = partitioning.mesh_shape(config.mesh, len(target.devices))
  dp = shape[0] * shape[1]
  k = int(config.train.grad_accum_steps)
  return math.lcm(dp * k, target.num_hosts, max(1, int(multiple)))


def _estimated_total(r: Report, fitted: Optional[Report]) -> Optional[float]:
  """A compile's total bytes per chip; for a refusal, the temporaries the compiler said it
  needed plus a fitting compile's non-temporary bytes (which do not grow with the batch but
  for the batch itself)."""
  if r.total_bytes:
    return float(max(r.total_bytes, r.eval_total_bytes))
  if r.refused_temp_bytes and fitted is not None:
    return float(r.refused_temp_bytes + fitted.total_bytes - fitted.temp_bytes)
  return None


def _check_memory_known(target: Target) -> None:
  if target.hbm_bytes is None:
    raise LaunchError(f'--find_max_batch needs the chips\' memory size, unknown for '
                      f'{target.device_kind}; compile for a TPU slice or a GPU')


def find_max_batch(config, target: Target, *, multiple: int = 1, max_compiles: int = 12,
                   limit: int = 1 << 20, first: Optional[Report] = None,
                   log=print) -> List[Report]:
  """Every compile of the search for the largest global batch that fits, in order; the
  answer is max(r.batch_size for r in reports if r.fits) (none fits: an empty answer).

  Memory per chip is close to affine in the batch, so each guess is where a line crosses
  HBM (_next_guess), rounded down to the batch unit and kept strictly inside the bracket
  (largest fitting, smallest failing). Near the limit the compiler squeezes a program to
  fit (it rematerialises), so memory there stops following the line and a guess a short
  step above the largest fitting batch (a unit, or up to 1% of it) may fit too: from then
  on each fit sends the next guess at least 1% of HBM's worth of batch above the largest
  fit, twice that after the next fit, and so on until a batch fails. From the third
  compile in a row on one side of the bracket (a batch having failed), each guess bisects
  it (halves, while nothing fits). The search ends when the bracket is one unit wide, or
  after `max_compiles`. A guess whose train step does not fit skips the evaluation step.
  """
  _check_memory_known(target)
  unit = batch_unit(config, target, multiple)
  limit = max(unit, limit // unit * unit)
  reports: List[Report] = []
  lo = hi = None  # largest fitting, smallest failing
  b = min(limit, max(unit, -(-int(config.train.batch_size) // unit) * unit))
  sides, crawl = [], 0  # fits or not, in order; fits in a row since a short step's fit
  for _ in range(max_compiles):
    if first is not None and first.batch_size == b:  # already compiled by the caller
      r, first = first, None
    else:
      r, _ = compile_step(config, target, b, eval_if_step_fits=True)
    reports.append(r)
    only_eval = not r.fits and r.total_bytes <= (target.hbm_bytes or math.inf)
    log(f'  batch {b}: ' + (f'{r.total_bytes / GiB:.2f} GiB per chip, ' + (
        'fits' if r.fits else 'its evaluation step does not fit' if only_eval else
        'does not fit') if not r.refusal else f'refused ({r.refusal})'))
    crawl = (crawl + 1 if r.fits and lo is not None and
             (crawl or b - lo.batch_size <= max(unit, lo.batch_size // 100)) else 0)
    if r.fits:
      lo = r if lo is None or r.batch_size > lo.batch_size else lo
    else:
      hi = r if hi is None or r.batch_size < hi.batch_size else hi
    if hi is not None and hi.batch_size == unit and not r.fits and lo is None:
      break  # not even the smallest batch fits
    if lo is not None and hi is not None and hi.batch_size - lo.batch_size <= unit:
      break
    if lo is not None and lo.batch_size >= limit:
      break
    sides.append(r.fits)
    bisect = hi is not None and len(sides) >= 3 and len(set(sides[-3:])) == 1
    b = _next_guess(reports, lo, hi, target.hbm_bytes, unit, limit, bisect, crawl)
  return reports


def search_summary(reports: List[Report], unit: int) -> dict:
  """max_batch (largest that fitted, 0 if none), first_failing (smallest that did not, or
  None), converged (they are one unit apart, or the smallest batch does not fit)."""
  fitting = [r.batch_size for r in reports if r.fits]
  failing = [r.batch_size for r in reports if not r.fits]
  best = max(fitting, default=0)
  above = min((b for b in failing if b > best), default=None)
  converged = above is not None and (above - best <= unit)
  return {'max_batch': best, 'first_failing': above, 'converged': converged}


def _next_guess(reports, lo, hi, hbm, unit, limit, bisect: bool, crawl: int) -> int:
  """The next batch of find_max_batch's search: where a line crosses `hbm`, the first of
  these whose memory grows with the batch. Once a batch has failed, the line through the
  bracket's ends (a refusal counts with the temporaries the compiler said it needed);
  before, the line through the largest fitting batch and the smallest compiled one (the
  widest base that close-to-affine memory has), else the line through the largest fit and
  its bytes that do not grow with the batch (the state and the code); where nothing but
  failures is known, memory proportional to the batch. `crawl`: the fits in a row since one
  landed a short step above the fit before (the compiler squeezing), after which, while no
  batch has failed, the guess goes at least 1% of HBM's worth of batch above the largest
  fit, doubling with each. Without a line (memory that did not grow), or with `bisect`:
  doubling, halving or the bracket's middle."""
  floor = lo.batch_size if lo is not None else 0
  ceiling = hi.batch_size if hi is not None else limit + unit
  known = sorted((r.batch_size, _estimated_total(r, lo)) for r in reports
                 if _estimated_total(r, lo) is not None)
  pairs = []
  if lo is not None:
    top = (floor, _estimated_total(lo, lo))
    if hi is not None:
      pairs.append([p for p in known if p[0] in (floor, ceiling)])
    else:
      pairs += [[p, top] for p in known[:1] if p[0] < floor]
      pairs.append([(0, float(lo.state_bytes + lo.code_bytes)), top])
  elif known:
    pairs.append([(0, 0.0), known[0]])
  slope = guess = None
  for pair in pairs:
    if len(pair) == 2 and pair[1][1] > pair[0][1] and pair[1][0] > pair[0][0]:
      (b0, m0), (b1, m1) = pair
      slope = (m1 - m0) / (b1 - b0)
      guess = b0 + (hbm - m0) / slope
      break
  if bisect:
    guess = None
  elif guess is not None and crawl and hi is None:
    guess = max(guess, floor + (hbm / 100) * 2 ** (crawl - 1) / slope)
  if guess is not None:  # rounded down to the unit, and kept strictly inside the bracket
    return min(max(int(guess // unit * unit), floor + unit), ceiling - unit)
  if hi is None:  # bisection (doubling / halving while one side is open)
    return min(limit, max(unit, floor * 2))
  if lo is None:
    return max(unit, (ceiling // 2) // unit * unit)
  guess = (floor + ceiling) // 2 // unit * unit
  return min(max(guess, floor + unit), ceiling - unit)


# --------------------------------------------------------------------------------------
# Measuring on local devices.
# --------------------------------------------------------------------------------------

def measure(config, target: Target, compiled, steps: int) -> dict:
  """Run the compiled step `steps` + 1 times on synthetic batches of the real format:
  median step time (the first run excluded) and MFU."""
  mesh, program, _ = build(config, target)
  tc = config.train
  state = program.init()
  data = pretraining.SyntheticData(
      vocab_size=program.model.spec.vocab_size, seq_len=config.data.max_seq_length,
      num_predictions=config.data.max_predictions_per_seq,
      global_batch_size=tc.batch_size, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(),
      next_sentence='next_sentence_labels' in program.batch_shapes)
  rate, rng = np.float32(program.peak_learning_rate), program.dropout_key()
  times = []
  with jax.set_mesh(mesh):
    for _ in range(steps + 1):
      batch = train_lib.global_batch(next(data), mesh)
      start = time.perf_counter()
      state, out = compiled(state, batch, rate, rng)
      jax.block_until_ready((state, out))
      times.append(time.perf_counter() - start)
  step = statistics.median(times[1:]) if steps else times[0]
  peak = metrics_lib.peak_flops_per_device(target.devices[0],
                                           tc.get('peak_flops_per_device', None))
  flops = (program.flops_per_example(config.data.max_seq_length) * tc.batch_size /
           len(target.devices))
  result = {'step_seconds': step, 'steps': steps,
            'examples_per_s': tc.batch_size / step,
            'tflops_per_device': flops / step / 1e12}
  if peak:
    result['mfu'] = flops / step / peak
  return result


# --------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------

def describe(config, target: Target) -> str:
  m, tc = config.model, config.train
  shape = partitioning.mesh_shape(config.mesh, len(target.devices))
  mesh = ' '.join(f'{a}={n}' for a, n in zip(partitioning.MESH_AXES, shape))
  hosts = f', {target.num_hosts} hosts' if target.num_hosts > 1 else ''
  slices = partitioning.slice_count(target.devices)
  hosts += f', {slices} slices' if slices > 1 else ''
  flags = [m.dtype, f'remat {m.remat_policy}']
  if m.scan_layers:  # every row of every layer: last_layer does not apply
    flags.insert(1, 'scan_layers')
  else:
    flags.append(f'last_layer {m.last_layer}')
  if m.get('residual_dtype', 'float32') != 'float32':
    flags.append(f'residual_dtype {m.residual_dtype}')
  name = resolve(m, platform=target.platform).name  # (the attention where it overrides)
  if config.get('objective', 'mlm_nsp') != 'mlm_nsp':
    name += f' ({config.objective})'
  return (f'{name}, {m.num_layers} layers x {m.hidden_size} on {target.name} '
          f'({len(target.devices)} x {target.device_kind}{hosts}); mesh {mesh}; '
          f'{", ".join(flags)}; grad_accum_steps {tc.grad_accum_steps}')


def format_report(config, target: Target, r: Report) -> str:
  t, p = config.data.max_seq_length, config.data.max_predictions_per_seq
  shape = partitioning.mesh_shape(config.mesh, len(target.devices))
  k = int(config.train.grad_accum_steps)
  rows = r.batch_size / (shape[0] * shape[1]) / k  # a tensor group shares its rows
  per = (f'{rows:g} sequences per chip per microbatch' +
         (f', {k} microbatches' if k > 1 else '') +
         (f'; {r.batch_size / target.num_hosts:g} per host' if target.num_hosts > 1 else ''))
  lines = [describe(config, target),
           f'global batch {r.batch_size} x {t} tokens ({per}), {p} predictions per '
           f'sequence; ' + ('loaded from the compilation cache' if r.loaded else 'compiled') +
           f' in {r.compile_seconds:.0f} s', f'attention: {r.attention}']
  hbm = f'{r.hbm_bytes / GiB:.2f} GiB' if r.hbm_bytes else 'unknown'
  if r.hbm_bytes and target.platform == 'tpu':
    hbm += ' usable'
  if r.refusal:
    lines += [f'does not fit: the compiler refused the program for {hbm} of HBM per chip: '
              f'{r.refusal}', f'verdict: does not fit ({memory_fixes(config, target)})']
    return '\n'.join(lines)
  g = lambda n: f'{n / GiB:9.3f}'
  lines += ['per chip                              GiB',
            f'  arguments (state + batch)     {g(r.argument_bytes)}',
            f'    of which params + optimizer {g(r.state_bytes)}',
            f'  outputs not aliased           {g(r.output_bytes - r.alias_bytes)}   (new '
            'buffers: not written over an argument)',
            f'  temporaries                   {g(r.temp_bytes)}',
            f'  program code                  {g(r.code_bytes)}',
            f'  total                         {g(r.total_bytes)}   of {hbm} HBM' +
            (f' ({r.total_bytes / r.hbm_bytes:.0%})' if r.hbm_bytes else '') +
            ': the four above']
  if r.eval_refusal:
    lines.append(f'  evaluation step: refused by the compiler ({r.eval_refusal}): lower '
                 'train.batch_size, raise train.grad_accum_steps or set train.eval_steps=0')
  elif r.eval_total_bytes:
    lines.append(f'  evaluation step, total        {g(r.eval_total_bytes)}   (forward only, in '
                 'the train step\'s microbatches, beside the train state)')
  train_fits = r.hbm_bytes and judge(dataclasses.replace(r, eval_refusal='', eval_total_bytes=0),
                                     r.hbm_bytes)  # (and the evaluation step does not)
  verdict = ('fits' if r.hbm_bytes and r.fits else
             'does not fit: the evaluation step (set train.eval_steps=0, raise '
             f'train.grad_accum_steps or {shard_fixes(config, target).split(",")[0]})'
             if train_fits else
             f'does not fit ({memory_fixes(config, target)})' if r.hbm_bytes else
             'no memory limit known for this device')
  lines.append(f'verdict: {verdict}')
  note = ''
  if config.model.remat_policy != 'none':
    note = {'full': ' (remat full recomputes the forward pass: expect about 4/3)',
            'dots': ' (remat dots saves the matmuls: expect about 1)',
            'dots_no_batch': ' (remat dots_no_batch recomputes the batched attention '
                             'matmuls: a little above 1)',
            'dots_flash': ' (remat dots_flash saves the matmuls and the flash kernels\' '
                          'outputs: expect about 1)'}.get(
                config.model.remat_policy, '')
  elif r.flop_ratio > 1.05:
    note = (' (above 1 without remat: the fused attention\'s backward rebuilds Q K^T, up to '
            'about 1.05 at length 512; beyond, XLA recomputed work to fit in memory, which '
            'happens near the HBM limit, or the partitioner duplicated it)')
  if r.unknown_trip_counts:
    note += f' ({r.unknown_trip_counts} loops of unknown trip count counted once)'
  if r.assumed_trip_counts:
    note += (f' ({r.assumed_trip_counts} loops counted from 0 by 1 to their bound: start or '
             f'step not readable)')
  if r.opaque_kernels:
    note += (f' ({r.opaque_kernels} runs of custom kernels, such as cuDNN or Pallas attention, '
             'whose FLOPs the HLO does not state: not counted)')
  lines.append(f'custom kernels: {r.kernels} runs per step (the fused attention\'s Pallas '
               'kernels, forward and backward, or cuDNN\'s)' if r.kernels else
               'custom kernels: none')
  lines += [f'FLOPs per chip per step: compiled matmuls {r.compiled_flops:.4g}, model '
            f'(flops_per_example) {r.model_flops:.4g}, ratio {r.flop_ratio:.3f}{note}',
            f'  (plus one-hot row selections {r.selection_flops:.3g}; XLA\'s cost_analysis '
            f'says {r.xla_flops:.4g}, counting each loop body once)']
  if r.collectives:
    lines.append('collectives per chip per step (how many, and the sizes of their buffers '
                 'summed over them all: not bytes on the wire)')
    for kind, c in r.collectives.items():
      lines.append(f'  {kind:<20} {c["count"]:6d}, {c["bytes"] / GiB:9.3f} GiB in all')
  else:
    lines.append('collectives: none')
  return '\n'.join(lines)


def _as_dict(r: Report) -> dict:
  return dict(dataclasses.asdict(r), flop_ratio=r.flop_ratio)


# train.py --compile_for's exit status where the config's own step does not fit the target's
# memory (the compiler refused it, or its bytes exceed the HBM a program may use): a script
# that checks a config before it books a slice reads it (0: fits, or no limit is known;
# 1: an error).
EXIT_DOES_NOT_FIT = 3


def exit_status(result: dict) -> int:
  """train.py --compile_for's exit status for run()'s result: EXIT_DOES_NOT_FIT or 0."""
  report = result['report']
  return EXIT_DOES_NOT_FIT if report['hbm_bytes'] and not report['fits'] else 0


def run(config, compile_for: str, *, max_batch: bool = False, measure_steps: int = 5,
        json_path: str = '', batch_multiple: int = 1, max_compiles: int = 12,
        log=functools.partial(print, flush=True)) -> dict:
  """The --compile_for command: compile, report, optionally search the batch and measure
  (exit_status(result): train.py's exit status)."""
  if max_compiles < 1 or batch_multiple < 1:
    raise LaunchError(f'--max_compiles={max_compiles} and --batch_multiple={batch_multiple} '
                      'must be at least 1')
  if json_path:  # fail before the compiles, not after
    folder = os.path.dirname(os.path.abspath(json_path))
    if os.path.isdir(json_path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
      raise LaunchError(f'--launch_json={json_path!r} cannot be written; name a file in an '
                        f'existing, writable folder')
  target = target_for(compile_for)
  if max_batch:
    _check_memory_known(target)
  chips = len(target.devices)
  evaluates = int(config.train.eval_steps) > 0
  log(f'compiling the train step{" and the evaluation step" if evaluates else ""}'
      f' for {target.name} ({chips} chip{"s" if chips > 1 else ""}) ...')
  report, compiled = compile_step(config, target)
  log(format_report(config, target, report))
  result = {'target': target.name, 'chips': len(target.devices), 'hosts': target.num_hosts,
            'device_kind': target.device_kind, 'report': _as_dict(report)}
  if max_batch:
    log(f'searching the largest global batch that fits (multiples of '
        f'{batch_unit(config, target, batch_multiple)}):')
    unit = batch_unit(config, target, batch_multiple)
    tried = find_max_batch(config, target, multiple=batch_multiple, first=report, log=log,
                           max_compiles=max_compiles)
    summary = search_summary(tried, unit)
    best = next((r for r in tried if r.fits and r.batch_size == summary['max_batch']), None)
    result.update(summary)
    result['max_batch_total_bytes'] = best.total_bytes if best else 0
    result['search'] = [_as_dict(r) for r in tried]
    if best is None and summary['converged']:  # the smallest batch was refused: more
      log(f'no batch fits, not even {unit}: {shard_fixes(config, target)}')  # microbatches
      # would not help (their rows are the batch's)
    elif best is None:
      log(f'no batch tried fits (the smallest tried: {summary["first_failing"]}); the search '
          f'stopped after {len(tried)} compiles before reaching {unit}: raise --max_compiles')
    elif summary['converged']:
      log(f'largest global batch that fits: {best.batch_size} '
          f'({best.total_bytes / GiB:.2f} GiB per chip; {summary["first_failing"]} does not)')
    else:
      above = (f'; {summary["first_failing"]} did not' if summary['first_failing']
               else '')
      log(f'largest global batch that fits: at least {best.batch_size} '
          f'({best.total_bytes / GiB:.2f} GiB per chip{above}; the search stopped after '
          f'{len(tried)} compiles: raise --max_compiles, or --batch_multiple for coarser '
          'steps)')
  # Measured: train steps, so the train step alone must fit (not the evaluation step too).
  step_fits = judge(dataclasses.replace(report, eval_refusal='', eval_total_bytes=0),
                    target.hbm_bytes)
  if target.name == 'local' and compiled is not None and measure_steps > 0 and not step_fits:
    log('not measured: the train step does not fit this device\'s memory')
  elif target.name == 'local' and compiled is not None and measure_steps > 0:
    m = measure(config, target, compiled, measure_steps)
    result['measured'] = m
    mfu = f', MFU {m["mfu"]:.1%}' if 'mfu' in m else ''
    log(f'measured over {measure_steps} steps (synthetic data): {m["step_seconds"]:.4f} s '
        f'per step (median), {m["examples_per_s"]:.1f} examples/s, '
        f'{m["tflops_per_device"]:.2f} TFLOP/s per device{mfu}')
  if json_path:
    with open(json_path, 'w') as f:
      json.dump(result, f, indent=1)
  return result
