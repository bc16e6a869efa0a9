r"""Pretrain a BERT-style encoder with masked language modelling + next sentence prediction.

  python train.py --workdir /tmp/bert_tiny       # postln,tiny on the embedded corpus (CPU)
  python train.py --config configs/pretrain.py:realformer,base --workdir DIR \
      --config.mesh.fsdp=8 --config.model.dtype=bfloat16

Everything comes from the config (configs/pretrain.py; unknown keys are errors): mesh
(data x fsdp x tensor), batch, accumulation, optimizer, checkpoints. The program is
flags -> PretrainingTask (realformer/train/pretraining.py) -> Trainer
(realformer/train/trainer.py, which states the restart order: running the same command
again continues the run in DIR). The files of DIR are listed in realformer/train/run_dir.py.
docs/launching.md shows TPU pod
and GPU cluster launches. `config.data.sources=synthetic` trains on random tokens of the
same format (throughput checks only). A mistake is one line, `error: ...` naming the fix
(docs/errors.md); --verbose_errors adds its traceback.
"""

import os
import sys

import ml_collections
from absl import app
from absl import flags
from absl import logging

from configs import pretrain as pretrain_configs
from realformer import cli
from realformer.train import compile_cache
from realformer.train import distributed
from realformer.train import metrics as metrics_lib
from realformer.train import pretraining
from realformer.train import trainer

_REPO = os.path.dirname(os.path.abspath(__file__))
trainer.define_flags(os.path.join(_REPO, 'configs', 'pretrain.py') + ':postln,tiny',
                     'Config file and its argument, configs/pretrain.py:<variant>,<size> '
                     f'(variants: {", ".join(pretrain_configs.VARIANTS)}; sizes: '
                     f'{", ".join(pretrain_configs.SIZES)}); any field is overridden by '
                     '--config.<key>=<value>, e.g. --config.train.num_steps=1000',
                     'Directory for checkpoints, logs and config.json.')
flags.adopt_module_key_flags(trainer)  # --help lists them
flags.DEFINE_string('compile_for', None,
                    'Compile the train step ahead of time instead of training, and print '
                    'memory per chip, FLOPs and collectives (realformer/tools/launch.py): a TPU '
                    'slice such as v5p:4x4x4 or v5e:2x2, or slices joined by the data-center '
                    'network such as 2xv5e:16x16 (needs requirements-tpu.txt; any host), NVIDIA GPUs such as h100, h200:8 or a100:2x8 (needs jax\'s CUDA '
                    'plugin; any host, no GPU), or "local" (this machine\'s devices; then '
                    'times a few steps).')
flags.DEFINE_bool('find_max_batch', False,
                  'With --compile_for: also search the largest global batch that fits.')
flags.DEFINE_integer('max_compiles', 12,
                     'With --find_max_batch: compiles the search may spend (each one is a '
                     'compile of the step: minutes for a large model).')
flags.DEFINE_integer('batch_multiple', 1,
                     'With --find_max_batch: search only multiples of this global batch.')
flags.DEFINE_integer('measure_steps', 5,
                     'With --compile_for=local: steps to time after compiling (0: none).')
flags.DEFINE_string('launch_json', '', 'With --compile_for: also write the facts as JSON here.')


# --------------------------------------------------------------------------------------
# The run: config -> pretraining task -> trainer.
# --------------------------------------------------------------------------------------

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       devices=None) -> dict:
  """Pretrain per `config` in `workdir` (resuming if it holds a checkpoint).

  devices: the devices of the mesh (default: all of jax.devices()).
  Returns the trainer's summary, with 'eval' the last held-out metrics.
  Raises trainer.NonFiniteLossError when the loss becomes nan/inf (nothing bad is saved).
  """
  _, summary = trainer.train(workdir, pretraining.PretrainingTask, config, devices)
  summary['eval'] = summary['eval'].get('eval', {})
  return summary


# --------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------

def check_launch():
  """--compile_for: compile the step for a TPU slice or the local devices and report."""
  from realformer.tools import launch

  launch.ensure_unlimited_stack(sys.argv)  # XLA:TPU's compiler may need more than 8 MiB
  cli.stop_at_once_on_ctrl_c()  # (before its report it writes only compilation-cache entries,
  # each whole or not at all)

  local = flags.FLAGS.compile_for.lower() == 'local'
  if flags.FLAGS['measure_steps'].present and not local:
    cli.fail(f'--measure_steps is not read with --compile_for={flags.FLAGS.compile_for}: the '
             'step is compiled for it, not run; --compile_for local measures steps here')
  # (--workdir is allowed and unread: the run's own command line with --compile_for local
  # appended warms the compilation cache for it)

  def compile_and_report():
    if not local:
      compile_cache.disable()  # a compile-only target has no client to load programs into
      launch.target_for(flags.FLAGS.compile_for)  # errors and the CPU host, before jax starts
    else:  # every host of a multi-host TPU VM or SLURM job, as train.py would see them
      distributed.initialize_from_flags()
      compile_cache.enable_from_flags()
    return launch.run(pretraining.resolved_config(flags.FLAGS.config), flags.FLAGS.compile_for,
                      max_batch=flags.FLAGS.find_max_batch,
                      measure_steps=flags.FLAGS.measure_steps,
                      json_path=flags.FLAGS.launch_json, max_compiles=flags.FLAGS.max_compiles,
                      batch_multiple=flags.FLAGS.batch_multiple)
  sys.exit(launch.exit_status(cli.run_main(compile_and_report, also=(OSError,))))


def main(argv):
  logging.get_absl_handler().addFilter(cli.QuietLibraries())
  cli.refuse_arguments(argv)
  try:
    cli.check_program(flags.FLAGS.config, 'train.py')
  except ValueError as e:
    cli.fail(str(e))
  if flags.FLAGS.compile_for:
    check_launch()
    return
  for name in ('find_max_batch', 'measure_steps', 'launch_json', 'max_compiles',
               'batch_multiple'):
    if flags.FLAGS[name].present:
      cli.fail(f'--{name} needs --compile_for (a TPU slice such as v5e:2x2, or '
                           f'local); without it train.py trains')
  if not flags.FLAGS.workdir:
    cli.fail('--workdir is required: the directory for checkpoints and logs '
                         '(e.g. --workdir /tmp/bert_tiny)')
  summary = trainer.run_program(train_and_evaluate, flags.FLAGS.config, flags.FLAGS.workdir)
  held_out = summary['eval']
  logging.info('done at step %d%s; the run (checkpoints, metrics.jsonl, TensorBoard\'s '
               'events) is in %s', summary['step'],
               f'; eval: {metrics_lib.format_scalars(held_out)}' if held_out else '',
               flags.FLAGS.workdir)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
