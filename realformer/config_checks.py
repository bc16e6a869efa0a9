"""What a config alone shows to be wrong, as one-line ValueErrors naming the fix (and the
settings that are allowed but probably not meant, as warnings).

train.py checks a config with `check_config` before anything is prepared, compiled or
written; sweep.py checks every run's config before the first run starts; data.prepare checks
the lengths. No jax at import (data preparation's worker processes import this).
"""

from typing import List


def warmup_steps(opt_config, num_steps: int) -> int:
  """optimizer.warmup_steps, or with -1, int(optimizer.warmup_fraction * num_steps) (a
  fraction outside [0, 1] is an error either way)."""
  warmup = int(opt_config.warmup_steps)
  fraction = float(opt_config.get('warmup_fraction', 0.0))
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f'optimizer.warmup_fraction={fraction} must lie in [0, 1] (it counts '
                     'where optimizer.warmup_steps=-1)')
  if warmup == -1:
    return int(fraction * num_steps)
  if warmup > num_steps or warmup < 0:
    raise ValueError(f'optimizer.warmup_steps={warmup} must lie in [0, train.num_steps='
                     f'{num_steps}]; lower it, or set it to -1 to warm up for '
                     f'optimizer.warmup_fraction of the run')
  return warmup


OPTIMIZERS = ('adamw', 'bert_adamw', 'lamb')  # train_lib.OPTIMIZERS builds each
SCHEDULES = ('linear', 'bert', 'cosine', 'constant')  # train_lib.SCHEDULES builds each


# [CLS] A [SEP] B [SEP] with a token in each segment: the shortest sequence that pretraining
# and a task of pairs can make.
MIN_SEQ_LENGTH = 5


def check_seq_length(value, setting: str) -> None:
  if int(value) < MIN_SEQ_LENGTH:
    raise ValueError(f'{setting}={value}: give at least {MIN_SEQ_LENGTH} tokens ([CLS] A [SEP] '
                     'B [SEP]); BERT uses 128 and 512')


def check_optimizer(opt_config) -> None:
  """optimizer.name and optimizer.schedule are ones that train_lib.make_optimizer builds; the
  learning rate, weight decay and clipping norm are not negative (a clip_norm of 0 turns
  clipping off), the moments' decays lie in [0, 1) and eps is positive."""
  if float(opt_config.learning_rate) < 0:
    raise ValueError(f'optimizer.learning_rate={opt_config.learning_rate}: give a rate >= 0')
  for name in ('b1', 'b2'):
    if name in opt_config and not 0 <= float(opt_config[name]) < 1:
      raise ValueError(f'optimizer.{name}={opt_config[name]}: give a decay in [0, 1) (BERT: '
                       'b1 0.9, b2 0.999)')
  if 'eps' in opt_config and not float(opt_config.eps) > 0:
    raise ValueError(f'optimizer.eps={opt_config.eps}: give a positive epsilon (BERT: 1e-6)')
  if float(opt_config.get('weight_decay', 0.0)) < 0:
    raise ValueError(f'optimizer.weight_decay={opt_config.weight_decay}: give a rate >= 0 '
                     '(BERT: 0.01)')
  if float(opt_config.get('clip_norm', 0.0) or 0.0) < 0:
    raise ValueError(f'optimizer.clip_norm={opt_config.clip_norm}: give a positive norm (BERT: '
                     '1.0), or 0 to turn clipping off')
  name = opt_config.get('name', 'adamw')
  if name not in OPTIMIZERS:
    raise ValueError(f'optimizer.name={name!r}; choose {", ".join(OPTIMIZERS[:-1])} or '
                     f'{OPTIMIZERS[-1]}')
  if opt_config.schedule not in SCHEDULES:
    raise ValueError(f'optimizer.schedule={opt_config.schedule!r}; choose '
                     f'{", ".join(SCHEDULES[:-1])} or {SCHEDULES[-1]}')


def check_counts(tc) -> None:
  """One-line errors for a step count or a cadence that cannot be (not positive), before
  the run directory is written."""
  fields = ['num_steps', 'log_every_steps', 'checkpoint_every_steps']
  if int(tc.eval_steps) < 0:
    raise ValueError(f'train.eval_steps={tc.eval_steps}: give the evaluation\'s number of '
                     'batches (0 turns evaluation off)')
  if tc.eval_steps > 0:
    fields.append('eval_every_steps')
  for name in fields:
    if int(tc[name]) < 1:
      raise ValueError(f'train.{name}={tc[name]}: give a positive number of steps' +
                       (' (train.eval_steps=0 turns evaluation off)'
                        if name == 'eval_every_steps' else ''))
  if int(tc.batch_size) < 1:
    raise ValueError(f'train.batch_size={tc.batch_size}: give a positive number of examples '
                     '(the global batch, over all hosts)')
  check_accumulation(int(tc.batch_size), int(tc.get('grad_accum_steps', 1)))
  if tc.get('keep_checkpoints', 1) is not None and int(tc.keep_checkpoints) < 1:
    raise ValueError(f'train.keep_checkpoints={tc.keep_checkpoints}: keep at least 1 (the '
                     'newest is the one a resume needs)')


def check_accumulation(batch_size: int, grad_accum_steps: int) -> None:
  if grad_accum_steps < 1:
    raise ValueError(f'train.grad_accum_steps={grad_accum_steps}: give a positive number of '
                     'microbatches (1: none), a divisor of train.batch_size')
  if batch_size % grad_accum_steps:
    raise ValueError(f'train.grad_accum_steps={grad_accum_steps} does not divide '
                     f'train.batch_size={batch_size}; pick a divisor of the batch size')


def check_lengths(config) -> None:
  """The lengths and groupings that shape the prepared instances."""
  check_seq_length(config.data.max_seq_length, 'data.max_seq_length')
  if config.data.max_seq_length > config.model.max_len:
    raise ValueError(f'data.max_seq_length={config.data.max_seq_length} exceeds the model\'s '
                     f'positions (model.max_len={config.model.max_len}); lower the first or '
                     'raise the second')
  rows_per_document(config.data.get('hf_rows_per_document', '1'), config.data.sources)


def check_segments(needed: int, type_vocab_size: int, what: str, fix: str) -> None:
  """The token type table has a row for each segment id the inputs use (an id past it would
  silently embed nothing)."""
  if int(type_vocab_size) < needed:
    raise ValueError(f'model.type_vocab_size={type_vocab_size}: {what} use segment ids 0 to '
                     f'{needed - 1}; {fix}')


def rows_per_document(value, sources: str) -> List[int]:
  """data.hf_rows_per_document for each of data.sources (';'-joined): one number for every
  source, or one per source like data.weights; only hf: sources read theirs."""
  n = len([s for s in str(sources).split(';') if s.strip()])
  parts = [p.strip() for p in str(value).split(';')]
  if len(parts) == 1:
    parts *= n
  try:
    rows = [int(p) for p in parts]
  except ValueError:
    rows = []
  if len(rows) != n or min(rows, default=1) < 1:
    per_source = f', or {n} of them joined by \';\', one per source' if n > 1 else ''
    raise ValueError(f'data.hf_rows_per_document={value!r}: give a positive number of rows '
                     f'(1: each row is a document){per_source}')
  return rows


def check_masking(data) -> None:
  if not 0 < float(data.masked_lm_prob) < 1:
    raise ValueError(f'data.masked_lm_prob={data.masked_lm_prob} must be in (0, 1); BERT '
                     'uses 0.15')
  if int(data.max_predictions_per_seq) < 1:
    raise ValueError(f'data.max_predictions_per_seq={data.max_predictions_per_seq}: give at '
                     'least 1 (BERT: 20 at length 128, 80 at 512)')
  wanted = round(int(data.max_seq_length) * float(data.masked_lm_prob))
  if int(data.max_predictions_per_seq) < wanted:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning('data.max_predictions_per_seq=%d caps the masked tokens of a full '
                    'sequence at %.1f%% instead of masked_lm_prob=%g (%d of %d); BERT uses 20 '
                    'at length 128 and 80 at 512', data.max_predictions_per_seq,
                    100 * int(data.max_predictions_per_seq) / int(data.max_seq_length),
                    data.masked_lm_prob, wanted, data.max_seq_length)


def check_fractions(data) -> None:
  """The shares that shape the prepared instances lie where they mean something."""
  if 'short_seq_prob' in data and not 0 <= float(data.short_seq_prob) <= 1:
    raise ValueError(f'data.short_seq_prob={data.short_seq_prob}: give a share in [0, 1] '
                     '(BERT: 0.1)')
  if 'eval_fraction' in data and not 0 <= float(data.eval_fraction) < 1:
    raise ValueError(f'data.eval_fraction={data.eval_fraction}: give a share in [0, 1) (the '
                     'documents held out; the rest are trained on)')
  if int(data.get('dupe_factor', 1)) < 1:
    raise ValueError(f'data.dupe_factor={data.dupe_factor}: give at least 1 (the pairings made '
                     'of each document; BERT: 10)')


def check_document_window(data) -> None:
  """NSP's random next comes from another document of the same block of
  data.document_window documents: a block of one has none. The prepared files' runs of
  blocks and their records are positive counts."""
  window = int(data.get('document_window', 1000))
  if window < 2:
    raise ValueError(f'data.document_window={window}: the random next sentences come from '
                     'other documents of the same block; give at least 2 (default 1000)')
  for name in ('blocks_per_file', 'records_per_file'):
    if int(data.get(name, 1)) < 1:
      raise ValueError(f'data.{name}={data.get(name)}: give a positive number')


def check_used(model_config, spec) -> None:
  """Warnings for model settings that the resolved encoder does not read (a sweep that sets
  one for every variant is allowed; a single run that sets it probably meant another
  variant)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  if model_config.get('running_mean') and not spec.residual_attention:
    logging.warning('model.running_mean=True does nothing without residual attention (model.'
                    'variant=realformer, or model.residual_attention=True); %s has none',
                    spec.variant)
  if model_config.get('synth_random_trainable') is False and not spec.random_table:
    logging.warning('model.synth_random_trainable=False does nothing: %s has no random '
                    'Synthesizer table to keep fixed', spec.variant)
  if 'factorized_dense' in spec.attention and 1 in spec.factorized_ab:
    logging.warning('Factorized Dense at model.max_len=%d factors it as %d x %d: one factor '
                    'of 1 makes it Dense with one more scalar a head, not a factorization; '
                    'give a max_len with a divisor near its square root (128 = 8 x 16) or '
                    'set model.synth_factorized_a', spec.max_len, *spec.factorized_ab)
  from synthesizer import synthetic  # pylint: disable=g-import-not-at-top
  if all(c != 'dot' and not synthetic.component(c).mixed for c in spec.attention):
    logging.warning('model.attention=%s holds only biases of the logits (added, not mixed): '
                    'its attention reads no token\'s content; add the dot product '
                    '(dot+%s) or a synthesizer', '+'.join(spec.attention),
                    '+'.join(spec.attention))
  if 'factorized_random' in spec.attention and spec.synth_factorized_rank >= spec.max_len:
    logging.warning('model.synth_factorized_rank=%d is not below model.max_len=%d: R1 R2^T '
                    'is then a table of full rank (Random\'s), not a factorization',
                    spec.synth_factorized_rank, spec.max_len)


def check_config(config) -> None:
  """Everything the pretraining config alone can show: the model's settings, step counts
  and cadences, the warm-up and the optimizer, the lengths, the masking (the objective's
  own: data/pretraining.check_objective)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  from realformer.model.spec import resolve  # pylint: disable=g-import-not-at-top (jax)
  check_used(config.model, resolve(config.model))
  check_counts(config.train)
  if 0 < warmup_steps(config.optimizer, int(config.train.num_steps)) == config.train.num_steps:
    setting = ('optimizer.warmup_fraction=1' if int(config.optimizer.warmup_steps) == -1 else
               f'optimizer.warmup_steps={config.train.num_steps}')
    logging.warning('%s: the whole run of %d steps warms up (the learning rate reaches '
                    'optimizer.learning_rate at its last step); give a shorter warm-up',
                    setting, config.train.num_steps)
  if (float(config.train.get('time_budget_minutes', 0.0)) > 0
      and int(config.optimizer.warmup_steps) > 0):
    logging.warning('optimizer.warmup_steps=%d with train.time_budget_minutes=%g: the '
                    'schedule follows the budget\'s share of train.num_steps=%d, so the '
                    'warm-up lasts %.2g%% of the budget, whatever steps the time allows (a '
                    'warm-up of so many steps a budget cannot give; '
                    'optimizer.warmup_steps=-1 and warmup_fraction say it as the share)',
                    int(config.optimizer.warmup_steps), config.train.time_budget_minutes,
                    config.train.num_steps,
                    100 * int(config.optimizer.warmup_steps) / int(config.train.num_steps))
  check_optimizer(config.optimizer)
  check_lengths(config)
  check_masking(config.data)
  check_fractions(config.data)
  check_document_window(config.data)
