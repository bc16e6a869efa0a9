"""Where a run's files live: a local folder, or a Cloud Storage URL (gs://bucket/path).

Paths go through etils.epath. For gs:// it uses gcsfs, not TensorFlow's tf.io.gfile (which
epath would pick whenever TensorFlow is installed: that would import TensorFlow into every run
and ignore STORAGE_EMULATOR_HOST, so nothing could test it): EPATH_USE_TF defaults to false
here, before any gs:// path is touched. Orbax writes checkpoints to gs:// natively (its
commit-file protocol, no renames) and reads the same environment: see docs/launching.md.
"""

import os

from etils import epath

os.environ.setdefault('EPATH_USE_TF', 'false')


def is_url(path) -> bool:
  return '://' in os.fspath(path)


def path(p) -> epath.Path:
  """A local path made absolute (~ expanded), or a URL as given."""
  p = os.fspath(p)
  return epath.Path(p if is_url(p) else os.path.abspath(os.path.expanduser(p)))
