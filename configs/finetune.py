r"""Fine-tuning a pretrained encoder on GLUE.

  python finetune.py --config configs/finetune.py:glue/sst2 --workdir /tmp/ft_sst2 \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/glue
  python finetune.py --config configs/finetune.py:glue/mnli --workdir /tmp/ft_mnli \
      --config.init_checkpoint=/tmp/rf_base --config.optimizer.learning_rate=3e-5

`init_checkpoint` is a pretraining workdir (train.py's, or one written by
`python -m realformer.interop import-hf`): the encoder is restored from its newest checkpoint,
the architecture and tokenizer come from its config.json; `from_scratch=True` trains the same
architecture from random initialisation (the baseline). `data_dir` holds the official GLUE
TSV folders (CoLA/, SST-2/, MRPC/, STS-B/, QQP/, MNLI/, QNLI/, RTE/, WNLI/, diagnostic/);
empty means tfds `glue/<task>`. Tasks: cola, sst2, mrpc, stsb, qqp, mnli (also evaluates
mismatched and predicts AX), qnli, rte, wnli. Defaults follow BERT: lr 2e-5, batch 32,
3 epochs, 10% warm-up. Unknown keys are errors (the config is locked).
"""

import ml_collections


def get_config(arg: str = 'glue/sst2'):
  benchmark, _, task = (arg or 'glue/sst2').partition('/')
  if benchmark != 'glue' or not task:
    raise ValueError(f'config arg {arg!r}: use glue/<task>, e.g. glue/sst2')
  c = ml_collections.ConfigDict()
  c.task = task
  c.init_checkpoint = ''
  c.from_scratch = False
  c.data_dir = ''
  c.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  c.max_seq_length = 128
  c.batch_size = 32
  c.eval_batch_size = 64
  c.num_epochs = 3
  c.seed = 0
  c.log_every_steps = 50
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 2e-5
  c.optimizer.schedule = 'linear'
  c.optimizer.warmup_fraction = 0.1
  c.optimizer.warmup_steps = -1  # set from warmup_fraction when negative
  c.optimizer.weight_decay = 0.01
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-6
  c.optimizer.clip_norm = 1.0
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.lock()
  return c
