"""Which processes jax.distributed joins, and which GPUs each drives (realformer/train/
distributed.py). jax's own cluster detection is run on SLURM's environment, without
initializing anything."""

import os

import pytest
from jax._src import clusters

from realformer.train import distributed

SLURM = {'SLURM_JOB_ID': '123', 'SLURM_STEP_NODELIST': 'gpu[01-04]', 'SLURM_JOB_NODELIST':
         'gpu[01-04]', 'SLURM_NTASKS': '4', 'SLURM_PROCID': '2', 'SLURM_LOCALID': '0',
         'SLURM_STEP_TASKS_PER_NODE': '1(x4)', 'SLURM_GPUS_ON_NODE': '8'}


@pytest.mark.parametrize('env, want', [
    (SLURM, list(range(8))),
    (dict(SLURM, SLURM_GPUS_ON_NODE='', CUDA_VISIBLE_DEVICES='0,1,2,3'), [0, 1, 2, 3]),
    (dict(SLURM, CUDA_VISIBLE_DEVICES='4,5'), [0, 1]),  # what the task can see
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE='8(x4)', SLURM_NTASKS='32'), None),  # one per GPU
    # --gpus-per-task=1: each task sees its own GPU, not the one of its SLURM_LOCALID
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE='8(x4)', SLURM_LOCALID='5', CUDA_VISIBLE_DEVICES='5'),
     [0]),
    (dict(SLURM, SLURM_STEP_TASKS_PER_NODE='1,2'), None),
    (dict(SLURM, SLURM_GPUS_ON_NODE='', CUDA_VISIBLE_DEVICES=''), None),  # no GPU: jax decides
    ({}, None),
])
def test_a_nodes_only_task_drives_every_gpu_of_the_node_and_a_task_its_own(env, want):
  assert distributed.slurm_node_devices(env) == want


def test_without_gpus_scheduled_a_nodes_only_task_drives_every_gpu_of_its_driver(
    tmp_path, monkeypatch):
  """A cluster that does not schedule GPUs as SLURM resources sets neither
  CUDA_VISIBLE_DEVICES nor SLURM_GPUS_ON_NODE: the driver's GPUs, not jax's one GPU."""
  for gpu in ('0000:18:00.0', '0000:2a:00.0', '0000:3a:00.0'):
    (tmp_path / gpu).mkdir()
  monkeypatch.setattr(distributed, 'NVIDIA_GPUS', str(tmp_path))
  unscheduled = {k: v for k, v in SLURM.items() if k != 'SLURM_GPUS_ON_NODE'}
  assert distributed.slurm_node_devices(unscheduled) == [0, 1, 2]
  assert distributed.slurm_node_devices(dict(unscheduled, CUDA_VISIBLE_DEVICES='')) is None
  assert distributed.slurm_node_devices(dict(unscheduled, CUDA_VISIBLE_DEVICES='1')) == [0]
  assert distributed.slurm_node_devices(dict(SLURM, SLURM_STEP_TASKS_PER_NODE='2(x2)')) is None
  monkeypatch.setattr(distributed, 'NVIDIA_GPUS', str(tmp_path / 'absent'))
  assert distributed.slurm_node_devices(unscheduled) is None


def _jax_detects(monkeypatch, env, **given):
  for key in [k for k in os.environ if k.startswith('SLURM_')]:
    monkeypatch.delenv(key)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      given.get('coordinator_address'), given.get('num_processes'), given.get('process_id'),
      given.get('local_device_ids'), None, 10)


def test_jax_alone_gives_a_slurm_task_one_gpu_and_ours_keeps_the_node(monkeypatch):
  """The fault this module corrects: left to itself jax hands each SLURM task the GPU of its
  SLURM_LOCALID, also with explicit coordinator values (the documented sbatch script's)."""
  explicit = dict(coordinator_address='gpu01:12345', num_processes=4, process_id=2)
  for given in ({}, explicit):
    assert _jax_detects(monkeypatch, SLURM, **given)[3] == [0]
    devices = distributed.slurm_node_devices(SLURM)
    assert _jax_detects(monkeypatch, SLURM, local_device_ids=devices, **given)[3] == devices


def test_which_runs_initialize(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, 'initialize',
                      lambda **kw: calls.append(kw))
  for key in [k for k in os.environ if k.startswith(('SLURM_', 'JAX_', 'TPU_'))]:
    monkeypatch.delenv(key)
  monkeypatch.setattr(distributed, '_on_cloud_tpu_vm', lambda: False)
  distributed.maybe_initialize()
  assert calls == []  # one process on one machine
  for key, value in SLURM.items():
    monkeypatch.setenv(key, value)
  distributed.maybe_initialize()
  assert calls.pop() == {'local_device_ids': list(range(8))}
  distributed.maybe_initialize('gpu01:12345', 4, 2)
  assert calls.pop() == {'coordinator_address': 'gpu01:12345', 'num_processes': 4,
                         'process_id': 2, 'local_device_ids': list(range(8))}
  for key in SLURM:
    monkeypatch.delenv(key)
  monkeypatch.setattr(distributed, '_on_cloud_tpu_vm', lambda: True)  # a pod slice's host
  distributed.maybe_initialize()
  assert calls.pop() == {}
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')  # a CPU debug run on that host: alone
  distributed.maybe_initialize()
  assert calls == []
  monkeypatch.delenv('JAX_PLATFORMS')

  def no_slice(**kw):
    raise ConnectionError('metadata server unreachable')
  monkeypatch.setattr(distributed.jax.distributed, 'initialize', no_slice)
  distributed.maybe_initialize()  # a TPU VM without metadata: one process, not an error
