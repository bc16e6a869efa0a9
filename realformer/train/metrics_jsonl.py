"""metrics.jsonl, a run's machine-readable log: its lines, its writer and its readers (no jax,
so that sweeps read it without starting one).

Lines, one JSON object each:

  {"step": int, "split": "train"|"eval", "<metric>": float, ...}   values logged at step
  {"step": s, "split": "start"}                                     a start at step s

A run writes a start line each time it starts: at step 0, or at the step of the checkpoint it
resumes from. What the log held past that step came from a stretch that the run has left (the
steps after its last checkpoint before a kill; a run started over from nothing), so readers
(`records`) forget it: the log reads as the history of the run that the workdir holds.
A line cut short by a hard stop is skipped with a warning.
"""

import json
import os
from typing import Any, Dict, List, Mapping

import numpy as np
from absl import logging

from realformer import storage

START = 'start'


class JsonlWriter:
  """Appends to metrics.jsonl (a local file or a gs:// object: storage.GrowingFile).

  A name "eval/mlm_accuracy" goes to split "eval" as "mlm_accuracy"; names without a prefix
  are "train". Scalars written for the same step are gathered into one line, written when
  another step arrives or at flush(). A local file whose last line was cut short (a hard
  stop in the middle of a write) gets a line break first, so that the new lines stay whole;
  in a bucket only whole lines are uploaded.
  """

  def __init__(self, path: str, start_step: int):
    cut_short = False
    if not storage.is_url(str(path)) and os.path.isfile(path) and os.path.getsize(path):
      with open(path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        cut_short = f.read(1) != b'\n'
    self._file = storage.GrowingFile(path)
    if cut_short:
      self._file.write('\n')
    self._file.write(json.dumps({'step': int(start_step), 'split': START}) + '\n')
    self._step, self._pending = None, {}

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    if step != self._step:
      self.flush()
      self._step = step
    for name, value in scalars.items():
      split, _, key = name.rpartition('/')
      self._pending.setdefault(split or 'train', {})[key] = float(np.asarray(value))

  def flush(self, force: bool = False):
    """Writes the gathered lines; in a bucket they reach the object at most every 30 s, or
    now with `force` (storage.GrowingFile)."""
    for split, values in self._pending.items():
      self._file.write(json.dumps({'step': int(self._step), 'split': split, **values}) + '\n')
    self._pending = {}
    self._file.flush(force)

  def close(self):
    self.flush()
    self._file.close()


def records(path) -> List[Dict[str, Any]]:
  """The log's records in order, as the run that wrote the last start line left them: each
  start line at step s drops the records before it that are past s. One record per step
  and split, where its first line stood: the lines of one merged (a flush between two
  writes of one step makes two; a resume at a step logs it again), a value logged twice
  keeping its last. [] without a log."""
  p = storage.path(path)
  if not p.exists():
    return []
  out = {}  # (step, split) -> record, in the order of their first lines
  for number, line in enumerate(p.read_bytes().decode('utf-8', 'replace').splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError:
      record = None
    if not (isinstance(record, dict) and isinstance(record.get('step'), int) and
            'split' in record):
      logging.warning('%s:%d is not a record (cut short?); skipped', path, number)
    elif record['split'] == START:
      out = {key: r for key, r in out.items() if r['step'] <= record['step']}
    else:
      out.setdefault((record['step'], record['split']), {}).update(record)
  return list(out.values())


def read_jsonl(path, split: str = 'train') -> Dict[int, Dict[str, Any]]:
  """{step: record} of one split (records: the lines of a step merged)."""
  return {r['step']: r for r in records(path) if r['split'] == split}


def logged_at(path, step: int) -> Dict[str, Dict[str, float]]:
  """The values logged at `step`, {split: {name: value}} (records: the lines merged)."""
  return {r['split']: {k: v for k, v in r.items() if k not in ('step', 'split')}
          for r in records(path) if r['step'] == step}
