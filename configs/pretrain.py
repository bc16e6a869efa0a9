r"""Pretraining: BERT's masked language modelling + next sentence prediction, ALBERT's
sentence-order prediction in its place, or RoBERTa's masked language modelling alone
(`objective`).

Pick the encoder family and size with `get_config("<variant>,<size>[,runlocal]")`:

  python train.py --config configs/pretrain.py:realformer,base --workdir /tmp/rf_base
  python train.py --config configs/pretrain.py:postln,tiny --workdir /tmp/tiny \
      --config.optimizer.learning_rate=5e-4 --config.model.dtype=bfloat16

Variants (docs/design.md): postln, preln, realformer, synth_dense, synth_random,
synth_random_fixed, synth_factorized_dense, synth_factorized_random, synth_dense_vanilla,
synth_random_vanilla. Sizes: tiny (tests and CPU demos), and the RealFormer paper's small
(4/512/8/2048), base (12/768/12/3072), large (24/1024/16/4096), xlarge (36/1536/24/6144).

`runlocal` shrinks batch and steps for a quick check on a laptop CPU.
Unknown keys on the command line are an error (the config is locked). A field added here
needs a word on what runs written before it stood for (realformer/train/workdir.py,
ADDED_DEFAULTS or RESUMABLE) and a line in tests/data/config_keys.json, the list of fields
that tests/test_workdir.py checks.
"""

import ml_collections

from realformer.model import spec

# name: (num_layers, hidden_size, num_heads, mlp_dim)
SIZES = {
    'tiny': (2, 128, 2, 512),
    'small': (4, 512, 8, 2048),
    'base': (12, 768, 12, 3072),
    'large': (24, 1024, 16, 4096),
    'xlarge': (36, 1536, 24, 6144),
}

VARIANTS = tuple(spec.VARIANTS)  # the presets, defined once with what each one sets


def model_config(variant='postln', size='base'):
  """The encoder's knobs. Fields left at None take their value from `variant`."""
  if variant not in VARIANTS:
    raise ValueError(f'unknown variant {variant!r}; choose one of {", ".join(VARIANTS)}')
  if size not in SIZES:
    raise ValueError(f'unknown size {size!r}; choose one of {", ".join(SIZES)}')
  num_layers, hidden, heads, mlp = SIZES[size]
  m = ml_collections.ConfigDict()
  m.variant = variant
  m.num_layers = num_layers
  m.hidden_size = hidden
  m.num_heads = heads
  m.mlp_dim = mlp
  # Set from the tokenizer at run time (train.py overwrites it with tokenizer.vocab_size).
  m.vocab_size = 8000 if size == 'tiny' else 30000
  # The embedding table is padded to a multiple of this for the accelerator's matrix units;
  # logits of the padding ids are masked out, so the padding never changes a prediction.
  m.vocab_pad_multiple = 128
  m.max_len = 512  # learned absolute positions; also the Synthesizer's max length
  m.type_vocab_size = 2
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.1
  m.layer_norm_eps = 1e-12
  m.initializer_range = 0.02
  # GELU: erf, the exact form (HF's BERT, Google's released checkpoints), or tanh, the
  # approximation of google-research/bert's and the official RealFormer code.
  m.gelu = 'erf'
  # Overrides of what `variant` implies (None: take the variant's value).
  m.block = ml_collections.FieldReference(None, field_type=str)  # realformer/model/blocks.py's
  # '+'-joined logit components: dot and synthesizer/synthetic.py's (dense, random, ...).
  m.attention = ml_collections.FieldReference(None, field_type=str)
  m.residual_attention = ml_collections.FieldReference(None, field_type=bool)  # RealFormer
  m.running_mean = False  # RealFormer option: logits = running sum / (l + 1)
  # Synthesizer knobs.
  m.synth_random_trainable = ml_collections.FieldReference(None, field_type=bool)
  m.synth_random_init_std = 1.0  # std of the normal init of Random's R (and R1, R2)
  m.synth_factorized_rank = 8  # k of Factorized Random: R = R1 R2^T
  m.synth_factorized_a = 0  # a of Factorized Dense (a * b = max_len); 0: nearest sqrt
  # Computation: float32 parameters, activations in `dtype` (bfloat16 on accelerators);
  # softmax and LayerNorm are float32 whatever `dtype` is (RealFormer's carried scores:
  # residual_dtype below).
  m.dtype = 'float32'
  # RealFormer's carried scores ([B, H, T, T] per layer, kept for the backward pass):
  # float32 (the official code's) or bfloat16 (half the memory; the sum is still formed in
  # float32 within each layer, only the carried copy is rounded; it learns as float32 does:
  # BENCHMARKS.md, "RealFormer's carry in bfloat16").
  m.residual_dtype = 'float32'
  m.scan_layers = False  # nn.scan over layers (faster compile for deep models)
  # none | full | dots | dots_no_batch | dots_flash (the matmuls, the flash kernels' outputs
  # and the dropout masks kept: only the element-wise work recomputed)
  m.remat_policy = 'none'
  # auto | xla | cudnn (jax.nn.dot_product_attention, without attention dropout) | flash
  # (our Pallas kernels, attention dropout inside them: Triton on GPUs, Mosaic on TPUs) |
  # off. auto: on a TPU, the Mosaic kernels for every variant under
  # attention dropout; on an NVIDIA GPU, the Triton kernel for Post-LN/Pre-LN in bfloat16
  # under attention dropout where it runs (heads of 32 or 64: docs/launching.md) and cuDNN's
  # kernel without dropout (bf16/fp16); elsewhere the plain path.
  m.fused_attention = 'auto'
  m.dense_impl = 'auto'  # auto | flax | cpu (custom VJP for XLA:CPU: realformer/layers/dense.py)
  # predicted: in the pretraining loss the last layer computes only [CLS] and the masked
  # positions, the rows the losses read (same loss); all: every row.
  m.last_layer = 'predicted'
  return m


def optimizer_config(learning_rate: float, warmup_steps: int) -> ml_collections.ConfigDict:
  """BERT's hyper-parameters (weight decay 0.01, eps 1e-6, clipping at 1.0) with
  torch.optim.AdamW and transformers' linear schedule; BERT's own optimization is
  name=bert_adamw, schedule=bert (shared by pretraining and fine-tuning configs)."""
  o = ml_collections.ConfigDict()
  o.name = 'adamw'  # adamw (bias-corrected) | bert_adamw (BERT's own) | lamb (large batches)
  o.learning_rate = learning_rate
  # linear (warm-up, then linear decay to 0: transformers') | bert (BERT's optimization.py:
  # the decay counted from step 0) | cosine | constant (train_lib.make_schedule)
  o.schedule = 'linear'
  o.warmup_steps = warmup_steps  # -1: warmup_fraction of the run's steps
  o.warmup_fraction = 0.1
  o.weight_decay = 0.01  # not applied to LayerNorm parameters and biases
  o.b1 = 0.9
  o.b2 = 0.999
  o.eps = 1e-6
  o.clip_norm = 1.0
  return o


def mesh_config() -> ml_collections.ConfigDict:
  """Device mesh: axis sizes, -1 = the rest of the devices."""
  m = ml_collections.ConfigDict()
  m.data = -1
  m.fsdp = 1
  m.tensor = 1
  return m


def get_config(arg: str = 'postln,tiny'):
  """`arg`: "<variant>,<size>" optionally followed by ",runlocal"."""
  parts = [p.strip() for p in (arg or 'postln,tiny').split(',') if p.strip()]
  runlocal = 'runlocal' in parts
  parts = [p for p in parts if p != 'runlocal']
  variant = parts[0] if parts else 'postln'
  size = parts[1] if len(parts) > 1 else 'tiny'
  if len(parts) > 2:
    raise ValueError(f'config arg {arg!r}: expected "<variant>,<size>[,runlocal]"')

  c = ml_collections.ConfigDict()
  c.seed = 0
  # mlm_nsp: BERT's masked language modelling + next sentence prediction, on sentence pairs
  # [CLS] A [SEP] B [SEP]; mlm: RoBERTa's masked language modelling alone, no NSP head, on
  # FULL-SENTENCES inputs (one segment of consecutive sentences up to the full length,
  # across documents, [SEP] between them); mlm_doc: the same on DOC-SENTENCES (within one
  # document); mlm_sop: ALBERT's masked language modelling + sentence-order prediction (BERT's
  # pairs with A and B of a chunk swapped half the time in place of a random B, which only a
  # chunk of one sentence still gets; the NSP head and its nsp_ metrics predict the order).
  # The data is prepared for one of them (data/pretraining.py).
  c.objective = 'mlm_nsp'
  c.model = model_config(variant, size)

  # Input pipeline (data/). Sources: 'embedded' (the CC0 corpus shipped in the repository),
  # 'files:<glob>' (BERT's format: one sentence per line, blank line between documents),
  # 'tfds:<name>[:<split>]' (e.g. tfds:wikipedia/20230601.en; built in tfds_data_dir),
  # 'hf:<dataset>[@<revision>][:<config>][:<split>]' (Hugging Face datasets), several joined by ';'
  # (data/sources.py); or 'synthetic' alone: random token batches of the real format, for
  # throughput checks (nothing is prepared).
  c.data = ml_collections.ConfigDict()
  c.data.sources = 'embedded'
  # How the sources interleave, ';'-joined like `sources` ('' = proportional to size): each
  # next document comes from a source drawn with these weights until every source is used
  # up, so every document is used once whatever the weights (0 leaves a source out; list a
  # source twice to use it twice). The order decides which documents share a block.
  c.data.weights = ''
  c.data.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  c.data.tfds_text_feature = 'text'  # the tfds feature holding the text (paragraphs at newlines)
  c.data.hf_text_column = 'text'  # the same for hf:<dataset> sources
  # hf: sources: consecutive rows joined into one document (a sentence-per-row corpus, such
  # as BookCorpus's copies on the hub, needs many: NSP's next sentences come from within one);
  # one number for every source, or ';'-joined per source like weights, e.g. '1;100'
  c.data.hf_rows_per_document = '1'
  # Processes per host that prepare the shards (each tokenises its share of the documents;
  # the result is the same for any number): raise it to the host's cores for a big corpus.
  c.data.prepare_workers = 1
  # A sentencepiece .model or a WordPiece vocab.txt; '' = the embedded corpus's tokenizer
  c.data.tokenizer = ''
  # The preparation's seed (its pairings, the sources' interleaving); None: the run's `seed`.
  # Runs of several seeds share one data.prepared_dir with this set (BERT prepared its data
  # once, with its own seed).
  c.data.seed = ml_collections.FieldReference(None, field_type=int)
  c.data.prepared_dir = ''  # array_record shards; '' = <workdir>/data
  c.data.max_seq_length = 128
  c.data.max_predictions_per_seq = 20
  c.data.masked_lm_prob = 0.15
  c.data.short_seq_prob = 0.1
  c.data.dupe_factor = 1  # pairings made per document when preparing (masking is dynamic)
  c.data.whole_word_masking = False
  c.data.eval_fraction = 0.01  # documents held out for evaluation
  c.data.document_window = 1000  # documents per block while preparing (random-next from it)
  # Prepared files hold runs of this many consecutive blocks, which the preparation's
  # workers take in turn: a host reads about its share of the files, and a corpus of fewer
  # runs than workers leaves some idle (1: blocks dealt one by one, a file or more each).
  c.data.blocks_per_file = 8
  # Shard files are rotated every this many records (array_record keeps ~500 B a record in
  # memory until its file closes); hosts keep their files open (the soft `ulimit -n` is
  # raised to hold them, up to the hard one).
  c.data.records_per_file = 65536
  c.data.read_threads = 0  # grain reader threads (0: read in the consuming thread; raise for GCS)
  c.data.worker_count = 0  # grain worker processes per host (2 or more batch other positions
  # together than 0 or 1: the same records, other batches; fixed for a run's resumes)

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 256  # global, over all hosts
  c.train.num_steps = 100_000
  # > 0: train for this many minutes of wall time (compilation and evaluation not counted);
  # the learning-rate schedule follows the clock and reaches 0 when the time is spent, so
  # num_steps is only an upper bound (Cramming's budget; train.py's TimeBudget). The
  # schedule is read at max(step, spent share x num_steps): give the warm-up as
  # optimizer.warmup_fraction (warmup_steps=-1) so that it is a share of the budget.
  c.train.time_budget_minutes = 0.0
  c.train.grad_accum_steps = 1  # microbatches per step (weighted by masked tokens)
  c.train.log_every_steps = 100
  c.train.eval_every_steps = 2000
  c.train.eval_steps = 20  # batches per evaluation on the held-out split (0: no evaluation)
  c.train.checkpoint_every_steps = 2000
  c.train.keep_checkpoints = 3
  c.train.init_checkpoint = ''  # restart order: workdir's checkpoint, else this, else scratch
  c.train.profile_steps = 0  # capture a profile of this many steps after warm-up (0: none)
  # Peak FLOP/s of one device for MFU; 0 = look the device up (TPU v4-v6e, A100, H100, H200).
  c.train.peak_flops_per_device = 0.0

  # BERT's 10,000 warm-up steps (1% of its 1M; here 10% of the base preset's 100,000)
  c.optimizer = optimizer_config(learning_rate=1e-4, warmup_steps=10_000)
  c.mesh = mesh_config()

  if size == 'tiny':
    c.train.batch_size = 32
    c.train.num_steps = 300
    c.train.log_every_steps = 20
    c.train.eval_every_steps = 100
    c.train.eval_steps = 4
    c.train.checkpoint_every_steps = 100
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = -1  # 10% of this short run (10,000 would exceed it)
    c.model.max_len = 128
  if runlocal:
    c.train.batch_size = 8
    c.train.num_steps = 20
    c.train.log_every_steps = 5
    c.train.eval_every_steps = 10
    c.train.eval_steps = 2
    c.train.checkpoint_every_steps = 10
    c.optimizer.warmup_steps = -1

  c.lock()
  return c
