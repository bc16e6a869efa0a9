"""Several processes (TPU pod hosts, GPU nodes): jax.distributed.initialize() for train.py
and finetune.py alike, and the steps every process takes together.

    distributed.define_flags()            # --coordinator_address, --num_processes, --process_id
    distributed.initialize_from_flags()   # in main(), before jax is used

With several processes, a process that raises while the others go on into the next
collective leaves them waiting there for ever. So the work one process does for all
(on_process_zero: a write to the run's folder; read_on_process_zero: a look at it) and the
work each does alone (on_every_process: its own copy of a file, its own checks) are
collectives themselves: every process calls them at the same point, and a failure anywhere
raises on every process, the others with a one-line ProcessFailed naming the process.
same_on_every_process checks that what each host read for itself is the same everywhere (a
ValueError on every process where not); from_process_zero and json_from_process_zero give
every process process 0's value. With one process each is the plain call.
"""

import json
import os
import re
from typing import Callable, List, Mapping, Optional, TypeVar

import jax
import numpy as np
from absl import flags
from absl import logging

from realformer import cli

T = TypeVar('T')


class ProcessFailed(cli.UserError):
  """Another process of the job failed at a step all of them take together: its own log
  says why (here: one line, no traceback)."""


def define_flags() -> None:
  flags.DEFINE_string('coordinator_address', None,
                      'host:port of process 0 for multi-process runs (or '
                      '$JAX_COORDINATOR_ADDRESS); TPU pods and SLURM are detected without it.')
  flags.DEFINE_integer('num_processes', None, 'Number of processes (or $JAX_NUM_PROCESSES).')
  flags.DEFINE_integer('process_id', None, 'This process (or $JAX_PROCESS_ID).')


# One folder per GPU that the NVIDIA driver sees on this node.
NVIDIA_GPUS = '/proc/driver/nvidia/gpus'


def slurm_node_devices(env: Mapping[str, str]) -> Optional[List[int]]:
  """The local device ids a SLURM task drives where jax's own choice, the GPU of its
  SLURM_LOCALID (one task per GPU, each seeing all of the node's), is wrong: a node's only
  task drives every GPU it can see (CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE, else, on
  a cluster that does not schedule GPUs as resources, every GPU of the node's driver), and
  a task that sees one GPU (--gpus-per-task=1: SLURM gives each task its own) drives that
  one, whatever its SLURM_LOCALID. None otherwise (jax's layout stands)."""
  if 'SLURM_JOB_ID' not in env:
    return None
  visible = [d for d in env.get('CUDA_VISIBLE_DEVICES', '').split(',') if d.strip()]
  per_node = env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE') or ''
  counts = re.findall(r'(\d+)(?:\(x\d+\))?', per_node)  # e.g. '1(x4)' or '2,1'
  if not counts or any(int(c) != 1 for c in counts):
    return [0] if len(visible) == 1 else None
  gpus = env.get('SLURM_GPUS_ON_NODE', '').strip()
  n = len(visible) if visible else int(gpus) if gpus.isdigit() else 0
  if not (n or gpus or 'CUDA_VISIBLE_DEVICES' in env):  # GPUs not scheduled by SLURM
    try:
      n = len(os.listdir(NVIDIA_GPUS))
    except OSError:  # no NVIDIA driver
      pass
  return list(range(n)) or None


def _on_cloud_tpu_vm() -> bool:
  """Whether `import jax` found TPU chips on this VM (jax's own detection, made at import).
  A pod slice's hosts are then found by jax through the TPU metadata server."""
  from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top
  return bool(getattr(cloud_tpu_init, 'running_in_cloud_tpu_vm', False))


def maybe_initialize(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None,
                     process_id: Optional[int] = None) -> None:
  """jax.distributed.initialize() when several processes may take part.

  Explicit values (flags, else $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES /
  $JAX_PROCESS_ID) win; otherwise jax detects SLURM jobs (SLURM_NTASKS > 1) and Cloud TPU
  VMs (a pod slice's workers, from the TPU metadata; a single-host slice is one process).
  Under SLURM a node's only task drives all the node's GPUs, and a task that sees one GPU
  drives it (slurm_node_devices). A single
  process on one machine initializes nothing.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS')
  num_processes = num_processes or (int(env['JAX_NUM_PROCESSES'])
                                    if 'JAX_NUM_PROCESSES' in env else None)
  if process_id is None and 'JAX_PROCESS_ID' in env:
    process_id = int(env['JAX_PROCESS_ID'])
  devices = slurm_node_devices(env)
  if coordinator_address or (num_processes or 1) > 1:
    if jax.config.jax_platforms == 'cpu' or env.get('JAX_PLATFORMS') == 'cpu':
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=devices)
  elif int(env.get('SLURM_NTASKS', '1')) > 1 or ',' in env.get('TPU_WORKER_HOSTNAMES', ''):
    jax.distributed.initialize(local_device_ids=devices)
  elif _on_cloud_tpu_vm() and env.get('JAX_PLATFORMS') != 'cpu':  # (not a CPU debug run)
    try:
      jax.distributed.initialize()
    except Exception as e:  # pylint: disable=broad-except  (no slice found, no metadata)
      logging.warning('this TPU VM found no pod slice to join (%s): running as one process',
                      str(e).splitlines()[0] if str(e) else type(e).__name__)


def initialize_from_flags() -> None:
  f = flags.FLAGS
  maybe_initialize(f.coordinator_address, f.num_processes, f.process_id)


def from_process_zero(value: int) -> int:
  """`value` as process 0 has it, on every process (a collective: every process calls
  this at the same point); `value` itself with one process."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def json_from_process_zero(value: T) -> T:
  """`value` (anything JSON holds) as process 0 has it, on every process (a collective);
  `value` itself with one process."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  size = from_process_zero(len(data))
  sent = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    sent[:] = data
  return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(sent))).decode())


def read_on_process_zero(read: Callable[[], T], what: str) -> T:
  """`read()` (anything JSON holds) as process 0 finds it, on every process; with several
  processes a collective, read by process 0 alone (what each host saw of a shared folder
  could differ: a file system's cache, a file written meanwhile), and if the read fails
  every process raises (on_process_zero)."""
  found = []
  on_process_zero(lambda: found.append(read()), what)
  return json_from_process_zero(found[0] if found else None)


def on_process_zero(action: Callable[[], object], what: str) -> None:
  """Runs `action` on process 0 alone (a write to the run's shared folder, a clean-up before
  the other processes list it). With several processes every process returns only once it
  is done (a collective: every process calls this at the same point), and if it raised,
  every process raises: process 0 its own error, the others a one-line error saying that
  process 0 failed to `what` (they would otherwise run on to the next collective and wait
  there for a process that has stopped)."""
  if jax.process_count() == 1:
    action()
    return
  error = None
  if jax.process_index() == 0:
    try:
      action()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised after the broadcast)
      error = e
  failed = from_process_zero(error is not None)
  if error is not None:
    raise error
  if failed:
    raise ProcessFailed(f'process 0 failed to {what}; its log says why')


def gathered(value: int) -> List[int]:
  """`value` (an int32) of every process, in process order (a collective)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int32(value)))]


def on_every_process(action: Callable[[], T], what: str) -> T:
  """`action()` on every process (work each host does alone: reading its own copy of a
  file, checking its own view of a config); returns its value. With several processes
  every process returns only once each is done (a collective: every process calls this at
  the same point), and if it raised anywhere, every process raises: those it failed on
  their own error, the others a one-line error naming the first that failed (they would
  otherwise run on to the next collective and wait there for a process that has stopped)."""
  if jax.process_count() == 1:
    return action()
  value, error = None, None
  try:
    value = action()
  except BaseException as e:  # pylint: disable=broad-except  (re-raised after the gather)
    error = e
  failed = [i for i, f in enumerate(gathered(error is not None)) if f]
  if error is not None:
    raise error
  if failed:
    raise ProcessFailed(f'process {failed[0]} failed to {what}; its log says why')
  return value


def same_on_every_process(digest: Callable[[], int], what: str, fix: str) -> None:
  """Raises a one-line ValueError on every process unless `digest()` (a checksum of what
  each host read for itself: its copy of the data) is the same on all (a collective; not
  computed with one process)."""
  if jax.process_count() == 1:
    return
  seen = gathered(np.uint32(digest()).view(np.int32))
  differ = [i for i, v in enumerate(seen) if v != seen[0]]
  if differ:
    raise ValueError(f'{what} differs between processes (process {differ[0]} of {len(seen)} '
                     f'read other than process 0); {fix}')
