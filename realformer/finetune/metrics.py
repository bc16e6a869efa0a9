"""GLUE's metrics as the benchmark defines them, computed with scikit-learn and scipy
(accuracy with NumPy).

  CoLA            Matthews correlation
  MRPC, QQP       F1 of the positive class and accuracy
  STS-B           Pearson and Spearman correlation
  the others      accuracy (MNLI: matched and mismatched separately)
  SQuAD           exact match and token F1 (v2.0: with the no-answer threshold tuned on dev)
  NER             entity precision, recall and F1 as conlleval.pl counts them (CoNLL-2003),
                  and the words' accuracy

A GLUE task's headline (what picks best/ and the best grid setting) is its `metric` in
data/glue.TASKS, the one place a task names it: the number the BERT paper's GLUE table
(Table 1) reports, MCC for CoLA, F1 for MRPC and QQP, Spearman for STS-B, accuracy elsewhere
(the GLUE leaderboard's score averages the two of MRPC, QQP and STS-B; results.json has both).
"""

import collections
import math
import re
import string
from typing import Dict, List, Optional

import numpy as np

from data import conll
from data import glue

SQUAD_HEADLINE = {'squad/v1.1': 'f1', 'squad/v2.0': 'best_f1'}


def _skm():
  """sklearn.metrics, imported when a task's metric needs it: it takes 2.3 s, which a task
  scored by accuracy alone (most of GLUE) does not pay."""
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  return metrics


# The metrics a classification task may name as its headline, by data/glue's names
# (CLASSIFICATION_METRICS: the same, in this order); accuracy is always reported too. A
# regression reports both of glue.REGRESSION_METRICS (glue_metrics).
CLASSIFICATION = {
    'accuracy': lambda labels, predictions: np.mean(np.asarray(labels) ==
                                                    np.asarray(predictions)),
    'mcc': lambda labels, predictions: _skm().matthews_corrcoef(labels, predictions),
    'f1': lambda labels, predictions: _skm().f1_score(labels, predictions,
                                                      zero_division=0.0),
    'macro_f1': lambda labels, predictions: _skm().f1_score(labels, predictions,
                                                            average='macro', zero_division=0.0),
}


def glue_metrics(task, predictions: np.ndarray, labels: np.ndarray) -> Dict[str, float]:
  """task: a GLUE task's name, or a glue.Task (glue.local_task). predictions: class ids (or
  scores for a regression task); labels: gold ids (or scores). Accuracy and the task's
  headline metric, each beside the majority baseline's (`majority_<metric>`: of always
  predicting the most frequent of these labels, as pretraining's evaluations report theirs:
  MRPC's F1 of 0.81 is that predictor's); Pearson and Spearman for a regression task."""
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  spec = glue.get_task(task)
  if not spec.labels:
    from scipy import stats  # pylint: disable=g-import-not-at-top
    return {'pearson': float(stats.pearsonr(predictions, labels)[0]),
            'spearman': float(stats.spearmanr(predictions, labels)[0])}
  names = dict.fromkeys(('accuracy', spec.metric))
  values, counts = np.unique(labels, return_counts=True)
  majority = np.full_like(labels, values[counts.argmax()] if labels.size else 0)
  return {**{name: float(CLASSIFICATION[name](labels, predictions)) for name in names},
          **{f'majority_{name}': float(CLASSIFICATION[name](labels, majority))
             for name in names}}


def headline(task, metrics: Dict[str, float]) -> float:
  """The number a GLUE table reports for the task (a name, or a glue.Task), from its dev
  metrics (used to pick the best; SQuAD's: SQUAD_HEADLINE)."""
  return metrics[glue.get_task(task).metric]


# ---------------------------------------------------------------------------- SQuAD
# The official evaluation scripts (evaluate-v1.1.py, evaluate-v2.0.py), reimplemented: the
# same normalisation, token F1, max over gold answers, and for v2.0 the no-answer handling
# and the threshold search. Scores are percentages, as the scripts print them.

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
  """Lower case, drop punctuation, drop the articles a/an/the, squeeze whitespace."""
  text = ''.join(c for c in text.lower() if c not in _PUNCTUATION)
  text = re.sub(r'\b(a|an|the)\b', ' ', text)
  return ' '.join(text.split())


def exact_match(prediction: str, gold: str) -> float:
  return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str, *, empty_matches_empty: bool = False) -> float:
  """F1 of the normalised tokens. v1.1 scores empty vs empty as 0; v2.0 (empty_matches_empty)
  scores an empty side as 1 when both are empty, else 0."""
  pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
  if empty_matches_empty and (not pred or not ref):
    return float(pred == ref)
  same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred), same / len(ref)
  return 2 * precision * recall / (precision + recall)


def squad_v1(golds: Dict[str, List[str]], predictions: Dict[str, str]) -> Dict[str, float]:
  """evaluate-v1.1.py: mean over questions of the max over gold answers (a question without
  a prediction counts 0)."""
  em = f1 = 0.0
  for qid, answers in golds.items():
    if qid in predictions:
      em += max(exact_match(predictions[qid], a) for a in answers)
      f1 += max(token_f1(predictions[qid], a) for a in answers)
  return {'exact_match': 100.0 * em / len(golds), 'f1': 100.0 * f1 / len(golds)}


def _best_threshold(scores, na_probs, has_answer, predictions):
  """evaluate-v2.0.py's find_best_thresh: sweep the threshold over the sorted na_probs.

  Its starting point is every answer nulled, which the script reports as threshold 0.0 (below
  every probability it was written for); here na_probs are score differences, which may be
  negative, so that point is reported as just below the lowest of them: applied, the
  threshold nulls every answer, as the score it goes with assumed."""
  current = best = sum(1 for q in scores if not has_answer[q])
  best_threshold = math.nextafter(min((na_probs[q] for q in scores), default=0.0), -math.inf)
  for qid in sorted(na_probs, key=lambda q: na_probs[q]):
    if qid not in scores:
      continue
    if has_answer[qid]:
      current += scores[qid]
    elif predictions[qid]:
      current -= 1
    if current > best:
      best, best_threshold = current, na_probs[qid]
  return 100.0 * best / len(scores), best_threshold


def squad_v2(golds: Dict[str, List[str]], predictions: Dict[str, str],
             na_probs: Optional[Dict[str, float]] = None,
             na_prob_thresh: float = 1.0) -> Dict[str, float]:
  """evaluate-v2.0.py. golds: answer texts per question ([] = unanswerable); na_probs: the
  no-answer score per question (here: null score - best span score). Returns exact, f1,
  HasAns_/NoAns_ breakdowns and, with na_probs, best_exact/best_f1 and their thresholds."""
  has_answer, exact, f1 = {}, {}, {}
  for qid, answers in golds.items():
    has_answer[qid] = bool(answers)  # as the script: a listed answer, even one normalised away
    answers = [a for a in answers if normalize_answer(a)] or ['']
    if qid not in predictions:
      continue
    exact[qid] = max(exact_match(predictions[qid], a) for a in answers)
    f1[qid] = max(token_f1(predictions[qid], a, empty_matches_empty=True) for a in answers)
  na_probs = na_probs if na_probs is not None else {q: 0.0 for q in golds}

  def thresholded(raw):
    return {q: float(not has_answer[q]) if na_probs[q] > na_prob_thresh else s
            for q, s in raw.items()}

  out = {}
  for name, raw in (('exact', exact), ('f1', f1)):
    scores = thresholded(raw)
    out[name] = 100.0 * sum(scores.get(q, 0.0) for q in golds) / len(golds)
    for prefix, keep in (('HasAns', True), ('NoAns', False)):
      qids = [q for q in golds if has_answer[q] == keep]
      if qids:
        out[f'{prefix}_{name}'] = 100.0 * sum(scores.get(q, 0.0) for q in qids) / len(qids)
    # The official script ranks questions without predictions as well; they score 0.
    full = {q: raw.get(q, 0.0) for q in golds}
    preds = {q: predictions.get(q, '') for q in golds}
    out[f'best_{name}'], out[f'best_{name}_thresh'] = _best_threshold(
        full, na_probs, has_answer, preds)
  out['total'] = len(golds)
  return out


def entity_scores(golds: List[List[str]], predictions: List[List[str]]) -> Dict[str, float]:
  """CoNLL-2003's scores, as conlleval.pl computes them: an entity (data/conll.chunks) is
  found when the prediction has one of the same type, start and end; precision over the
  predicted entities, recall over the gold ones, F1 their harmonic mean (0 where there are
  none); accuracy over the words; and each entity type's F1 (f1_<type>)."""
  gold_chunks = [set(conll.chunks(t)) for t in golds]
  pred_chunks = [set(conll.chunks(t)) for t in predictions]
  kinds = sorted({c[0] for s in gold_chunks + pred_chunks for c in s})

  def f1(keep):
    correct = sum(len({c for c in g & p if keep(c)}) for g, p in zip(gold_chunks, pred_chunks))
    found = sum(len([c for c in p if keep(c)]) for p in pred_chunks)
    gold = sum(len([c for c in g if keep(c)]) for g in gold_chunks)
    precision = correct / found if found else 0.0
    recall = correct / gold if gold else 0.0
    score = 2 * precision * recall / (precision + recall) if correct else 0.0
    return precision, recall, score

  precision, recall, score = f1(lambda c: True)
  words = [(g, p) for gs, ps in zip(golds, predictions) for g, p in zip(gs, ps)]
  out = {'precision': precision, 'recall': recall, 'f1': score,
         'accuracy': float(np.mean([g == p for g, p in words])) if words else 0.0}
  for kind in kinds:
    out[f'f1_{kind}'] = f1(lambda c, kind=kind: c[0] == kind)[2]
  return out
