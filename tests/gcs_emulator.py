"""gcp-storage-emulator with object generations: the tests' Cloud Storage server.

  python tests/gcs_emulator.py --port 9023 --bucket realformer-test

The emulator (in memory) gives every object a generation in its JSON resource but neither
sends it as the x-goog-generation header of a download nor honours the generation
preconditions of a request. tensorstore (Orbax's array store) relies on both for its
read-modify-write of an OCDBT manifest, and a lock object needs create-if-absent. This wraps
the emulator's handlers, without changing its storage, so that:

  downloads carry x-goog-generation and x-goog-metageneration;
  ifGenerationMatch (0: the object must not exist) and ifGenerationNotMatch on downloads,
  metadata reads, uploads, composes (of the destination) and deletes answer 412 Precondition Failed (a download or read
  whose generation matches ifGenerationNotMatch: 304 Not Modified), as Cloud Storage does.
"""

import argparse
import functools
import logging
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _current_generation(storage, bucket: str, name: str) -> str:
  try:
    return str(storage.get_file_obj(bucket, name)['generation'])
  except NotFound:
    return '0'


def _object_name(request):
  """The object a request names (in the path, the query or a multipart upload's metadata)."""
  if request.params.get('object_id'):
    return request.params['object_id']
  if 'name' in request.query:
    return request.query['name'][0]
  data = request.data
  if isinstance(data, dict):
    meta = data.get('meta') if isinstance(data.get('meta'), dict) else data
    return meta.get('name')
  return None


def _refused(request, response, storage, reading: bool) -> bool:
  """Answers a failed precondition (True) or lets the request through (False)."""
  match = request.query.get('ifGenerationMatch', [None])[0]
  not_match = request.query.get('ifGenerationNotMatch', [None])[0]
  if match is None and not_match is None:
    return False
  name = _object_name(request)
  if name is None:
    return False
  current = _current_generation(storage, request.params['bucket_name'], name)
  if match is not None and match != current:
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({'error': {'code': 412, 'message': 'Precondition Failed'}})
    return True
  if not_match is not None and not_match == current:
    response.status = HTTPStatus.NOT_MODIFIED if reading else HTTPStatus.PRECONDITION_FAILED
    return True
  return False


def _with_generations(handler, reading: bool, headers: bool):
  @functools.wraps(handler)
  def wrapped(request, response, storage, *args, **kwargs):
    if _refused(request, response, storage, reading):
      return None
    result = handler(request, response, storage, *args, **kwargs)
    if headers and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
      obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
      response['x-goog-generation'] = str(obj['generation'])
      response['x-goog-metageneration'] = str(obj.get('metageneration', '1'))
    return result
  return wrapped


_WRAPPED = {
    objects.download: dict(reading=True, headers=True),
    objects.get: dict(reading=True, headers=False),
    objects.insert: dict(reading=False, headers=False),
    objects.delete: dict(reading=False, headers=False),
    objects.compose: dict(reading=False, headers=False),
}


def patch_handlers() -> None:
  """Wraps the emulator's object handlers in place (its routing tables hold the functions)."""
  for _, methods in server.HANDLERS:
    for method, handler in list(methods.items()):
      if handler in _WRAPPED:
        methods[method] = _with_generations(handler, **_WRAPPED[handler])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--host', default='127.0.0.1')
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--bucket', required=True)
  parser.add_argument('--data_dir', default='',
                      help='keep the objects in this folder (a restarted server finds them); '
                           'default: in memory')
  args = parser.parse_args()
  logging.disable(logging.WARNING)
  patch_handlers()
  server.create_server(args.host, args.port, in_memory=not args.data_dir,
                       default_bucket=args.bucket, data_dir=args.data_dir or None).run()


if __name__ == '__main__':
  main()
