r"""The config a run was started with, for train.py or finetune.py: `configs/run.py:<workdir>`
(or the path of its config.json; a gs:// URL too). --config.<key> overrides any field, as with
the other config files:

  python train.py --config configs/run.py:/tmp/rf_base --workdir /tmp/rf_base   # resume it
  python train.py --config configs/run.py:/tmp/rf_base --workdir /tmp/rf_base \
      --config.train.num_steps=200000                                           # extend it
  python finetune.py --config configs/run.py:/tmp/ft_rte --workdir /tmp/ft_rte_2 \
      --config.seed=2                                                           # again, seed 2

The program's own config file makes the fields (configs/pretrain.py:<variant>,base or
configs/finetune.py:<kind>/<task>), then each takes the value in the run's config.json; a
field added since the run began takes the value such runs computed
(realformer/train/workdir.py ADDED_DEFAULTS).
"""

from realformer.train import workdir


def get_config(arg: str = ''):
  if not arg:
    raise ValueError('configs/run.py needs the run: configs/run.py:<workdir> (or the path of '
                     'its config.json)')
  return workdir.stored_config(arg)
