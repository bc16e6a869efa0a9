"""SQuAD v1.1 / v2.0: examples, windowed features, and n-best span post-processing.

The classic BERT `run_squad` recipe, with the pretraining run's tokenizer:
1. the context is split on whitespace into words, with a char -> word map (so a character
   answer span becomes a word span);
2. each word is tokenised on its own (`tokenizer.encode_words(words)`, one call per context:
   with sentencepiece every word then starts with a '▁' piece, as in the whole text; with
   WordPiece the tokenizers library maps each piece to its word and to its characters in
   the context, through lower-casing and stripped accents), keeping a sub-token -> word map;
3. [CLS] question [SEP] window [SEP], the question cut to max_query_length tokens and the
   context cut into windows of the remaining length that start doc_stride tokens apart; each
   token is scored in the window where it has the most context on both sides;
4. training targets: the answer's sub-token span (WordPiece: the pieces whose characters
   overlap the answer's; sentencepiece: the answer's words narrowed to the tokens whose text
   is the answer, when a word holds more than the answer), or [CLS] (position 0) when the
   answer is outside the window or the question is unanswerable (v2.0);
5. prediction: the n_best_size best start and end logits of every window, valid spans only
   (inside the context, end >= start, at most max_answer_length tokens, start at its max-context
   window), the best span's characters of the context (WordPiece: the offsets of its first
   and last piece; sentencepiece: its words aligned by `final_text`, as BERT does); for
   v2.0 the null score is [CLS]'s start + end logit and the answer is empty when
   null - best span > threshold (the threshold tuned on dev: see finetune_metrics.squad_v2).
"""

import dataclasses
import json
import unicodedata
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from data import sources
from realformer import storage


@dataclasses.dataclass
class Example:
  qid: str
  question: str
  context: str
  words: List[str]             # the context split on whitespace
  answers: List[str]           # every gold answer text ([] when unanswerable)
  answer_text: str = ''        # the training answer (the first gold one)
  start_word: int = -1         # its word span; -1 when unanswerable
  end_word: int = -1
  answer_start: int = -1       # its first character in the context

  @property
  def is_impossible(self) -> bool:
    return not self.answers

  @property
  def aligned(self) -> bool:
    """Whether a training target can be taken: unanswerable, or the first answer (not
    blank) stands at its answer_start in the context."""
    return self.is_impossible or self.start_word >= 0


def _is_whitespace(c: str) -> bool:
  return c in ' \t\r\n' or ord(c) == 0x202F


def split_words(context: str) -> Tuple[List[str], List[int]]:
  """Whitespace words and, for every character, the index of its word."""
  words, char_to_word, new_word = [], [], True
  for c in context:
    if _is_whitespace(c):
      new_word = True
    else:
      if new_word:
        words.append(c)
      else:
        words[-1] += c
      new_word = False
    char_to_word.append(len(words) - 1)
  return words, char_to_word


def make_example(qid: str, question: str, context: str, answers: Sequence[str],
                 answer_starts: Sequence[int]) -> Example:
  """One question; answers/answer_starts are empty for an unanswerable (v2.0) question.
  A first answer that is not at its answer_start, or is blank (no word to point at), leaves
  the example without a training target (`aligned` False): evaluation reads only the
  answers' texts, and featurize leaves such a question out of training, as BERT's run_squad
  does."""
  words, char_to_word = split_words(context)
  ex = Example(qid, question, context, words, list(answers))
  if answers:
    text, start = answers[0], answer_starts[0]
    if context[start:start + len(text)] != text or not text.strip():
      return ex
    ex.answer_text, ex.answer_start = text, start
    # the words of its first and last non-space characters (an answer may start or end
    # with a space: its character there belongs to no word, or to the one before)
    first = next((i for i, c in enumerate(text) if not _is_whitespace(c)), 0)
    last = next((i for i in range(len(text) - 1, -1, -1) if not _is_whitespace(text[i])),
                len(text) - 1)
    ex.start_word = max(char_to_word[start + first], 0)
    ex.end_word = max(char_to_word[start + last], ex.start_word)
  return ex


def read_json(path: str) -> List[Example]:
  """Examples of an official SQuAD JSON file (train-v1.1.json, dev-v2.0.json, ...)."""
  if not storage.path(path).exists():
    raise FileNotFoundError(f'{path} not found; set config.data_dir to the folder holding the '
                            'official SQuAD JSON files, or leave it empty for tfds')
  try:
    data = json.loads(storage.path(path).read_bytes().decode('utf-8'))['data']
  except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8, or no 'data' list
    raise ValueError(f'{path} is not a SQuAD JSON file ({type(e).__name__}: {e}); pass the '
                     'official train/dev JSON files') from None
  examples = []
  where = path
  try:
    for a, article in enumerate(data):
      where = f'{path}: data[{a}]'
      for p, paragraph in enumerate(article['paragraphs']):
        where = f'{path}: data[{a}].paragraphs[{p}]'
        for q, qa in enumerate(paragraph['qas']):
          where = f'{path}: data[{a}].paragraphs[{p}].qas[{q}] (id {qa.get("id")!r})'
          answers = [] if qa.get('is_impossible') else qa['answers']
          examples.append(make_example(qa['id'], qa['question'], paragraph['context'],
                                       [x['text'] for x in answers],
                                       [int(x['answer_start']) for x in answers]))
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise ValueError(f'{where} is malformed ({type(e).__name__}: {e}); SQuAD JSON has '
                     'data[].paragraphs[] with a context and qas[], each with id, question '
                     'and answers [{text, answer_start}] (or is_impossible)') from None
  if not examples:
    raise ValueError(f'{path} holds no questions (data[].paragraphs[].qas[] are empty); pass '
                     'the official train/dev JSON files')
  return examples


_TFDS_OFFLINE = ('pass config.data_dir=<a folder with the official train-v1.1.json and '
                 'dev-v1.1.json (v2.0: train-v2.0.json, dev-v2.0.json)>')


def prepare_tfds(version: str, data_dir: Optional[str] = None) -> None:
  """Downloads and prepares tfds squad/<version> where it is not yet
  (sources.prepare_tfds_task)."""
  sources.prepare_tfds_task(f'squad/{version}', data_dir, _TFDS_OFFLINE)


def read_tfds(version: str, split: str, data_dir: Optional[str] = None) -> List[Example]:
  """Examples of tfds squad/v1.1 or squad/v2.0 ('train' or 'validation')."""
  examples = []
  for ex in sources.load_tfds_task(f'squad/{version}', split, data_dir,
                                   offline=_TFDS_OFFLINE):
    dec = lambda x: x.decode('utf-8')
    answers = ex['answers']
    impossible = bool(ex.get('is_impossible', False))
    texts = [] if impossible else [dec(t) for t in answers['text']]
    starts = [] if impossible else [int(s) for s in answers['answer_start']]
    examples.append(make_example(dec(ex['id']), dec(ex['question']), dec(ex['context']),
                                 texts, starts))
  return examples


def read_hf(version: str, split: str, dataset: str = '') -> List[Example]:
  """Examples of a Hugging Face SQuAD dataset ('train' or 'validation'; `config.data_dir=
  hf:<dataset>`, e.g. hf:rajpurkar/squad or hf:rajpurkar/squad_v2, or a local copy): columns
  id, question, context, answers {text, answer_start} (empty for unanswerable)."""
  from data import sources  # pylint: disable=g-import-not-at-top
  dataset = dataset or ('rajpurkar/squad_v2' if version == 'v2.0' else 'rajpurkar/squad')
  ds = sources.load_hf(dataset, '', split, streaming=False, what='config.data_dir')
  missing = [c for c in ('id', 'question', 'context', 'answers') if c not in ds.column_names]
  if missing:
    raise ValueError(f'hf:{dataset} has no columns {missing} (it has {ds.column_names}); is '
                     'it SQuAD in rajpurkar/squad\'s layout?')
  return [make_example(row['id'], row['question'], row['context'], row['answers']['text'],
                       row['answers']['answer_start']) for row in ds]


# ---------------------------------------------------------------------------- features

@dataclasses.dataclass
class FeatureInfo:
  """What post-processing needs to know about one window."""
  example_index: int
  token_to_word: Dict[int, int]     # feature position -> context word
  max_context: Dict[int, bool]      # feature position -> this window is its best
  # feature position -> its characters [start, end) in the context, for tokenizers that
  # give offsets (WordPiece, through the tokenizers library); None for sentencepiece
  token_to_chars: Optional[Dict[int, Tuple[int, int]]] = None


def _max_context(spans: Sequence[Tuple[int, int]], span_index: int, position: int) -> bool:
  """BERT's _check_is_max_context: the window with the most context around a token wins
  (min of left and right context, plus a small bonus for longer windows)."""
  best, best_index = None, None
  for i, (start, length) in enumerate(spans):
    end = start + length - 1
    if not start <= position <= end:
      continue
    score = min(position - start, end - position) + 0.01 * length
    if best is None or score > best:
      best, best_index = score, i
  return best_index == span_index


def _normalize_text(text: str) -> str:
  return ''.join(text.lower().split())


def _improve_span(ids: List[int], start: int, end: int, tokenizer, answer: str):
  """The narrowest sub-token span inside [start, end] whose text is the answer (a word such
  as '(1858).' holds more than '1858'); compared as decoded text, since '▁' pieces differ."""
  target = _normalize_text(answer)
  for new_start in range(start, end + 1):
    for new_end in range(end, new_start - 1, -1):
      if _normalize_text(tokenizer.decode(ids[new_start:new_end + 1])) == target:
        return new_start, new_end
  return start, end


def word_starts(context: str) -> List[int]:
  """The index in `context` of the first character of each whitespace word."""
  return [i for i, c in enumerate(context)
          if not _is_whitespace(c) and (i == 0 or _is_whitespace(context[i - 1]))]


def _encode_context(ex: Example, tokenizer):
  """(piece ids, each piece's word, each piece's characters [start, end) in the context or
  None): every word tokenised on its own, as BERT does; the characters come from the
  tokenizers library's offsets, which point into the original text whatever the normaliser
  did (lower-casing, stripped accents)."""
  if not hasattr(tokenizer, 'encode_words_with_offsets'):
    return (*tokenizer.encode_words(ex.words), None)
  ids, sub_to_word, offsets = tokenizer.encode_words_with_offsets(ex.words)
  starts = word_starts(ex.context)
  chars = [(starts[w] + a, starts[w] + b) for w, (a, b) in zip(sub_to_word, offsets)]
  # A piece takes the combining marks that follow it (an uncased vocabulary strips them),
  # up to its word's next piece or the word's end, so an answer keeps its trailing accent
  # (BERT's get_final_text keeps the original word's). Other characters the normaliser drops
  # (a zero-width space, a soft hyphen) stay out: the official scores would count them.
  for i, (w, (a, b)) in enumerate(zip(sub_to_word, chars)):
    same_word = i + 1 < len(chars) and sub_to_word[i + 1] == w
    end = chars[i + 1][0] if same_word else starts[w] + len(ex.words[w])
    while b < end and unicodedata.combining(ex.context[b]):
      b += 1
    chars[i] = (a, b)
  return ids, sub_to_word, chars


def _answer_span(ex: Example, doc: List[int], sub_to_word: List[int], chars, tokenizer,
                 word_to_sub: List[int]) -> Tuple[int, int]:
  """The training answer's sub-token span: with offsets, the pieces whose characters overlap
  the answer's (as Hugging Face's run_qa); without, BERT's word span narrowed to the pieces
  whose text is the answer."""
  if chars is not None:
    first, last = ex.answer_start, ex.answer_start + len(ex.answer_text)
    inside = [i for i, (a, b) in enumerate(chars) if a < last and b > first]
    if inside:
      return inside[0], inside[-1]
  start = word_to_sub[ex.start_word]
  end = (word_to_sub[ex.end_word + 1] - 1 if ex.end_word + 1 < len(ex.words)
         else len(doc) - 1)
  return _improve_span(doc, start, end, tokenizer, ex.answer_text)


def _with_training_targets(examples: Sequence[Example]) -> Sequence[Example]:
  """The examples a training target can be taken from: a question whose answer is not at its
  answer_start is left out and counted (BERT's run_squad: "Could not find answer"); none
  left of the answerable ones is an error."""
  misaligned = [ex for ex in examples if not ex.aligned]
  if not misaligned:
    return examples
  answerable = sum(not ex.is_impossible for ex in examples)
  ex = misaligned[0]
  if len(misaligned) == answerable:
    raise ValueError(f'none of the {answerable} answerable training questions has its answer '
                     f'at its answer_start in the context (question {ex.qid}: '
                     f'{ex.answers[0]!r}); is the file SQuAD JSON?')
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.warning('%d of %d answerable training questions have their answer elsewhere than '
                  'at its answer_start (question %s: %r); they are left out of training, as '
                  "BERT's run_squad leaves them out", len(misaligned), answerable, ex.qid,
                  ex.answers[0])
  return [ex for ex in examples if ex.aligned]


def featurize(examples: Sequence[Example], tokenizer, *, max_seq_length: int,
              doc_stride: int, max_query_length: int, training: bool, infos: bool = True
              ) -> Tuple[Dict[str, np.ndarray], List[FeatureInfo]]:
  """Windows of every example -> arrays (input_ids, segment_ids, attention_mask,
  start_positions, end_positions) and one FeatureInfo per window (none with infos=False:
  only post-processing reads them, and SQuAD's 88k training windows would hold gigabytes)."""
  if doc_stride <= 0:
    raise ValueError(f'doc_stride={doc_stride} must be positive')
  if max_seq_length - min(max_query_length, max_seq_length) - 3 <= 0:
    raise ValueError(f'max_seq_length={max_seq_length} leaves no room for the context after '
                     f'max_query_length={max_query_length}; raise it or lower the other')
  shortest = max_seq_length - max_query_length - 3  # the window beside the longest question
  if doc_stride >= shortest:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning('doc_stride=%d is not shorter than a window (%d context tokens beside a '
                    'question of max_query_length=%d): windows do not overlap there, and an '
                    'answer across their boundary is never a target; lower doc_stride (BERT: '
                    '128 at max_seq_length 384)', doc_stride, shortest, max_query_length)
  want_infos, rows, infos = infos, [], []
  if training:
    examples = _with_training_targets(examples)
  for example_index, ex in enumerate(examples):
    query = tokenizer.encode(ex.question)[:max_query_length]
    max_window = max_seq_length - len(query) - 3  # run_squad's max_tokens_for_doc
    doc, sub_to_word, chars = _encode_context(ex, tokenizer)
    pieces_per_word = np.bincount(np.asarray(sub_to_word, np.int64), minlength=len(ex.words))
    word_to_sub = np.concatenate([[0], np.cumsum(pieces_per_word)[:-1]]).tolist()
    answer_span = None
    if training and not ex.is_impossible:
      answer_span = _answer_span(ex, doc, sub_to_word, chars, tokenizer, word_to_sub)
    spans, offset = [], 0
    while True:
      length = min(len(doc) - offset, max_window)
      spans.append((offset, length))
      if offset + length >= len(doc):
        break
      offset += min(length, doc_stride)
    for span_index, (offset, length) in enumerate(spans):
      ids = [tokenizer.cls_id] + query + [tokenizer.sep_id]
      segments = [0] * len(ids)
      token_to_word, max_context = {}, {}
      token_to_chars = None if chars is None else {}
      for i in range(length):
        if want_infos:
          token_to_word[len(ids)] = sub_to_word[offset + i]
          max_context[len(ids)] = _max_context(spans, span_index, offset + i)
          if chars is not None:
            token_to_chars[len(ids)] = chars[offset + i]
        ids.append(doc[offset + i])
      ids.append(tokenizer.sep_id)
      segments += [1] * (length + 1)
      start_position = end_position = 0
      if answer_span is not None:
        start, end = answer_span
        if offset <= start and end < offset + length:
          start_position = start - offset + len(query) + 2
          end_position = end - offset + len(query) + 2
      rows.append((ids, segments, start_position, end_position))
      if want_infos:
        infos.append(FeatureInfo(example_index, token_to_word, max_context, token_to_chars))
  n = len(rows)
  arrays = {'input_ids': np.full((n, max_seq_length), tokenizer.pad_id, np.int32),
            'segment_ids': np.zeros((n, max_seq_length), np.int32),
            'attention_mask': np.zeros((n, max_seq_length), np.int32),
            'start_positions': np.zeros((n,), np.int32),
            'end_positions': np.zeros((n,), np.int32)}
  for i, (ids, segments, start, end) in enumerate(rows):
    arrays['input_ids'][i, :len(ids)] = ids
    arrays['segment_ids'][i, :len(ids)] = segments
    arrays['attention_mask'][i, :len(ids)] = 1
    arrays['start_positions'][i], arrays['end_positions'][i] = start, end
  return arrays, infos


# ---------------------------------------------------------------------------- predictions

def final_text(predicted: str, original: str) -> str:
  """The characters of `original` (whitespace words of the context) that the decoded tokens
  `predicted` stand for: BERT's get_final_text, aligning the two with case and spaces
  ignored; `original` itself when they cannot be aligned (e.g. normalised characters)."""
  kept = [i for i, c in enumerate(original) if not c.isspace()]
  squeezed = ''.join(original[i] for i in kept).lower()
  target = _normalize_text(predicted)
  if len(squeezed) != len(''.join(original.split())):  # lower() changed the length
    return original
  start = squeezed.find(target) if target else -1
  if start < 0:
    return original
  return original[kept[start]:kept[start + len(target) - 1] + 1]


def _top_indices(logits: np.ndarray, n: int) -> List[int]:
  return list(np.argsort(-logits, kind='stable')[:n])


# The null-score difference of a question whose windows hold no valid span.
NO_SPAN = 1e30


def postprocess(examples: Sequence[Example], infos: Sequence[FeatureInfo],
                features: Dict[str, np.ndarray], start_logits: np.ndarray,
                end_logits: np.ndarray, tokenizer, *, n_best_size: int = 20,
                max_answer_length: int = 30, version_2: bool = False
                ) -> Tuple[Dict[str, str], Dict[str, float]]:
  """Answer text per question id, and (v2.0) the null score minus the best span's score
  (the official script's "na_prob": answer empty when it exceeds the threshold)."""
  by_example = {}
  for f, info in enumerate(infos):
    by_example.setdefault(info.example_index, []).append(f)
  answers, null_diff = {}, {}
  for example_index, ex in enumerate(examples):
    candidates, null_score = [], None
    for f in by_example.get(example_index, []):
      info, s_logits, e_logits = infos[f], start_logits[f], end_logits[f]
      if version_2:
        score = float(s_logits[0] + e_logits[0])
        null_score = score if null_score is None else min(null_score, score)
      for s in _top_indices(s_logits, n_best_size):
        for e in _top_indices(e_logits, n_best_size):
          if (s not in info.token_to_word or e not in info.token_to_word or e < s or
              e - s + 1 > max_answer_length or not info.max_context.get(s, False)):
            continue
          candidates.append((float(s_logits[s] + e_logits[e]), f, s, e))
    candidates.sort(key=lambda c: -c[0])
    best_text, best_score, seen = None, None, set()
    for score, f, s, e in candidates:
      info = infos[f]
      if info.token_to_chars is not None:  # the context's own characters, exactly
        text = ex.context[info.token_to_chars[s][0]:info.token_to_chars[e][1]]
      else:
        predicted = tokenizer.decode(features['input_ids'][f, s:e + 1].tolist())
        original = ' '.join(ex.words[info.token_to_word[s]:info.token_to_word[e] + 1])
        text = final_text(predicted, original)
      if text in seen:
        continue
      seen.add(text)
      if best_text is None:
        best_text, best_score = text, score
      if len(seen) >= n_best_size:
        break
    if version_2:
      # no span at all: the empty answer whatever the threshold (finite, for strict JSON)
      diff = null_score - best_score if best_score is not None else NO_SPAN
      null_diff[ex.qid] = diff
    answers[ex.qid] = best_text or ''
  return answers, null_diff


def apply_null_threshold(answers: Dict[str, str], null_diff: Dict[str, float],
                         threshold: float) -> Dict[str, str]:
  """v2.0: the empty answer where null score - best span score > threshold."""
  return {q: '' if null_diff.get(q, -np.inf) > threshold else a for q, a in answers.items()}
