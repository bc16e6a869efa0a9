"""Training and evaluation metrics (clu), performance numbers, and the metrics.jsonl writer.

Every metric is a clu `Average` built from exact sums, so merging microbatches, steps or
eval batches gives the token- or example-weighted mean, never a mean of means; train's
`loss` and `grad_norm` alone are a mean over the logged steps (so a window's train loss is
not quite its mlm_loss + nsp_loss, which weigh the steps by their tokens and examples):

  mlm_loss       sum_i w_i CE_i / sum_i w_i          (w = masked_lm_weights, per masked slot)
  mlm_accuracy   sum_i w_i [argmax_i = label_i] / sum_i w_i
  nsp_loss       mean over examples of the NSP cross-entropy      (MLM + NSP only)
  nsp_accuracy   mean over examples of [argmax = label]           (MLM + NSP only)
  loss           train: mlm_loss + nsp_loss of each step, averaged over the logged steps;
                 eval: mlm_loss + nsp_loss of the whole evaluation (each part weighted by
                 its own counts across the batches); mlm_loss alone without NSP
  grad_norm      global L2 norm of the gradient before clipping, averaged over logged steps
  learning_rate  the rate the last logged step's update used: at step s, schedule(s - 1)
                 (update s counts from 0, as optax and BERT count; the last step's is not
                 the schedule's final 0)

`clu.metrics.Std` does not work with the pinned jax (it calls jnp.clip(a_min=...)); it is
not used here.
"""

import dataclasses
import os
import socket
import time
from typing import Any, Dict, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics

from realformer import storage
from realformer.train import distributed
from realformer.train import metrics_jsonl


def average(total, count) -> metrics.Average:
  """An Average from a sum and its weight (both summed again when merged)."""
  return metrics.Average(total=jnp.asarray(total, jnp.float32),
                         count=jnp.asarray(count, jnp.float32))


def last_value(value) -> metrics.LastValue:
  return metrics.LastValue(total=jnp.asarray(value, jnp.float32),
                           count=jnp.asarray(1, jnp.int32))


@flax.struct.dataclass
class PretrainingEvalMetrics(metrics.Collection):
  """The evaluation's sums; `loss` is derived from them (a mean of the batches' losses would
  weight a batch's masked tokens by how few it holds)."""
  mlm_loss: metrics.Average
  nsp_loss: metrics.Average
  mlm_accuracy: metrics.Average
  nsp_accuracy: metrics.Average

  def compute(self) -> Dict[str, jax.Array]:
    values = super().compute()
    return {'loss': values['mlm_loss'] + values['nsp_loss'], **values}


@flax.struct.dataclass
class PretrainingTrainMetrics(metrics.Collection):
  # Listed in full: clu's Collection.empty() reads only the class's own annotations.
  loss: metrics.Average
  mlm_loss: metrics.Average
  nsp_loss: metrics.Average
  mlm_accuracy: metrics.Average
  nsp_accuracy: metrics.Average
  learning_rate: metrics.LastValue
  grad_norm: metrics.Average


@flax.struct.dataclass
class MlmEvalMetrics(metrics.Collection):
  """PretrainingEvalMetrics of MLM alone (config.objective=mlm)."""
  mlm_loss: metrics.Average
  mlm_accuracy: metrics.Average

  def compute(self) -> Dict[str, jax.Array]:
    values = super().compute()
    return {'loss': values['mlm_loss'], **values}


@flax.struct.dataclass
class MlmTrainMetrics(metrics.Collection):
  loss: metrics.Average
  mlm_loss: metrics.Average
  mlm_accuracy: metrics.Average
  learning_rate: metrics.LastValue
  grad_norm: metrics.Average


def pretraining_metrics(next_sentence: bool):
  """(train, eval) Collection classes of pretraining, with NSP's or without."""
  return ((PretrainingTrainMetrics, PretrainingEvalMetrics) if next_sentence else
          (MlmTrainMetrics, MlmEvalMetrics))


def collection(cls, **values: metrics.Metric) -> metrics.Collection:
  """An instance of the Collection class `cls` holding `values` (one per field); a value
  of no field of `cls` (a metric added to the loss or the step but not to every class that
  logs it) is a one-line error naming the class and the fix."""
  fields = {f.name for f in dataclasses.fields(cls)}
  extra = sorted(set(values) - fields)
  if extra:
    raise ValueError(f'{cls.__name__} ({cls.__module__}) has no field for the metric '
                     f'{extra[0]!r}; add `{extra[0]}: clu.metrics.Average` (or the '
                     'metric it is) to it and to every class that logs it (docs/design.md, '
                     '"Adding a metric")')
  return cls.empty().replace(**values)


def merge(a: Optional[metrics.Collection], b: metrics.Collection) -> metrics.Collection:
  """Merge b into a (a may be None: the start of a logging window)."""
  return b if a is None else a.merge(b)


def to_floats(collection: metrics.Collection) -> dict:
  """Collection -> {name: python float} (on the host)."""
  return {k: float(np.asarray(v)) for k, v in collection.compute().items()}


# Peak dense bfloat16 FLOP/s per device (vendor figures, without sparsity). Matched by
# substring of jax.Device.device_kind, most specific first.
PEAK_FLOPS_PER_DEVICE = (
    ('TPU v5 lite', 197e12),
    ('TPU v5e', 197e12),
    ('TPU v5p', 459e12),
    ('TPU v5', 459e12),
    ('TPU v6 lite', 918e12),
    ('TPU v6e', 918e12),
    ('TPU v4', 275e12),
    ('H200 NVL', 835e12),
    ('H200', 989e12),
    ('H100 PCIe', 756e12),
    ('H100 NVL', 835e12),
    ('H100', 989e12),  # SXM ('NVIDIA H100 80GB HBM3')
    ('A100', 312e12),
)


def peak_flops_per_device(device: jax.Device, override: Optional[float] = None
                          ) -> Optional[float]:
  """Peak FLOP/s of one device: `override` if given, else the table, else None (no MFU)."""
  if override:
    return float(override)
  kind = getattr(device, 'device_kind', '')
  for name, flops in PEAK_FLOPS_PER_DEVICE:
    if name.lower() in kind.lower():
      return flops
  return None


class TensorBoardWriter:
  """Scalars as TensorBoard events: one events.out.tfevents.* file per start in `logdir` (a
  folder or a gs:// URL: storage.GrowingFile), written with tensorboard's record format
  (TFRecord framing, masked CRC32C) by plain file writes, so no TensorFlow is imported
  (tensorboard's own event writer goes through tf.io.gfile, which loads TensorFlow wherever
  it is installed). A start at step s writes SessionLog.START at s + 1: TensorBoard's Python
  loader (--load_fast=false) then drops the events past s that earlier files hold (the
  stretch a resume left, as metrics_jsonl.records does)."""

  def __init__(self, logdir: str, start_step: int):
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboard.summary.writer import record_writer  # pylint: disable=g-import-not-at-top
    name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}'
    self._file = storage.GrowingFile(storage.path(logdir) / name, binary=True)
    self._writer = record_writer.RecordWriter(self._file)
    self._write(file_version='brain.Event:2')
    self._write(step=int(start_step) + 1,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))

  def _write(self, **event):
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    self._writer.write(event_pb2.Event(wall_time=time.time(), **event).SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    values = [summary_pb2.Summary.Value(tag=name, simple_value=float(np.asarray(value)))
              for name, value in scalars.items()]
    self._write(step=int(step), summary=summary_pb2.Summary(value=values))

  def flush(self, force: bool = False):
    self._writer.flush()
    self._file.flush(force)

  def close(self):
    self._file.close()


class MultiWriter:
  """Every write, flush and close goes to each of `writers`."""

  def __init__(self, writers):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    for writer in self.writers:
      writer.write_scalars(step, scalars)

  def flush(self, force: bool = False):
    """force: also make what was written durable where the writers keep it (a bucket's
    objects; the trainer forces a flush with each checkpoint)."""
    for writer in self.writers:
      writer.flush(force)

  def close(self):
    """Closes every writer, then raises the first error, if any (a TensorBoard upload that
    fails does not keep metrics.jsonl's last lines from theirs)."""
    error = None
    for writer in self.writers:
      try:
        writer.close()
      except Exception as e:  # pylint: disable=broad-except
        error = error or e
    if error is not None:
      raise error


class RunWriter:
  """A run's writer as every process holds it: process 0's MultiWriter writes, the others'
  writes nothing. With several processes each call is a collective that every process makes
  at the same point (the trainer's log, evaluation and checkpoint steps), and a write that
  fails on process 0 (a bucket that stopped answering, a full disk) raises on every
  process (distributed.on_process_zero): the others would otherwise run on into the next
  step and wait there for a process that has stopped."""

  def __init__(self, writer: MultiWriter, what: str):
    self._writer, self._what = writer, what

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    distributed.on_process_zero(lambda: self._writer.write_scalars(step, scalars), self._what)

  def flush(self, force: bool = False):
    distributed.on_process_zero(lambda: self._writer.flush(force), self._what)

  def close(self):
    distributed.on_process_zero(self._writer.close, self._what)

  def close_alone(self):
    """This process's writers closed, no collective: for an error handler, where the other
    processes may not come."""
    self._writer.close()


def create_writer(logdir: str, jsonl_path, start_step: int) -> RunWriter:
  """TensorBoard events (in `logdir`) and the JSON lines (to `jsonl_path`) from process 0,
  each marking the start at `start_step`; nothing from the others (a collective, as every
  call of the RunWriter). (The log is the trainer's: one line per logged step or
  evaluation, on every process.)"""
  opened = []
  distributed.on_process_zero(
      lambda: opened.append(MultiWriter([TensorBoardWriter(logdir, start_step),
                                         metrics_jsonl.JsonlWriter(jsonl_path, start_step)])),
      f'open the logs of {logdir}')
  return RunWriter(opened[0] if opened else MultiWriter([]), f'write the logs of {logdir}')


def format_scalars(scalars: Mapping[str, Any]) -> str:
  """'name=value, ...' at six significant digits: the log's form of a step's scalars."""
  return ', '.join(f'{name}={float(np.asarray(value)):.6g}' for name, value in scalars.items())
