"""A sentence (pair) classification or regression of the user's own in GLUE's shape,
`configs/finetune.py:tsv/<name>`: GLUE's head, loss and submission files over
data_dir/{train,dev[,test]}.tsv, each with a header row.

Its own fields, config.tsv: text (its one or two text columns, comma-separated), label (the
label column), labels (the label values in id order, comma-separated; '' = a regression on a
number), metric (the headline: accuracy, mcc, f1 of two labels, the second positive;
macro_f1; pearson, spearman); and GLUE's skip_malformed_rows.
"""

import ml_collections

from data import glue
from realformer.finetune.registry import register
from realformer.finetune.tasks.glue import GlueTask


def tsv_task(config) -> glue.Task:
  """The task of a tsv/<name> config (config.tsv), checked."""
  if not config.data_dir or config.data_dir.startswith('hf:'):
    raise ValueError(f'tsv/{config.task}: set config.data_dir to the folder of its train.tsv '
                     'and dev.tsv (test.tsv optional)')
  t = config.tsv
  return glue.local_task(config.task, [x.strip() for x in t.text.split(',')], t.label.strip(),
                         [x.strip() for x in t.labels.split(',') if x.strip()], t.metric)


@register('tsv')
class TsvTask(GlueTask):
  """GlueTask over the user's own TSV files (data/glue.local_task); named by config.task."""

  @classmethod
  def configure(cls, config: ml_collections.ConfigDict, name: str) -> None:
    super().configure(config, name)
    config.tsv = ml_collections.ConfigDict({'text': 'sentence', 'label': 'label',
                                            'labels': '0,1', 'metric': 'accuracy'})

  @classmethod
  def names(cls):
    return ()  # any name

  @classmethod
  def checked_config(cls, config, mesh):
    config = super().checked_config(config, mesh)  # first: it refuses a config without tsv's
    tsv_task(config)
    return config

  def glue_task(self) -> glue.Task:
    return tsv_task(self.config)

  def _spec(self, name: str):
    return self.task if name == self.name else name

  def _load(self, task: str, split: str):
    return glue.read_tsv(self._spec(task), self.config.data_dir, split,
                         skip_malformed=self.config.skip_malformed_rows and split == 'train')
