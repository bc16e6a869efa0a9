r"""Saving and restoring a train state: a local folder against gs:// on the loopback server.

  python benchmarks/checkpoint_io.py --size base --repeats 3

Builds the train state of configs/pretrain.py:postln,<size> (params and AdamW's two moments,
float32: 1.3 GB for BERT-base; the moments random, as incompressible as a trained state's,
or with --moments zeros as initialised), then saves it with realformer.train.checkpoints (Orbax: a
temporary folder renamed locally, its commit-file protocol on gs://) and restores it, into a
temporary local folder and into gs:// on the tests' GCS server (tests/gcs_server.py: the
emulator in memory on 127.0.0.1). Reports seconds (median) and the bytes stored. The gs://
figures measure this code path (gcsfs, tensorstore's GCS driver, Orbax's commit protocol)
against a single-threaded Python server on the same machine, not Cloud Storage's speed.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fsspec  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import pretrain  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.train import checkpoints  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.train import partitioning  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer import storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.train import pretraining  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.train import train_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.gcs_server import gcs_server  # pylint: disable=g-import-not-at-top,wrong-import-position


def stored_bytes(root) -> int:
  fs, path = fsspec.core.url_to_fs(str(storage.path(root)))
  return int(fs.du(path))


def round_trip(root: str, tree, abstract) -> dict:
  manager = checkpoints.make_manager(root, item_names=('state',))
  t = time.perf_counter()
  checkpoints.save(manager, 1, tree, force=True)
  manager.wait_until_finished()
  save_s = time.perf_counter() - t
  t = time.perf_counter()
  restored, _ = checkpoints.restore(manager, 1, abstract)
  jax.block_until_ready(restored)
  restore_s = time.perf_counter() - t
  manager.close()
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
    assert np.array_equal(a, b)
  return {'save': save_s, 'restore': restore_s, 'bytes': stored_bytes(root)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--size', default='base')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--moments', choices=('trained', 'zeros'), default='trained',
                 help='AdamW\'s moments as a trained state holds them (random values, which '
                      'compress as little as trained ones) or as initialised (zeros)')
  args = p.parse_args()
  print(machine.describe())
  config = pretrain.get_config(f'postln,{args.size}')
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  model = models.build(config.model)
  tx = train_lib.make_optimizer(config.optimizer, model.spec)
  state, _ = train_lib.create_train_state(model, tx, pretraining.abstract_batch(2, 128, 20),
                                          mesh, 0)
  opt_state = state.opt_state
  if args.moments == 'trained':
    leaves, treedef = jax.tree.flatten(opt_state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    opt_state = treedef.unflatten([
        jax.device_put(jax.random.normal(k, x.shape, x.dtype) * 1e-3, x.sharding)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.ndim else x
        for k, x in zip(keys, leaves)])
  tree = {'step': state.step, 'params': state.params, 'opt_state': opt_state}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          tree)
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  results = {'local folder': [], 'gs:// (loopback server)': []}
  with gcs_server() as bucket:
    for i in range(args.repeats):
      local = tempfile.mkdtemp(prefix='checkpoint_io_')
      results['local folder'].append(round_trip(local, tree, abstract))
      shutil.rmtree(local)
      results['gs:// (loopback server)'].append(round_trip(f'{bucket}/run{i}', tree, abstract))
  print(f'postln,{args.size} train state: {size / 2**30:.2f} GiB in memory, '
        f'{len(jax.tree.leaves(tree))} arrays; medians of {args.repeats}')
  print('| where | save s | restore s | stored GiB |\n|---|---|---|---|')
  for where, runs in results.items():
    med = lambda k: statistics.median(r[k] for r in runs)
    print(f'| {where} | {med("save"):.1f} | {med("restore"):.1f} | '
          f'{med("bytes") / 2**30:.2f} |')


if __name__ == '__main__':
  main()
