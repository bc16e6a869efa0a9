"""Length buckets for fine-tuning: each batch is padded to one of a few compiled lengths,
not to max_seq_length.

Fine-tuning sets are mostly short sentences (SST-2's median is about 10 word pieces at a
max_seq_length of 128), so padding every batch to max_seq_length spends most of the compute
on padding. Here the training examples' lengths choose at most `num_buckets` lengths
(multiples of `multiple`; the longest covers every training example), each example goes to the
shortest bucket that holds it, and a batch is drawn from one bucket: at most `num_buckets`
shapes are ever compiled for training, whatever the data. A dev or test example longer than
every bucket gets one more length, for evaluation only
(realformer/finetune/task.eval_lengths).

Training: an epoch's batches are a pure function of (seed, epoch) and the lengths, so a run
resumes at any step, and every host computes the same plan (multi-host safe). Batches come in
two compositions. Grouped by length (the default), a batch is drawn from one bucket; examples
left over in a bucket (fewer than a batch) move up to the next longer bucket. Random (as
transformers' Trainer draws them), a batch is any batch_size examples of the shuffled epoch,
padded to the shortest bucket that holds its longest: the lengths are then chosen from the
batches' longest examples (batch_longest), not from every example's. Either way an epoch has
exactly len(examples) // batch_size batches, as without buckets; the fewer than batch_size
examples left out of an epoch are drawn at random (not by length) and differ from epoch to
epoch. Evaluation: every example exactly once, batched within its bucket, results put back in
the original order.

The bucketed model computes what the padded one computes: attention masks the padding keys and
every position-shaped weight (positions, synthetic attention) is sliced to the length.
"""

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

# Features whose second axis is the sequence: sliced to the batch's bucket length (a task
# with per-token labels adds its own: FinetuneTask.sequence_keys).
SEQUENCE_KEYS = ('input_ids', 'segment_ids', 'attention_mask')


def lengths_of(features: Dict[str, np.ndarray]) -> np.ndarray:
  """Tokens per example (the attention mask holds the real tokens first)."""
  return np.asarray(features['attention_mask']).sum(axis=1).astype(np.int64)


def _round_up(n, multiple: int):
  return -(-np.asarray(n) // multiple) * multiple


def choose_lengths(lengths: Sequence[int], num_buckets: int, multiple: int,
                   max_seq_length: int, cover: int = 0, repeats: float = 1.0,
                   tokens_per_compile: float = 0.0) -> Tuple[int, ...]:
  """The bucket lengths that cost the run least: `repeats` x the padded tokens of `lengths`
  (the run's epochs; batch_size for random batches' longest examples, batch_longest), plus
  `tokens_per_compile` for every length (a length is one more compilation; its cost is
  stated as the padded tokens the run would process in the same time: plan_cost). With
  tokens_per_compile 0: the lengths that pad least.

  At most `num_buckets` lengths, each a multiple of `multiple` (or max_seq_length itself),
  the longest covering max(lengths) and `cover` (the longest example of the splits that are
  only evaluated). Exact: a dynamic programme over the distinct rounded lengths.
  """
  if num_buckets < 1 or multiple < 1:
    raise ValueError(f'length buckets need num_buckets >= 1 and multiple >= 1, got '
                     f'{num_buckets} and {multiple}')
  rounded = np.minimum(_round_up(np.asarray(lengths, np.int64), multiple), max_seq_length)
  top = int(min(_round_up(max(int(rounded.max(initial=1)), int(cover), 1), multiple),
                max_seq_length))
  values, counts = np.unique(rounded, return_counts=True)
  candidates = sorted(set(values.tolist()) | {top})
  count = dict(zip(values.tolist(), counts.tolist()))
  weight = np.array([count.get(c, 0) for c in candidates], np.int64)
  size = np.array(candidates, np.int64)
  c = len(candidates)
  prefix = np.concatenate([[0], np.cumsum(weight)])
  inf = np.iinfo(np.int64).max // 4
  # cost[k][j]: fewest padded tokens for candidates[0..j] with k+1 buckets, the last at j.
  cost = np.full((num_buckets, c), inf, np.int64)
  parent = np.full((num_buckets, c), -1, np.int64)
  cost[0] = size * prefix[1:]
  for k in range(1, num_buckets):
    for j in range(c):
      for i in range(j):  # the previous bucket ends at i; this one holds i+1..j
        value = cost[k - 1][i] + size[j] * (prefix[j + 1] - prefix[i + 1])
        if value < cost[k][j]:
          cost[k][j], parent[k][j] = value, i
  run_cost = (repeats * cost[:, c - 1].astype(np.float64)
              + tokens_per_compile * np.arange(1, num_buckets + 1))
  k = int(np.argmin(run_cost))  # fewer buckets when more would not cost less
  chosen, j = [], c - 1
  while j >= 0 and k >= 0:
    chosen.append(candidates[j])
    j, k = int(parent[k][j]), k - 1
  return tuple(sorted(chosen))


def bucket_index(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
  """The shortest bucket that holds each example (an error if one is longer than all)."""
  lengths = np.asarray(lengths)
  index = np.searchsorted(np.asarray(buckets), lengths, side='left')
  if len(lengths) and index.max() >= len(buckets):
    raise ValueError(f'an example of {int(lengths.max())} tokens is longer than the longest '
                     f'length bucket ({buckets[-1]})')
  return index


def padded_tokens(lengths: np.ndarray, buckets: Sequence[int]) -> int:
  return int(np.asarray(buckets)[bucket_index(lengths, buckets)].sum())


def _epoch_order(n: int, batch_size: int, seed: int, epoch: int):
  """The epoch's generator and its shuffled examples, the fewer than batch_size left out."""
  rng = np.random.default_rng([seed, epoch])
  order = rng.permutation(n)
  return rng, order[:n // batch_size * batch_size]  # the few left out: random, not the longest


def train_batches(lengths: np.ndarray, buckets: Sequence[int], batch_size: int, seed: int,
                  epoch: int, by_length: bool = True) -> List[Tuple[int, np.ndarray]]:
  """The epoch's (length, example indices) batches, len(lengths) // batch_size of them, in a
  shuffled order; each batch's examples fit its length. `by_length`: each batch's examples
  from one bucket; else random batches, each at the shortest bucket that holds its longest
  (with one bucket the two are the same plan)."""
  lengths = np.asarray(lengths)
  rng, order = _epoch_order(len(lengths), batch_size, seed, epoch)
  if not by_length:
    chunks = order.reshape(-1, batch_size)
    index = bucket_index(lengths[chunks].max(axis=1, initial=0), buckets)
    plan = [(int(buckets[b]), idx) for b, idx in zip(index, chunks)]
    return [plan[i] for i in rng.permutation(len(plan))]
  index = bucket_index(lengths[order], buckets)
  plan, carry = [], order[:0]
  for b, length in enumerate(buckets):
    members = np.concatenate([carry, order[index == b]])
    full = len(members) // batch_size * batch_size
    plan += [(int(length), members[i:i + batch_size]) for i in range(0, full, batch_size)]
    carry = members[full:]  # too few for a batch: padded to the next length up
  return [plan[i] for i in rng.permutation(len(plan))]  # (no carry is left at the end)


def batch_longest(lengths: np.ndarray, batch_size: int, seed: int, epochs: int) -> np.ndarray:
  """The longest example of each random batch (train_batches, by_length=False) of epochs
  0..epochs-1: what those batches are padded to fit."""
  lengths = np.asarray(lengths, np.int64)
  return np.concatenate([np.zeros(0, np.int64)] + [
      lengths[_epoch_order(len(lengths), batch_size, seed, epoch)[1].reshape(-1, batch_size)]
      .max(axis=1, initial=0) for epoch in range(epochs)])


def eval_batches(lengths: np.ndarray, buckets: Sequence[int], batch_size: int
                 ) -> Iterator[Tuple[int, np.ndarray, np.ndarray]]:
  """(length, indices, valid) covering every example once; a bucket's last batch is filled
  by repeating its examples (valid False there)."""
  index = bucket_index(lengths, buckets)
  for b, length in enumerate(buckets):
    members = np.flatnonzero(index == b)
    for start in range(0, len(members), batch_size):
      idx = members[start:start + batch_size]
      yield int(length), np.resize(idx, batch_size), np.arange(batch_size) < len(idx)


def take(features: Dict[str, np.ndarray], idx: np.ndarray, length: int,
         sequence_keys: Sequence[str] = SEQUENCE_KEYS) -> Dict[str, np.ndarray]:
  """Rows `idx` of the features, the sequence axes (of `sequence_keys`) cut to `length`."""
  return {k: v[idx, :length] if k in sequence_keys else v[idx] for k, v in features.items()}


def describe(lengths: np.ndarray, buckets: Sequence[int], max_seq_length: int,
             batch_longest: Optional[np.ndarray] = None) -> str:
  """One log line: the lengths, how many examples each holds (with `batch_longest`, random
  batches' longest examples: how many batches), and the padding saved."""
  if batch_longest is None:
    counts = np.bincount(bucket_index(lengths, buckets), minlength=len(buckets))
    padded, fixed = padded_tokens(lengths, buckets), len(lengths) * max_seq_length
    what, real, about = 'length buckets', int(lengths.sum()) / max(padded, 1), ''
    parts = ', '.join(f'{b} ({c} examples)' for b, c in zip(buckets, counts))
  else:  # per batch; its real tokens as the mean example's
    counts = np.bincount(bucket_index(batch_longest, buckets), minlength=len(buckets))
    padded = padded_tokens(batch_longest, buckets) / max(len(batch_longest), 1)
    what, fixed = 'random batches padded to length buckets', max_seq_length
    real = float(np.mean(lengths)) / max(padded, 1) if len(lengths) else 0.0
    about = 'about '
    parts = ', '.join(f'{b} ({c} batch{"es" if c != 1 else ""})' for b, c in zip(buckets, counts))
  return (f'{what} {parts}: {len(buckets)} compiled '
          f'length{"s" if len(buckets) > 1 else ""}, whose batches hold '
          f'{padded / max(fixed, 1):.0%} of the tokens that padding every batch to '
          f'{max_seq_length} would, {about}{real:.0%} of them real')
