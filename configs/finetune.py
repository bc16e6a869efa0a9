r"""Fine-tuning a pretrained encoder: `<kind>/<name>`, where the kind is a module of
realformer/finetune/tasks/ (glue, squad, ner, tsv, or one of your own) that adds its own fields
to the common ones below.

  python finetune.py --config configs/finetune.py:glue/sst2 --workdir /tmp/ft_sst2 \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/glue
  python finetune.py --config configs/finetune.py:glue/mnli --workdir /tmp/ft_mnli \
      --config.init_checkpoint=/tmp/rf_base --config.optimizer.learning_rate=3e-5

`init_checkpoint` is a pretraining workdir (train.py's, or one written by
`python -m realformer.tools.interop import-hf`): the encoder is restored from its newest checkpoint,
the architecture and tokenizer come from its config.json; `from_scratch=True` trains the same
architecture from random initialisation (the baseline). `data_dir` holds the official GLUE
TSV folders (CoLA/, SST-2/, MRPC/, STS-B/, QQP/, MNLI/, QNLI/, RTE/, WNLI/, diagnostic/);
empty means tfds `glue/<task>`. Tasks: cola, sst2, mrpc, stsb, qqp, mnli (also evaluates
mismatched and predicts AX), qnli, rte, wnli. Defaults follow BERT's settings (lr 2e-5,
batch 32, 3 epochs, 10% warm-up) with transformers' optimizer (bias-corrected AdamW, linear
decay); BERT's own is --config.optimizer.name=bert_adamw --config.optimizer.schedule=bert.
Unknown keys are errors (the config is locked).

  python finetune.py --config configs/finetune.py:squad/v1.1 --workdir /tmp/ft_squad \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/squad \
      --config.max_seq_length=128 --config.doc_stride=32  # bert_tiny has 128 positions
      # (BERT-base takes 384 and BERT's doc_stride of 128)

A task of your own (`tsv/<name>`): data_dir holds train.tsv and dev.tsv (test.tsv optional,
predicted into predictions/<name>.tsv), each with a header row; config.tsv names the text
columns, the label column, the labels and the headline metric:

  python finetune.py --config configs/finetune.py:tsv/topics --workdir /tmp/ft_topics \
      --config.init_checkpoint=/tmp/bert_tiny --config.data_dir=/data/topics \
      --config.tsv.labels=world,sports,science --config.tsv.metric=macro_f1

SQuAD (`squad/v1.1`, `squad/v2.0`): data_dir holds train-v1.1.json and dev-v1.1.json (or the
v2.0 files), empty means tfds `squad/<version>`. lr 3e-5 and 2 epochs as in BERT's README
for run_squad (which used batch 12 for base on a 12 GB GPU, 24 for large; the paper: lr 5e-5,
batch 32, 3 epochs for v1.1), batch 32; run_squad's max_seq_length 384, doc_stride 128,
max_query_length 64, n_best_size 20, max_answer_length 30 (its own fields). For v2.0 the null-score threshold is tuned on dev
(best F1) unless null_score_diff_threshold is set; exact and f1 score the predictions
written with it, best_exact and best_f1 the official script's sweep.

Named-entity recognition (`ner/conll2003`, or `ner/<name>` with tags of your own in
config.ner.labels, BIO, in id order): data_dir holds train.txt, dev.txt and optionally
test.txt (or the original eng.train, eng.testa, eng.testb) in CoNLL-2003's format
(realformer/finetune/tasks/ner.py); lr 5e-5 as transformers' run_ner; sentences alone, or
with their document's around them (config.ner.document_context=True, as the BERT paper:
every sequence about max_seq_length long, several times the compute).
"""

import ml_collections

from configs import pretrain
from realformer.finetune import registry


def get_config(arg: str = 'glue/sst2'):
  """`<kind>/<name>`: the fields every fine-tuning run has (below), then the kind's own
  (its FinetuneTask's `configure`, realformer/finetune/tasks/<kind>.py)."""
  kind, _, name = (arg or 'glue/sst2').partition('/')
  if not kind or not name:
    raise ValueError(f'config arg {arg!r}: use <kind>/<task>: glue/<task> (e.g. glue/sst2), '
                     'squad/v1.1, squad/v2.0, ner/conll2003 (ner/<name> for tags of your own), '
                     'or tsv/<name> for a task of your own')
  task = registry.get(kind)
  c = ml_collections.ConfigDict()
  c.benchmark = kind
  c.task = name
  # A pretraining workdir (train.py or realformer.tools.interop); with from_scratch=True also a
  # pretraining config file such as configs/pretrain.py:postln,tiny (architecture only).
  c.init_checkpoint = ''
  c.from_scratch = False
  c.tokenizer = ''  # with a config file: the sentencepiece model ('' = that config's)
  c.data_dir = ''
  c.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  c.max_seq_length = 128
  # Length buckets: batches padded to at most `length_buckets` compiled lengths (multiples of
  # bucket_multiple, chosen from the data to pad least) instead of max_seq_length; 0 = off.
  c.length_buckets = 5
  # A batch's examples from one bucket (True: least padding), or drawn at random as
  # transformers' Trainer draws them, each batch padded to the shortest length that holds its
  # longest (False; the lengths then chosen from the batches' longest examples).
  c.group_by_length = True
  c.bucket_multiple = 8
  # How many of them: as many as pay for their compilation over the run (finetune/task.py:
  # compile_cost_in_tokens): a length costs about bucket_compile_seconds to compile, a padded
  # token its training FLOPs at bucket_flops_per_second (the run's, all devices: 0 = 40% of
  # the devices' peak, or 1e11 where the peak is unknown, as on a CPU). Lower
  # bucket_compile_seconds when the compilation cache holds the programs.
  c.bucket_compile_seconds = 8.0
  c.bucket_flops_per_second = 0.0
  # Compile the lengths in a background thread while training runs (the first step waits for
  # its own length only); False compiles every length before the first step. One process
  # only: several compile every length before the first step, in one order (a GPU compile
  # shares its autotuning across processes, which a length that one process had cancelled
  # and another compiled would wait on).
  c.compile_in_background = True
  c.batch_size = 32
  c.eval_batch_size = 64
  c.num_epochs = 3
  # Checkpoints: the latest resume state while training; <workdir>/best holds the params of
  # the best dev epoch; when the run finishes, its params go to <workdir>/final and the
  # optimizer state (twice the params) is dropped unless keep_optimizer_state.
  c.keep_best = True
  c.keep_optimizer_state = False
  c.seed = 0
  c.log_every_steps = 50
  c.optimizer = pretrain.optimizer_config(learning_rate=2e-5,
                                          warmup_steps=-1)  # -1: from warmup_fraction (0.1)
  c.mesh = pretrain.mesh_config()
  # How the pretrained encoder computes in this run ('' or None: as it was pretrained; the
  # meanings of configs/pretrain.py's model fields). What the encoder is (sizes, variant,
  # positions) comes from the checkpoint's config.json and cannot change here.
  c.model = ml_collections.ConfigDict()
  c.model.dtype = ''  # float32 | bfloat16 | float16 (e.g. an import of float32 weights)
  c.model.residual_dtype = ''  # RealFormer's carried scores
  c.model.remat_policy = ''
  c.model.fused_attention = ''
  c.model.dense_impl = ''
  c.model.dropout_rate = ml_collections.FieldReference(None, field_type=float)
  c.model.attention_dropout_rate = ml_collections.FieldReference(None, field_type=float)
  # The layers scanned (one layer's program: faster compiles, more memory) or unrolled,
  # whichever way the checkpoint stored them (its parameters are laid out on restore).
  c.model.scan_layers = ml_collections.FieldReference(None, field_type=bool)
  task.configure(c, name)
  c.lock()
  return c
