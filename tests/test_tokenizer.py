"""data.tokenizer: BERT's special ids, byte fallback, whole-word starts, training (long
lines split, not dropped), and the errors for vocabularies that are missing or malformed."""

import gzip
import itertools
import unicodedata

import ml_collections
import numpy as np
import pytest
import sentencepiece as spm

from data import sources
from data import tokenizer as tokenizer_lib

SPECIALS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']


@pytest.fixture(scope='module')
def tok():
  return tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)


@pytest.fixture(scope='module')
def corpus_lines():
  docs = itertools.islice(sources.iter_documents('embedded'), 100, 104)  # 1880s speeches
  return [s for doc in docs for s in doc]


def test_embedded_tokenizer_has_bert_special_ids(tok):
  assert tok.vocab_size == 8000
  assert [tok.id_to_piece(i) for i in range(5)] == SPECIALS
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
  assert tok.special_ids == frozenset(range(5))
  assert tok.path == tokenizer_lib.EMBEDDED_TOKENIZER
  # Text never encodes to a special token: "[MASK]" in a sentence is just characters.
  assert not set(tok.encode('[CLS] a [MASK] b [SEP] [PAD]')) & tok.special_ids
  config = ml_collections.ConfigDict({'tokenizer': ''})
  assert tokenizer_lib.load_for_config(config).path == tokenizer_lib.EMBEDDED_TOKENIZER


def test_real_sentences_round_trip_uncased_without_unknowns(tok, corpus_lines):
  assert len(corpus_lines) > 300
  for sentence in corpus_lines:
    ids = tok.encode(sentence)
    assert tok.unk_id not in ids
    # What nmt_nfkc_cf does: NFKC, case folding, control characters dropped (the 1880s
    # speeches hold a stray \x02), whitespace runs collapsed.
    expected = ''.join(c for c in unicodedata.normalize('NFKC', sentence).lower()
                       if unicodedata.category(c) != 'Cc')
    assert tok.decode(ids) == ' '.join(expected.split())


def test_batch_and_word_encodings_equal_one_by_one(tok, corpus_lines):
  lines = corpus_lines[:200]
  assert tok.encode_batch(lines) == [tok.encode(line) for line in lines]
  words = ' '.join(lines[:5]).split()
  ids, word_index = tok.encode_words(words)
  per_word = [tok.encode(w) for w in words]
  assert ids == [i for p in per_word for i in p]
  assert word_index == [w for w, p in enumerate(per_word) for _ in p]


def test_curly_quotes_accents_and_emoji_fall_back_to_bytes(tok):
  text = ('The \u201cUnion\u201d is the President\u2019s \u2014 caf\u00e9 \u00c5land \u2603 '
          '\U0001f1fa\U0001f1f8.')
  ids = tok.encode(text)
  assert tok.unk_id not in ids
  assert any(tok.id_to_piece(i).startswith('<0x') for i in ids)  # bytes, not [UNK]
  assert tok.decode(ids) == text.lower()


def test_word_start_mask(tok, corpus_lines):
  starts = tok.word_start_mask()
  assert starts.shape == (tok.vocab_size,) and starts.dtype == bool
  assert starts[list(tok.special_ids)].all()
  pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
  byte_ids = [i for i, p in enumerate(pieces) if p.startswith('<0x') and p.endswith('>')]
  assert len(byte_ids) == 256 and not starts[byte_ids].any()
  assert starts[tok.encode('the')[0]] and tok.id_to_piece(tok.encode('the')[0]) == '\u2581the'
  # Exactly one word start per whitespace-separated word, also where a word falls back to
  # bytes (its first piece is the bare '\u2581').
  for sentence in corpus_lines[:200] + ['Its \u201cnaïveté\u201d \u2603 unconstitutionality']:
    ids = np.array(tok.encode(sentence))
    assert starts[ids].sum() == len(sentence.split()), sentence
    assert starts[ids[0]]
  ids = tok.encode('unconstitutionality')
  assert len(ids) > 1 and starts[ids[0]] and not starts[ids[1:]].any()


def test_split_long_line_keeps_everything_within_the_limit(corpus_lines):
  limit = tokenizer_lib.MAX_SENTENCE_BYTES
  assert tokenizer_lib.split_long_line('Short. Line.') == ['Short. Line.']
  paragraph = ' '.join(corpus_lines[:80])
  parts = tokenizer_lib.split_long_line(paragraph)
  assert len(paragraph.encode()) > limit and len(parts) > 1
  assert ' '.join(parts).split() == paragraph.split()
  assert all(len(p.encode()) <= limit for p in parts)
  assert set(parts) <= set(corpus_lines)  # at sentence boundaries first
  # No sentence boundary: at whitespace; one giant word: cut, never inside a character.
  no_stop = ' '.join(['word'] * 3000)
  parts = tokenizer_lib.split_long_line(no_stop)
  assert ' '.join(parts) == no_stop and all(len(p.encode()) <= limit for p in parts)
  giant = 'a ' + '\u00e9\u2603' * 2000 + ' b'
  parts = tokenizer_lib.split_long_line(giant, max_bytes=1000)
  assert ''.join(parts).replace(' ', '') == giant.replace(' ', '')
  assert all(len(p.encode()) <= 1000 for p in parts)


def test_training_streams_splits_long_lines_and_keeps_special_ids(corpus_lines, tmp_path):
  # A word that only the over-long line holds: sentencepiece would skip that line silently.
  long_line = ' '.join(['zqxjvwk'] * 700)
  assert len(long_line.encode()) > tokenizer_lib.MAX_SENTENCE_BYTES
  lines = iter(corpus_lines[:300] + [long_line, ''])  # a generator, streamed
  stats = tokenizer_lib.train_sentencepiece(lines, str(tmp_path / 'sp'), 400)
  assert stats['long_lines_split'] == 1 and stats['sentences'] == 302
  tok = tokenizer_lib.Tokenizer.load(str(tmp_path / 'sp.model'))
  assert tok.vocab_size == 400
  assert [tok.id_to_piece(i) for i in range(5)] == SPECIALS
  assert tok.encode('zqxjvwk') != [tok.unk_id] and len(tok.encode('zqxjvwk')) == 1
  assert tok.decode(tok.encode('The Congress')) == 'the congress'  # uncased

  # Files (gzip and plain) through the command line; --cased keeps case.
  with gzip.open(tmp_path / 'a.txt.gz', 'wt') as f:
    f.write('\n'.join(corpus_lines[:150]) + '\n\n')
  (tmp_path / 'b.txt').write_text('\n'.join(corpus_lines[150:300]) + '\n')
  tokenizer_lib.main(['--input', str(tmp_path / 'a.txt.gz'), str(tmp_path / 'b.txt'),
                      '--model_prefix', str(tmp_path / 'cased'), '--vocab_size', '500',
                      '--cased'])
  cased = tokenizer_lib.Tokenizer.load(str(tmp_path / 'cased.model'))
  assert cased.decode(cased.encode('The Congress')) == 'The Congress'
  with pytest.raises(SystemExit):
    tokenizer_lib.main(['--input', str(tmp_path / 'none.txt'), '--model_prefix', 'x'])
  with pytest.raises(ValueError, match='vocab_size=5000 is too large for this text'):
    tokenizer_lib.train_sentencepiece(corpus_lines[:50], str(tmp_path / 'big'), 5000)


def test_vocabularies_without_bert_specials_are_clear_errors(corpus_lines, tmp_path):
  spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines[:300]),
                                 model_prefix=str(tmp_path / 'plain'), vocab_size=300,
                                 minloglevel=2)
  with pytest.raises(ValueError, match=r'does not have \[PAD\] at id 0; retrain it with '
                     r'`python -m data.tokenizer`.*it has no \[PAD\]'):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'plain.model'))
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus_lines[:300]), model_prefix=str(tmp_path / 'swapped'),
      vocab_size=300, pad_id=0, pad_piece='[PAD]', unk_id=1, unk_piece='[UNK]', bos_id=-1,
      eos_id=-1, control_symbols=['[SEP]', '[CLS]', '[MASK]'], minloglevel=2)
  with pytest.raises(ValueError, match=r'does not have \[CLS\] at id 2.*\[CLS\] is at id 3'):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'swapped.model'))
  with pytest.raises(FileNotFoundError, match='config.data.tokenizer'):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'missing.model'))
  (tmp_path / 'junk.model').write_bytes(b'not a model')
  with pytest.raises(ValueError, match='is not a sentencepiece model'):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'junk.model'))
  (tmp_path / 'wp').mkdir()  # `python -m data.tokenizer --model_type wordpiece`'s folder
  with pytest.raises(ValueError, match='is a folder; give a sentencepiece .model or a '):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'wp'))
  (tmp_path / 'wp' / 'vocab.txt').write_text('\n'.join(SPECIALS) + '\n')
  with pytest.raises(ValueError, match=f'is a folder; give the WordPiece vocabulary in it: '
                                       f'config.data.tokenizer={tmp_path}/wp/vocab.txt'):
    tokenizer_lib.Tokenizer.load(str(tmp_path / 'wp') + '/')


def test_vocab_txt_dispatches_to_wordpiece(tmp_path):
  wordpiece = pytest.importorskip('data.wordpiece')
  vocab = SPECIALS + ['the', 'union', '##s', '.']
  (tmp_path / 'vocab.txt').write_text('\n'.join(vocab) + '\n')
  tok = tokenizer_lib.Tokenizer.load(str(tmp_path / 'vocab.txt'))
  assert isinstance(tok, wordpiece.WordPieceTokenizer)
  assert tok.vocab_size == len(vocab) and tok.mask_id == 4
  assert tok.encode('The unions.') == [5, 6, 7, 8]


def test_training_inputs_that_cannot_train_are_one_line_before_training(tmp_path):
  """No sentences (an empty file, one that is not UTF-8), a vocab_size below what the text's
  characters need, and a path that is no file (never trained on as a sentence): ValueError /
  FileNotFoundError with the fix, for both trainers."""
  empty, latin1 = tmp_path / 'empty.txt', tmp_path / 'latin1.txt'
  empty.write_text('')
  latin1.write_bytes('caf\xe9 cr\xe8me\n'.encode('latin-1'))
  for trainer in (lambda i: tokenizer_lib.train_sentencepiece(i, str(tmp_path / 'sp'), 300),
                  lambda i: tokenizer_lib.train_wordpiece(i, str(tmp_path / 'wp'), 300)):
    with pytest.raises(ValueError, match=r'^no sentences to train the tokenizer on \(1 empty_files\); check'):
      trainer(str(empty))
    with pytest.raises(ValueError, match=r'no sentences .* non_utf8_lines'):
      trainer(str(latin1))
    for missing in (str(tmp_path / 'no_such.txt'), [str(empty), str(tmp_path / 'gone.txt')]):
      with pytest.raises(FileNotFoundError, match=r'input files not found: .*(no_such|gone)'):
        trainer(missing)
  # A list of sentences (none of them a file), even of one, is trained on as sentences.
  assert tokenizer_lib.train_wordpiece(['one short sentence'], str(tmp_path / 'one'), 100)[
      'sentences'] == 1
  text = tmp_path / 'text.txt'
  text.write_text('\n'.join(f'sentence number {i} of a small text, with {chr(97 + i % 26)}'
                            for i in range(200)))
  with pytest.raises(ValueError, match=r'vocab_size=100 is too small for this text .*; give a '
                                       r'larger vocab_size'):
    tokenizer_lib.train_sentencepiece(str(text), str(tmp_path / 'small'), 100)
