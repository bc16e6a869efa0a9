"""One header line naming the machine a benchmark ran on (realformer/train/machine.py says why)."""

from realformer.train.machine import cpu, describe  # pylint: disable=unused-import
