r"""Fine-tune a pretrained encoder on a GLUE task or SQuAD; evaluate on dev; write predictions.

  python finetune.py --config configs/finetune.py:glue/rte --workdir /tmp/ft_rte \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/glue
  python finetune.py --config configs/finetune.py:squad/v2.0 --workdir /tmp/ft_squad2 \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/squad \
      --config.max_seq_length=128 --config.doc_stride=32  # bert_tiny has 128 positions
      # (BERT-base takes 384 and BERT's doc_stride of 128)

The encoder is restored from the newest checkpoint of `init_checkpoint` (only the encoder:
the pretraining heads and optimizer are not read); a checkpoint whose architecture or
vocabulary does not match its config.json is an error naming the parameter. The run is
resumable: its resume checkpoint (written each epoch) is in <workdir>/checkpoints and running
the same command again continues. Checkpoints are lean: <workdir>/best holds the params of the
best dev epoch, and a finished run keeps only its params in <workdir>/final, without the
optimizer state (config.keep_best, config.keep_optimizer_state); both are params-only
checkpoints with the pretraining config.json, usable as another run's init_checkpoint.
Batches are padded to a few length buckets chosen from the data, not to max_seq_length
(data/buckets.py; config.length_buckets=0 turns it off). Outputs: metrics.jsonl (train loss,
throughput, dev metrics per epoch), results.json (the final and the best dev metrics) and
predictions/<Task>.tsv (GLUE submission format, from the final params; SQuAD:
predictions/predictions.json of dev, plus null_odds.json and predictions_raw.json for v2.0).
The program is flags -> the task of the config's kind (realformer/finetune/tasks/<kind>.py)
-> the trainer that pretraining uses too (realformer/train/trainer.py). The grid of the
paper's practice: `python -m realformer.tools.finetune_grid` (see its docstring). A mistake
is one line, `error: ...` naming the fix (docs/errors.md); --verbose_errors adds its traceback.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging

from realformer import cli
from realformer.finetune import registry
from realformer.train import trainer

_REPO = os.path.dirname(os.path.abspath(__file__))


def finetune(config, workdir: str, *, devices=None) -> dict:
  """Fine-tunes, evaluates and predicts; returns {'task', 'step', 'dev', 'headline',
  'headline_metric', 'best'} (and 'test' where the task scores a test set: NER's), or
  {'task', 'step', 'preempted'} when a stop signal ended the run early.
  devices: the devices of the mesh (default: all of jax.devices())."""
  task, summary = trainer.train(workdir, registry.get(config.benchmark), config, devices)
  if 'preempted' in summary:
    return {'task': task.name, 'step': summary['step'], 'preempted': summary['preempted']}
  return {k: summary[k] for k in ('task', 'step', 'dev', 'test', 'headline', 'headline_metric',
                                   'best')
          if k in summary}


def main(argv):
  cli.refuse_arguments(argv)
  try:
    cli.check_program(flags.FLAGS.config, 'finetune.py')
  except ValueError as e:
    cli.fail(str(e))
  if not flags.FLAGS.workdir:
    cli.fail('--workdir is required: the directory for checkpoints, metrics and predictions '
             '(e.g. --workdir /tmp/ft_sst2)')
  logging.get_absl_handler().addFilter(cli.QuietLibraries())
  summary = trainer.run_program(finetune, flags.FLAGS.config, flags.FLAGS.workdir)
  print(json.dumps(summary, indent=2))


def define_flags():
  """Flags exist only when this file runs as a program (tests import it beside train.py)."""
  trainer.define_flags(os.path.join(_REPO, 'configs', 'finetune.py') + ':glue/sst2',
                       'Config file and its argument, configs/finetune.py:<kind>/<task> '
                       '(glue/<task>, squad/v1.1, squad/v2.0, ner/conll2003, tsv/<name>, or a '
                       'kind of realformer/finetune/tasks/); any field is overridden by '
                       '--config.<key>=<value>, e.g. --config.init_checkpoint=/tmp/bert_tiny',
                       'Directory for checkpoints, metrics and predictions.')
  flags.adopt_module_key_flags(trainer)  # --help lists them


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
