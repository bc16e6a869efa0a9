"""One header line naming the machine a benchmark ran on (realformer/train/machine.py says why).

Every benchmark imports this before its first device query, so importing it also starts jax
as the programs do: where libtpu is installed and no TPU is attached, on this machine's own
platforms, without libtpu's complaints (realformer/platforms.py)."""

from realformer import platforms
from realformer.train.machine import cpu, describe  # pylint: disable=unused-import

platforms.skip_absent_tpu()
