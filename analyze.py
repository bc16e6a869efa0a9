r"""Attention analysis of pretraining checkpoints (entropy per layer, JS divergence across layers).

  python analyze.py --workdir /tmp/study/model.variant=postln,seed=0 \
      --workdir /tmp/study/model.variant=realformer,seed=0 --out /tmp/study/attention

Writes attention_entropy.png (violins per layer), attention_js.png (layer x layer JS
divergence), attention.json and attention.md. See realformer/tools/analysis.py for the definitions.
"""

import os

from realformer import cli
from realformer.tools import analysis


def main(argv=None):
  p = cli.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', action='append', required=True, help='a pretraining workdir')
  p.add_argument('--label', action='append', default=None, help='one per --workdir')
  p.add_argument('--out', required=True)
  p.add_argument('--num_examples', type=int, default=32)
  args = p.parse_args(argv)
  if args.label and len(args.label) != len(args.workdir):
    raise ValueError('give one --label per --workdir (or none)')
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    raise ValueError(f'--out {args.out} is a file; give a folder for the report')
  for w in args.workdir:
    if not os.path.exists(os.path.join(w, 'config.json')):
      raise FileNotFoundError(f'{w} has no config.json: pass the --workdir of a train.py run')
  results = [analysis.analyze_run(w, args.num_examples) for w in args.workdir]
  analysis.write_report(results, args.out, args.label)
  with open(f'{args.out}/attention.md') as f:
    print(f.read())


if __name__ == '__main__':
  cli.run_main(main)
