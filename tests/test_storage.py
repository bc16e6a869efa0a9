"""Checkpoints on Cloud Storage (a GCS server on 127.0.0.1: tests/gcs_server.py): Orbax
commits a step with its commit file, never by a rename; a step cut short (no commit file) is
never restored; a model's worth of arrays round-trips; params-only checkpoints and config.json
round-trip through gs://. And the server itself keeps Cloud Storage's generation
preconditions, which tensorstore and a lock object rely on."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from realformer.train import checkpoints
from realformer.train import storage
from tests.gcs_server import gcs  # pylint: disable=unused-import


def _state(step):
  return {'step': step, 'params': {'w': jnp.arange(6.0).reshape(2, 3) * step,
                                   'b': jnp.ones((3,), jnp.float32)}}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype),
                      _state(1))


def test_a_step_is_committed_by_its_commit_file_and_restored(gcs):
  run = f'{gcs}/committed'
  manager = checkpoints.make_manager(run, item_names=('state',))
  checkpoints.save(manager, 1, _state(1), force=True)
  manager.wait_until_finished()
  step_dir = storage.path(run) / 'checkpoints' / '1'
  names = sorted(p.name for p in step_dir.iterdir())
  assert checkpoints.COMMIT_FILE in names and 'state' in names
  assert not any('tmp' in p.name for p in (storage.path(run) / 'checkpoints').iterdir())
  assert checkpoints.has_complete_step(run)
  assert checkpoints.latest_complete_step(manager) == 1
  restored, _ = checkpoints.restore(manager, 1, _abstract())
  np.testing.assert_array_equal(restored['params']['w'], _state(1)['params']['w'])
  manager.close()


def test_a_step_cut_short_is_never_restored(gcs):
  run = f'{gcs}/cut'
  manager = checkpoints.make_manager(run, item_names=('state',))
  for step in (1, 2):
    checkpoints.save(manager, step, _state(step), force=True)
    manager.wait_until_finished()
  manager.close()
  # Step 2 as a kill during its write leaves it on object storage: objects, no commit file.
  (storage.path(run) / 'checkpoints' / '2' / checkpoints.COMMIT_FILE).unlink()
  manager = checkpoints.make_manager(run, item_names=('state',))
  assert checkpoints.latest_complete_step(manager) == 1
  assert not (storage.path(run) / 'checkpoints' / '2').exists()  # deleted, not restored
  restored, _ = checkpoints.restore(manager, 1, _abstract())
  np.testing.assert_array_equal(restored['params']['w'], _state(1)['params']['w'])
  manager.close()


def test_params_and_config_round_trip_through_a_bucket(gcs):
  run = f'{gcs}/imported'
  config = ml_collections.ConfigDict({'model': {'hidden_size': 3}})
  step_dir = checkpoints.save_params(run, _state(7)['params'], config, step=7)
  assert step_dir == f'{run}/checkpoints/7'
  assert checkpoints.read_pretraining_config(run)['model'] == {'hidden_size': 3}
  for path in (run, f'{run}/checkpoints', step_dir):
    assert checkpoints.resolve_step_dir(path) == step_dir
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          _state(7)['params'])
  params, missing = checkpoints.restore_params(run, abstract)
  assert missing == []
  np.testing.assert_array_equal(params['w'], _state(7)['params']['w'])
  with pytest.raises(FileNotFoundError, match='nothing_here does not exist; pass a workdir'):
    checkpoints.resolve_step_dir(f'{gcs}/nothing_here')


def test_a_save_of_many_arrays_round_trips(gcs):
  """Orbax's OCDBT store rewrites its manifest under generation preconditions as a save
  grows: a model's worth of arrays (here 120) must survive that against the server."""
  run = f'{gcs}/many'
  tree = {'step': 3, 'params': {f'layer_{i}': {'kernel': jnp.full((8, 8), float(i)),
                                               'bias': jnp.arange(8.0) + i}
                                for i in range(60)}}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype),
                          tree)
  manager = checkpoints.make_manager(run, item_names=('state',))
  checkpoints.save(manager, 3, tree, force=True)
  manager.wait_until_finished()
  restored, _ = checkpoints.restore(manager, 3, abstract)
  for i in (0, 31, 59):
    np.testing.assert_array_equal(restored['params'][f'layer_{i}']['kernel'], float(i))
  manager.close()


def test_the_server_keeps_generation_preconditions(gcs):
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.cloud import storage as gcs_client  # pylint: disable=g-import-not-at-top
  bucket = gcs_client.Client().bucket(gcs[len('gs://'):])
  blob = bucket.blob('preconditions/.lock')
  blob.upload_from_string('first', if_generation_match=0)  # create only if absent
  first = blob.generation
  with pytest.raises(exceptions.PreconditionFailed):
    bucket.blob('preconditions/.lock').upload_from_string('second', if_generation_match=0)
  blob.upload_from_string('refreshed', if_generation_match=first)
  assert blob.generation != first
  with pytest.raises(exceptions.PreconditionFailed):  # a stale holder cannot delete it
    bucket.blob('preconditions/.lock').delete(if_generation_match=first)
  assert bucket.blob('preconditions/.lock').download_as_text() == 'refreshed'
  blob.delete(if_generation_match=blob.generation)
  assert not bucket.blob('preconditions/.lock').exists()
