"""Pretraining examples: instances (prepared once) and MLM masking (redone dynamically, per
epoch), for each objective of config.objective (OBJECTIVES): BERT's MLM + next sentence
prediction on sentence pairs ('mlm_nsp'), ALBERT's MLM + sentence-order prediction on the
same pairs with a chunk's A and B swapped half the time in place of a random B, which only
a chunk of one sentence still gets ('mlm_sop': `sentence_order_instances`), or RoBERTa's
MLM alone on one segment of
consecutive sentences: FULL-SENTENCES, across documents ('mlm': `full_sentence_instances`),
or DOC-SENTENCES, within one ('mlm_doc': `doc_sentence_instances`).

Pair instances follow google-research/bert's create_pretraining_data.py:
  - a document's sentences are packed into chunks up to a target length of
    max_seq_length - 3 tokens (with probability short_seq_prob a random shorter target);
  - a chunk is split at a random sentence boundary into A and B; with probability 1/2 (and
    always when the chunk has one sentence) B is instead taken from a random other document
    from a random sentence on (label 1, "random next"), and the chunk's unused sentences are
    put back for the next chunk;
  - the pair is truncated to max_seq_length - 3 tokens, one token at a time from the longer
    side, from its front or back at random;
  - the example is [CLS] A [SEP] B [SEP] with segment ids 0 for [CLS] A [SEP] and 1 after.
Masking (`Masker`): masked_lm_prob of the tokens (rounded, at least one, at most
max_predictions_per_seq; with whole-word masking, whole words up to that count, skipping
a word that would overflow it, as BERT does), never [CLS], [SEP] or [PAD] (no
special token); each chosen token
becomes [MASK] 80% of the time, a random non-special token 10%, itself 10%. With whole-word
masking a word's pieces are chosen together (a piece whose `word_start_mask` is False
continues the word before it).

Where this differs from google-research/bert, on purpose:
  - the random other document is drawn from a bounded set of neighbouring documents instead
    of the whole corpus, so memory does not grow with the corpus: data/prepare.py cuts the
    stream into blocks of config.data.document_window documents (default 1000) and draws
    from the other documents of the same block (`block_instances`), so sources that keep
    related documents together draw random-next segments from nearby documents; 1000 keeps
    them varied;
  - masks are drawn anew every epoch (RoBERTa's dynamic masking) instead of once per
    duplicate at preparation, so config.data.dupe_factor defaults to 1 (BERT: 10, for ten
    static maskings): the sentence pairs then repeat every epoch, their masks do not;
  - a document with no other beside it (a block, or a corpus, of one document) gets no
    random next segment: its pairs are all actual next ones (BERT, after ten draws of the
    same document, takes a random segment from that document itself);
  - [UNK] is never masked and a random replacement is never a special token (BERT skips
    only [CLS] and [SEP], and may draw any vocabulary entry);
  - whole-word masking with a sentencepiece vocabulary groups the pieces of a
    whitespace-separated word (`Tokenizer.word_start_mask`: punctuation joins its word),
    where BERT's WordPiece groups split punctuation apart; a WordPiece vocabulary
    (data.tokenizer --model_type wordpiece) groups as BERT does;
  - a word of more pieces than max_predictions_per_seq, which whole-word masking could never
    choose, is masked piece by piece (BERT never masks it): to sentencepiece a text without
    spaces (Chinese, Japanese, Thai; a long URL) is one word.

Instances are prepared once and kept (data/prepare.py): a change to how they are built for
the same settings raises data/prepare.PREPARE_VERSION, so that data prepared before is
refused instead of reused; masks are drawn when a batch is read and need nothing of it.
"""

import collections
import random
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np

Document = List[List[int]]  # tokenised sentences


class Instance(NamedTuple):
  tokens_a: List[int]
  tokens_b: List[int]
  is_random_next: bool

  def to_bytes(self) -> bytes:
    header = [int(self.is_random_next), len(self.tokens_a), len(self.tokens_b)]
    return np.asarray(header + self.tokens_a + self.tokens_b, np.int32).tobytes()

  @classmethod
  def from_bytes(cls, data: bytes) -> 'Instance':
    x = np.frombuffer(data, np.int32)
    la, lb = int(x[1]), int(x[2])
    return cls(x[3:3 + la].tolist(), x[3 + la:3 + la + lb].tolist(), bool(x[0]))


def truncate_seq_pair(tokens_a: List[int], tokens_b: List[int], max_num_tokens: int,
                      rng: random.Random):
  """Truncates in place, one token at a time from the longer side, front or back at random."""
  while len(tokens_a) + len(tokens_b) > max_num_tokens:
    trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
    if rng.random() < 0.5:
      del trunc[0]
    else:
      trunc.pop()


def instances_from_document(document: Document, others: Sequence[Document],
                            max_seq_length: int, short_seq_prob: float,
                            rng: random.Random, *, sentence_order: bool = False,
                            stats: Optional[collections.Counter] = None) -> List[Instance]:
  """BERT's create_instances_from_document; `others` are the candidate random documents.

  `sentence_order`: ALBERT's (its create_instances_from_document with
  random_next_sentence=False): a chunk of two sentences or more is never paired at random;
  with probability 1/2 its A and B are swapped instead (label 1), and a chunk of one
  sentence is paired with a random document's segment as BERT pairs it (label 1). `stats`
  counts the pairs made of a random document's segment ('random_next') and the swapped
  ones ('swapped'): label 1 is either."""
  max_num_tokens = max_seq_length - 3
  target = max_num_tokens
  if rng.random() < short_seq_prob:
    target = rng.randint(2, max_num_tokens)
  instances, chunk, length, i = [], [], 0, 0
  while i < len(document):
    chunk.append(document[i])
    length += len(document[i])
    if i == len(document) - 1 or length >= target:
      a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
      tokens_a = [t for s in chunk[:a_end] for t in s]
      tokens_b = []
      # With no other document (a block of one) there is no random next: the pair is the
      # actual next, or none when the chunk is one sentence (an empty B is dropped below).
      one = len(chunk) == 1
      is_random_next = bool(others) and (one or (not sentence_order and rng.random() < 0.5))
      swapped = sentence_order and not one and rng.random() < 0.5
      if is_random_next:
        target_b = target - len(tokens_a)
        other = others[rng.randint(0, len(others) - 1)]
        for sentence in other[rng.randint(0, len(other) - 1):]:
          tokens_b.extend(sentence.tolist() if isinstance(sentence, np.ndarray) else sentence)
          if len(tokens_b) >= target_b:
            break
        i -= len(chunk) - a_end  # put the unused sentences back
      else:
        tokens_b = [t for s in chunk[a_end:] for t in s]
      if swapped:  # (ALBERT swaps before truncating, as here)
        tokens_a, tokens_b = tokens_b, tokens_a
      truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
      if tokens_a and tokens_b:
        instances.append(Instance(tokens_a, tokens_b, is_random_next or swapped))
        if stats is not None:
          stats['random_next'] += is_random_next
          stats['swapped'] += swapped
      chunk, length = [], 0
    i += 1
  return instances


def _compact(doc, stats: collections.Counter):
  """A document's non-empty sentences as int32 arrays, counted; None when none is left."""
  doc = [np.asarray(s, np.int32) for s in doc if len(s)]
  if not doc:
    stats['empty_documents'] += 1
    return None
  stats['documents'] += 1
  if len(doc) == 1:
    stats['single_sentence_documents'] += 1  # in pairs, as BERT's: always a random next
  return doc


class _AllBut:
  """The documents of a block but one, as a sequence (no copy)."""

  def __init__(self, docs, skip: int):
    self._docs, self._skip = docs, skip

  def __len__(self):
    return len(self._docs) - 1

  def __getitem__(self, i):
    return self._docs[i if i < self._skip else i + 1]


def block_instances(documents: Iterable[Document], *, max_seq_length: int,
                    short_seq_prob: float, dupe_factor: int, seed: int,
                    stats: collections.Counter, sentence_order: bool = False
                    ) -> Iterator[Instance]:
  """Instances of one block of documents held whole (data/prepare.py's unit of work): each
  document's random next segments come from any other document of the block, as BERT's come
  from any other of the corpus; a block of one document has no random next segments.
  `sentence_order`: ALBERT's pairs instead (instances_from_document)."""
  if max_seq_length < 5:
    raise ValueError(f'data.max_seq_length={max_seq_length} leaves no room for [CLS] A [SEP] '
                     'B [SEP]; use at least 5 (BERT uses 128 and 512)')
  rng = random.Random(seed)
  docs = [d for d in (_compact(doc, stats) for doc in documents) if d is not None]
  for j, doc in enumerate(docs):
    lists = [s.tolist() for s in doc]
    for _ in range(dupe_factor):
      yield from instances_from_document(lists, _AllBut(docs, j), max_seq_length,
                                         short_seq_prob, rng, sentence_order=sentence_order,
                                         stats=stats)


def sentence_order_instances(documents: Iterable[Document], **kw) -> Iterator[Instance]:
  """ALBERT's sentence-order prediction pairs (Lan et al. 2019), one block of documents:
  BERT's chunks split into A and B, in order (label 0) or swapped (label 1) with
  probability 1/2; a chunk of one sentence is paired with a random other document's segment
  (label 1), as ALBERT's create_pretraining_data.py does. block_instances' arguments."""
  return block_instances(documents, sentence_order=True, **kw)


def doc_sentence_instances(documents: Iterable[Document], *, max_seq_length: int,
                           short_seq_prob: float, dupe_factor: int, seed: int,
                           stats: collections.Counter) -> Iterator[Instance]:
  """RoBERTa's DOC-SENTENCES inputs (Liu et al. 2019, section 4.2), one block of documents:
  each document's consecutive sentences packed into instances of at most max_seq_length - 2
  tokens ([CLS] and [SEP] around them), one segment, no B; a sentence longer than that is cut
  into pieces of that length, and a document's last instance may be short (the paper grew
  its batch to make up the tokens; here a batch is a fixed count of sequences).
  short_seq_prob and the block's other documents play no part, nor does `seed` (packing is
  deterministic); dupe_factor repeats the instances (masked anew at each reading)."""
  del short_seq_prob, seed
  budget = _single_segment_budget(max_seq_length)
  for doc in documents:
    doc = _compact(doc, stats)
    if doc is None:
      continue
    pieces = [s[i:i + budget].tolist() for s in doc for i in range(0, len(s), budget)]
    packed, chunk = [], []
    for piece in pieces:
      if chunk and len(chunk) + len(piece) > budget:
        packed.append(chunk)
        chunk = []
      chunk = chunk + piece
    packed.append(chunk)
    for _ in range(dupe_factor):
      for tokens in packed:
        yield Instance(list(tokens), [], False)


# In a FULL-SENTENCES instance's tokens: where one document ends and the next begins
# (make_features writes [SEP] there, as RoBERTa separates documents with its </s>).
DOCUMENT_BREAK = -1


def full_sentence_instances(documents: Iterable[Document], *, max_seq_length: int,
                            short_seq_prob: float, dupe_factor: int, seed: int,
                            stats: collections.Counter) -> Iterator[Instance]:
  """RoBERTa's FULL-SENTENCES inputs (Liu et al. 2019, section 4.2; the paper's choice for
  the rest of its experiments and its released model), one block of documents: the
  block's sentences in order, packed into instances of at most max_seq_length - 2 tokens
  ([CLS] and [SEP] around them) that cross document boundaries, with a separator between
  two documents (DOCUMENT_BREAK); one segment, no B; a sentence longer than that is cut
  into pieces of that length. short_seq_prob and `seed` play no part (packing is
  deterministic); dupe_factor repeats the instances (masked anew at each reading)."""
  del short_seq_prob, seed
  budget = _single_segment_budget(max_seq_length)
  packed, chunk = [], []
  for doc in documents:
    doc = _compact(doc, stats)
    if doc is None:
      continue
    for k, piece in enumerate(s[i:i + budget].tolist() for s in doc
                              for i in range(0, len(s), budget)):
      joint = [DOCUMENT_BREAK] if chunk and k == 0 else []  # (none opens an instance)
      if chunk and len(chunk) + len(joint) + len(piece) > budget:
        packed.append(chunk)
        chunk, joint = [], []
      chunk = chunk + joint + piece
  if chunk:
    packed.append(chunk)
  for _ in range(dupe_factor):
    for tokens in packed:
      yield Instance(list(tokens), [], False)


def _single_segment_budget(max_seq_length: int) -> int:
  if max_seq_length < 3:
    raise ValueError(f'data.max_seq_length={max_seq_length} leaves no room for [CLS] A [SEP]; '
                     'use at least 3 (RoBERTa uses 512)')
  return max_seq_length - 2


class Objective(NamedTuple):
  """What config.objective names: whether the model classifies pairs (BERT's NSP head and
  loss on [CLS] A [SEP] B [SEP] pairs, the batch's next_sentence_labels: whether B is A's
  next sentence, or under ALBERT's objective whether A and B are in order; the metrics keep
  the nsp_ names), the builder of its instances (data/prepare.py's, for one block of
  documents), their name in the preparation's fingerprint (one per builder: data prepared
  by one is refused for another) and what it is, in words."""
  next_sentence: bool
  instances: Callable[..., Iterator[Instance]]
  instances_name: str
  about: str


OBJECTIVES = {
    'mlm_nsp': Objective(True, block_instances, 'pairs',
                         'BERT: masked language modelling + next sentence prediction'),
    'mlm': Objective(False, full_sentence_instances, 'full_sentences',
                     'RoBERTa: masked language modelling alone on FULL-SENTENCES inputs'),
    'mlm_doc': Objective(False, doc_sentence_instances, 'doc_sentences',
                         'RoBERTa: the same on DOC-SENTENCES inputs, within one document'),
    'mlm_sop': Objective(True, sentence_order_instances, 'sentence_order_pairs',
                         'ALBERT: masked language modelling + sentence-order prediction'),
}


def objective(name: str) -> Objective:
  if name not in OBJECTIVES:
    raise ValueError(f'config.objective={name!r}; choose ' + ', '.join(
        f'{n} ({o.about})' for n, o in OBJECTIVES.items()))
  return OBJECTIVES[name]


def of_config(config) -> Objective:
  """A pretraining config's objective (BERT's where the config has none: one written before
  the field)."""
  return objective(config.get('objective', 'mlm_nsp'))


def check_objective(config) -> Objective:
  """A pretraining config's objective, and what it asks of the model (one-line errors)."""
  from realformer import config_checks  # pylint: disable=g-import-not-at-top
  chosen = of_config(config)
  if chosen.next_sentence:
    config_checks.check_segments(2, config.model.type_vocab_size,
                                 'pretraining pairs ([CLS] A [SEP] B [SEP])', 'set it to 2')
  return chosen


def make_features(instance: Instance, *, cls_id: int, sep_id: int, pad_id: int,
                  max_seq_length: int) -> Dict[str, np.ndarray]:
  """[CLS] A [SEP] B [SEP] (a pair, with its NSP label), or [CLS] A [SEP] (an instance
  without B: RoBERTa's, its DOCUMENT_BREAKs as [SEP]), padded: input_ids, segment_ids,
  attention_mask[, next_sentence_labels]."""
  a, b = instance.tokens_a, instance.tokens_b
  if DOCUMENT_BREAK in a:  # (FULL-SENTENCES: a separator between two documents)
    a = [sep_id if t == DOCUMENT_BREAK else t for t in a]
  ids = [cls_id] + a + [sep_id] + (b + [sep_id] if b else [])
  n = len(ids)
  if n > max_seq_length:
    raise ValueError(f'a prepared example has {n} tokens > data.max_seq_length='
                     f'{max_seq_length}; the prepared shards were made for a longer length: '
                     'prepare again (delete the prepared directory)')
  input_ids = np.full(max_seq_length, pad_id, np.int32)
  input_ids[:n] = ids
  segment_ids = np.zeros(max_seq_length, np.int32)
  segment_ids[len(a) + 2:n] = 1
  mask = np.zeros(max_seq_length, np.int32)
  mask[:n] = 1
  features = {'input_ids': input_ids, 'segment_ids': segment_ids, 'attention_mask': mask}
  if b:
    features['next_sentence_labels'] = np.int32(instance.is_random_next)
  return features


class Masker:
  """Dynamic MLM masking with BERT's 80/10/10 rule; deterministic given the generator.

  Another masking scheme is a class with this call (features and a generator in, the
  features with input_ids masked and masked_lm_positions/ids/weights of
  max_predictions_per_seq out) that data/pipeline.make_masker builds from config.data; its
  settings are config fields (configs/pretrain.py, their checks in
  config_checks.check_masking, a default for older runs' configs in
  workdir.ADDED_DEFAULTS, a line each in tests/data/config_keys.json), and a feature of
  its own goes into realformer/train/pretraining.abstract_batch and the loss beside it.
  Masks are drawn when a batch is read, so prepared data is reused as it is."""

  def __init__(self, *, vocab_size: int, special_ids: Iterable[int], mask_id: int,
               masked_lm_prob: float, max_predictions_per_seq: int,
               whole_word_masking: bool = False, word_start_mask: np.ndarray = None):
    if not 0 < masked_lm_prob < 1:
      raise ValueError(f'data.masked_lm_prob={masked_lm_prob} must be in (0, 1); BERT uses '
                       '0.15')
    self.mask_id = mask_id
    self.prob = masked_lm_prob
    self.max_predictions = max_predictions_per_seq
    self.is_special = np.zeros(vocab_size, bool)
    self.is_special[list(special_ids)] = True
    self.replacements = np.flatnonzero(~self.is_special).astype(np.int32)
    self.whole_word = whole_word_masking
    if whole_word_masking and word_start_mask is None:
      raise ValueError('whole-word masking needs the tokenizer\'s word_start_mask()')
    self.word_start = word_start_mask

  def _groups(self, input_ids: np.ndarray, n_real: int) -> List[np.ndarray]:
    """Candidate positions, grouped by word (whole-word masking)."""
    cand = np.flatnonzero(~self.is_special[input_ids[:n_real]])
    if cand.size == 0:
      return []
    starts = self.word_start[input_ids[cand]].copy()
    starts[0] = True
    # A piece continues the previous group only if it directly follows it.
    starts[1:] |= np.diff(cand) != 1
    return np.split(cand, np.flatnonzero(starts)[1:])

  def _choose(self, ids: np.ndarray, n_real: int, num: int, rng) -> np.ndarray:
    """Sorted positions to predict: groups in random order, skipping those that overflow
    (as BERT does). A word of more pieces than max_predictions_per_seq, which no instance
    could choose, is masked piece by piece: to sentencepiece a text without spaces (Chinese,
    Japanese, Thai; a long URL) is one word, where BERT's tokenizer splits CJK characters
    apart."""
    if not self.whole_word:  # every group is one position: the first `num` of the order
      cand = np.flatnonzero(~self.is_special[ids[:n_real]])
      return np.sort(cand[rng.permutation(cand.size)[:num]])
    groups = [part for g in self._groups(ids, n_real)
              for part in (np.split(g, g.size) if g.size > self.max_predictions else [g])]
    chosen, count = [], 0
    for g in rng.permutation(len(groups)):
      if count >= num:
        break
      if count + len(groups[g]) > num:
        continue
      chosen.append(groups[g])
      count += len(groups[g])
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)

  def __call__(self, features: Dict[str, np.ndarray], rng: np.random.Generator):
    ids = features['input_ids']
    n_real = int(features['attention_mask'].sum())
    num_to_predict = min(self.max_predictions, max(1, int(round(n_real * self.prob))))
    positions = self._choose(ids, n_real, num_to_predict, rng)
    labels = ids[positions]
    r = rng.random(len(positions))
    new = np.where(r < 0.8, self.mask_id, labels)
    randomise = r >= 0.9  # 10% random token, the other 10% (0.8 <= r < 0.9) unchanged
    new[randomise] = rng.choice(self.replacements, int(randomise.sum()))
    masked = ids.copy()
    masked[positions] = new
    p = self.max_predictions
    out = dict(features, input_ids=masked)
    out['masked_lm_positions'] = np.zeros(p, np.int32)
    out['masked_lm_ids'] = np.zeros(p, np.int32)
    out['masked_lm_weights'] = np.zeros(p, np.float32)
    out['masked_lm_positions'][:len(positions)] = positions
    out['masked_lm_ids'][:len(positions)] = labels
    out['masked_lm_weights'][:len(positions)] = 1.0
    return out
