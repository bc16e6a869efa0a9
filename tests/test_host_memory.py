"""realformer/train/host_memory.py: a warmed-up CPU step takes no page faults once applied."""

import os
import subprocess
import sys

import pytest

from realformer.train import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A jitted function whose temporaries (several 32 MB buffers) are allocated and freed per call.
_PROGRAM = r"""
import resource, sys
sys.path.insert(0, {repo!r})
from realformer.train import host_memory
applied = host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() + jnp.exp(jnp.sin(x) * 2).sum())
x = jnp.ones((2048, 4096), jnp.float32) / 4096
for _ in range(5):
  f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(12):
  f(x).block_until_ready()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith('MALLOC_') and k not in ('GLIBC_TUNABLES', 'LD_PRELOAD',
                                                     'REALFORMER_MALLOC')}
  env.update(JAX_PLATFORMS='cpu', **env_extra)
  out = subprocess.run([sys.executable, '-c', _PROGRAM.format(repo=REPO)], env=env,
                       capture_output=True, text=True, check=True, timeout=300)
  applied, faults = out.stdout.split()[-2:]
  return applied == 'True', int(faults)


@pytest.mark.skipif(not host_memory._glibc(), reason='mallopt settings are glibc-specific')
def test_warm_steps_take_no_page_faults():
  applied, faults = _faults({})
  default_applied, default_faults = _faults({'REALFORMER_MALLOC': 'default'})
  assert applied and not default_applied
  # Kept, twelve warm calls fault in no more than a few stray 32 MB blocks (8,192 pages
  # each; 2,500-18,000 pages from one process to the next here, however many calls), where
  # temporaries faulted in on every call would be over 12,000 pages a call: glibc's
  # defaults under jax 0.10 faulted about 1.6 million pages in three calls, and under jax
  # 0.11 fault 22,000-50,000 in twelve.
  assert faults <= 4 * 8192, (faults, default_faults)


@pytest.mark.skipif(not host_memory._glibc(), reason='mallopt settings are glibc-specific')
def test_user_malloc_tuning_is_left_alone():
  applied, _ = _faults({'MALLOC_ARENA_MAX': '4'})
  assert not applied


def test_accelerator_runs_are_left_alone(monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda,cpu')
  assert host_memory._accelerator_possible()
  monkeypatch.setenv('JAX_PLATFORMS', 'tpu')
  assert host_memory._accelerator_possible()
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  assert not host_memory._accelerator_possible()
  monkeypatch.delenv('JAX_PLATFORMS')  # unset: decided by what is installed
  real_find_spec = host_memory.importlib.util.find_spec
  monkeypatch.setattr(host_memory.importlib.util, 'find_spec',
                      lambda name: object() if name == 'libtpu' else real_find_spec(name))
  assert host_memory._accelerator_possible()
