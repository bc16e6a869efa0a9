"""Several processes (TPU pod hosts, GPU nodes): jax.distributed.initialize() for train.py
and finetune.py alike.

    distributed.define_flags()            # --coordinator_address, --num_processes, --process_id
    distributed.initialize_from_flags()   # in main(), before jax is used
"""

import os
from typing import Optional

import jax
from absl import flags


def define_flags() -> None:
  flags.DEFINE_string('coordinator_address', None,
                      'host:port of process 0 for multi-process runs (or '
                      '$JAX_COORDINATOR_ADDRESS); TPU pods and SLURM are detected without it.')
  flags.DEFINE_integer('num_processes', None, 'Number of processes (or $JAX_NUM_PROCESSES).')
  flags.DEFINE_integer('process_id', None, 'This process (or $JAX_PROCESS_ID).')


def maybe_initialize(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None,
                     process_id: Optional[int] = None) -> None:
  """jax.distributed.initialize() when several processes take part.

  Explicit values (flags, else $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES /
  $JAX_PROCESS_ID) win; otherwise jax detects TPU pod slices and SLURM jobs
  (SLURM_NTASKS > 1) by itself. A single process on one machine initializes nothing.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS')
  num_processes = num_processes or (int(env['JAX_NUM_PROCESSES'])
                                    if 'JAX_NUM_PROCESSES' in env else None)
  if process_id is None and 'JAX_PROCESS_ID' in env:
    process_id = int(env['JAX_PROCESS_ID'])
  if coordinator_address or (num_processes or 1) > 1:
    if jax.config.jax_platforms == 'cpu' or env.get('JAX_PLATFORMS') == 'cpu':
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  elif int(env.get('SLURM_NTASKS', '1')) > 1 or ',' in env.get('TPU_WORKER_HOSTNAMES', ''):
    jax.distributed.initialize()


def initialize_from_flags() -> None:
  f = flags.FLAGS
  maybe_initialize(f.coordinator_address, f.num_processes, f.process_id)
