"""One header line naming the machine a benchmark ran on (realformer/machine.py says why)."""

from realformer.machine import cpu, describe  # pylint: disable=unused-import
