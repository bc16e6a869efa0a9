"""GLUE's metrics as the benchmark defines them, computed with scikit-learn and scipy.

  CoLA            Matthews correlation
  MRPC, QQP       F1 of the positive class and accuracy
  STS-B           Pearson and Spearman correlation
  the others      accuracy (MNLI: matched and mismatched separately)
"""

from typing import Dict

import numpy as np
from scipy import stats
from sklearn import metrics as skm

HEADLINE = {'cola': 'mcc', 'mrpc': 'f1', 'qqp': 'f1', 'stsb': 'pearson'}


def glue_metrics(task: str, predictions: np.ndarray, labels: np.ndarray) -> Dict[str, float]:
  """predictions: class ids (or scores for STS-B); labels: gold ids (or scores)."""
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  if task == 'stsb':
    return {'pearson': float(stats.pearsonr(predictions, labels)[0]),
            'spearman': float(stats.spearmanr(predictions, labels)[0])}
  out = {'accuracy': float(skm.accuracy_score(labels, predictions))}
  if task == 'cola':
    out['mcc'] = float(skm.matthews_corrcoef(labels, predictions))
  if task in ('mrpc', 'qqp'):
    out['f1'] = float(skm.f1_score(labels, predictions, zero_division=0.0))
  return out


def headline(task: str, metrics: Dict[str, float]) -> float:
  """The number a GLUE table reports for the task (used to pick the best setting)."""
  return metrics[HEADLINE.get(task, 'accuracy')]
