"""Times the optimizer update alone (global-norm clipping + AdamW or LAMB) on a model's parameters.

    python benchmarks/optimizer.py --size base [--rounds 9]

The update is memory-bound: every parameter, its gradient and both Adam moments are read and
written once per step, 110M x 4 float32 arrays at BERT-base. Contenders, timed round-robin
in one process on the same parameter shapes (our model's, from jax.eval_shape):

  ours            train_lib.make_optimizer: our multiply clip, optax.adamw (decay mask), the
                  step's learning rate applied (train_lib.apply_learning_rate)
  ours, lamb      the same with optimizer.name=lamb (train_lib.lamb: per-tensor trust ratios)
  optax clip      the same with optax.clip_by_global_norm (select + divide)
  torch AdamW     torch.optim.AdamW(default implementation) + clip_grad_norm_, the HF peer's
  torch fused     torch.optim.AdamW(fused=True) + clip_grad_norm_

Each contender's update is jitted with its parameters and state donated, like the train step.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import pretrain
from benchmarks import machine
from realformer import models
from realformer.model.spec import resolve
from realformer.train import pretraining
from realformer.train import train_lib


class Jax:
  """One jitted update (params, opt_state, grads) -> (params, opt_state), donated; with a
  `rate`, tx is make_optimizer's (at a rate of 1) and its updates are scaled as the train
  step scales them."""

  def __init__(self, name, tx, abstract_params, rate=None):
    self.name = name
    full = lambda v: jax.tree.map(lambda a: jnp.full(a.shape, v, jnp.float32), abstract_params)
    self.grads = full(1e-3)
    params = full(1e-2)
    self.state = (params, tx.init(params))

    def update(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      if rate is not None:
        updates = train_lib.apply_learning_rate(updates, jnp.float32(rate))
      return optax.apply_updates(params, updates), opt_state

    self.fn = jax.jit(update, donate_argnums=(0, 1))

  def step(self):
    self.state = self.fn(*self.state, self.grads)
    jax.block_until_ready(self.state)


class Torch:

  def __init__(self, name, shapes, threads, **kwargs):
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    self.name, self.torch = name, torch
    self.params = [torch.nn.Parameter(torch.full(s, 1e-2)) for s in shapes]
    for p in self.params:
      p.grad = torch.full(p.shape, 1e-3)
    self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, eps=1e-6, **kwargs)

  def step(self):
    self.torch.nn.utils.clip_grad_norm_(self.params, 1.0)
    self.opt.step()


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--size', default='base')
  p.add_argument('--rounds', type=int, default=9)
  p.add_argument('--threads', type=int, default=os.cpu_count())
  p.add_argument('--peer', choices=['torch', 'none'], default='torch')
  args = p.parse_args()

  config = pretrain.get_config(f'postln,{args.size}')
  model = models.build(config.model)
  batch = {k: jnp.zeros(v.shape, v.dtype)
           for k, v in pretraining.abstract_batch(1, 8, 2).items()}
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)['params'])
  shapes = [tuple(x.shape) for x in jax.tree.leaves(abstract)]
  tx = train_lib.make_optimizer(config.optimizer, resolve(config.model))
  rate = float(config.optimizer.learning_rate)
  optax_clip = optax.chain(
      optax.clip_by_global_norm(float(config.optimizer.clip_norm)),
      optax.adamw(train_lib.make_schedule(config.optimizer, config.train.num_steps),
                  b1=config.optimizer.b1, b2=config.optimizer.b2, eps=config.optimizer.eps,
                  weight_decay=config.optimizer.weight_decay, mask=train_lib.decay_mask))
  config.optimizer.name = 'lamb'
  lamb = train_lib.make_optimizer(config.optimizer, resolve(config.model))
  contenders = [Jax('ours', tx, abstract, rate), Jax('ours, lamb', lamb, abstract, rate),
                Jax('optax clip', optax_clip, abstract)]
  if args.peer == 'torch':
    contenders += [Torch('torch AdamW', shapes, args.threads),
                   Torch('torch AdamW fused', shapes, args.threads, fused=True)]
  times = {c.name: [] for c in contenders}
  for c in contenders:
    c.step()
  for _ in range(args.rounds):
    for c in contenders:
      c.step()  # settle after the other framework's step
      t = time.perf_counter()
      c.step()
      times[c.name].append(time.perf_counter() - t)

  n = sum(int(np.prod(s)) for s in shapes)
  print(machine.describe())
  print(f'## {args.size}: {n / 1e6:.1f}M parameters in {len(shapes)} arrays, '
        f'{args.rounds} rounds, {jax.devices()[0].device_kind}')
  print('| contender | update ms (median) | GB/s (8 passes of float32) | time / ours |')
  print('|---|---|---|---|')
  ours = statistics.median(times['ours'])
  for name, ts in times.items():
    m = statistics.median(ts)
    print(f'| {name} | {m * 1e3:.0f} | {8 * 4 * n / m / 1e9:.0f} | {m / ours:.2f} |')


if __name__ == '__main__':
  main()
