"""BERT-style encoders (Post-LN, Pre-LN, RealFormer, Synthesizer) in JAX/Flax.

Imported where libtpu is installed (requirements-tpu.txt) and no TPU is attached, the package
limits jax to this machine's platforms before anything asks jax for its devices
(realformer.platforms.skip_absent_tpu), so that a script or notebook of one's own starts as
quietly as train.py does, without libtpu's complaints about a TPU that is not there.
"""

import importlib.util as _importlib_util
import multiprocessing as _multiprocessing

# (Not in a worker process of ours, such as data preparation's: it imports no jax, and its
# parent chose the platforms, which JAX_PLATFORMS hands down.)
if (_importlib_util.find_spec('libtpu') is not None
    and _multiprocessing.parent_process() is None):
  from realformer import platforms as _platforms
  _platforms.skip_absent_tpu(say=False)
