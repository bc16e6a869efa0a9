r"""Attention analysis of pretraining checkpoints (entropy per layer, JS divergence across layers).

  python analyze.py --workdir /tmp/study/compare/model.variant=postln,seed=0 \
      --workdir /tmp/study/compare/model.variant=realformer,seed=0 --out /tmp/attention

Workdirs and --out may be gs:// URLs. A sweep's root (sweep.py's, a study part's) given as a
--workdir stands for its runs that hold a checkpoint, in its folders' order.

Writes attention_entropy.png (violins per layer), attention_entropy_heads.png (each layer's
heads ordered by median, as the paper's Figure 4), attention_js.png (layer x layer JS
divergence), attention.json and attention.md (with each layer's mixture weights for a
Synthesizer mixture), and attention_random.png for a Synthesizer with a Random table (each
layer's learned table as attention, as the paper draws it). Runs of one tokenizer and length
are analysed on the same held-out examples (the first such run's); the report says which
text each was (how many examples, their length, a CRC32 of their token ids). See
realformer/tools/analysis.py for the definitions.
"""

import sys

from absl import flags

from realformer import cli
from realformer import storage
from realformer.tools import analysis
from realformer.train import checkpoints
from realformer.train.run_dir import RunDir


def _define(f):
  flags.DEFINE_multi_string('workdir', None, 'a pretraining workdir (its newest checkpoint), '
                            'one of its checkpoints/<step> folders, or an encoder folder '
                            '(best/, final/, an import), or a sweep\'s root (its runs); '
                            'repeat for several', flag_values=f,
                            required=True)
  flags.DEFINE_multi_string('label', None, 'one per run (a --workdir, or each run of a '
                            'sweep\'s root)', flag_values=f)
  flags.DEFINE_string('out', None, 'the report folder', flag_values=f, required=True)
  flags.DEFINE_integer('num_examples', 32, 'held-out examples per run', lower_bound=1,
                       flag_values=f)


def _sweep_runs(root: str):
  """The runs of a sweep's root that hold a complete checkpoint (said on stderr: those that
  hold none yet), or None where `root` holds no sweep's runs (overrides.json)."""
  runs = sorted((p for p in storage.path(root).iterdir() if (p / RunDir.OVERRIDES).exists()),
                key=lambda p: p.name)
  if not runs:
    return None
  ready = [str(p) for p in runs if checkpoints.complete_steps(str(p))]
  if len(ready) < len(runs):
    print(f'{root}: {len(runs) - len(ready)} of its {len(runs)} runs hold no checkpoint yet, '
          'left out', file=sys.stderr)
  if not ready:
    raise FileNotFoundError(f'no run of the sweep {root} holds a checkpoint yet; analyse it '
                            'once its runs have saved one')
  return ready


def main(argv=None):
  args, _ = cli.parse_tool_flags(_define, argv, prog='analyze.py', doc=__doc__)
  args.workdir = [run for w in args.workdir for run in (
      storage.path(w).is_dir() and not (storage.path(w) / RunDir.CONFIG).exists()
      and _sweep_runs(w) or [w])]
  if args.label and len(args.label) != len(args.workdir):
    raise ValueError(f'give one --label per run (or none): {len(args.label)} for '
                     f'{len(args.workdir)} runs')
  if args.label and len(set(args.label)) != len(args.label):
    raise ValueError(f'--label {args.label}: the labels repeat one; give each --workdir its own')
  out = storage.path(args.out)
  if out.exists() and not out.is_dir():
    raise ValueError(f'--out {args.out} is a file; give a folder for the report')
  for w in args.workdir:
    if not storage.path(w).is_dir():
      raise FileNotFoundError(f'--workdir {w} does not exist: pass the --workdir of a train.py '
                              'run')
    if checkpoints.owning_run(storage.path(w)) is not None:
      continue  # a run's checkpoints, or one step of them: its config is the run's
    if not (storage.path(w) / RunDir.CONFIG).exists():
      runs = sorted(p.name for p in storage.path(w).iterdir()
                    if (p / RunDir.CONFIG).exists())
      inside = f' (a sweep\'s root? its runs are folders such as {w}/{runs[0]})' if runs else ''
      raise FileNotFoundError(f'{w} has no config.json{inside}: pass the --workdir of a '
                              'train.py run')
  results = analysis.analyze_runs(args.workdir, args.num_examples)
  analysis.write_report(results, args.out, args.label)
  print((out / 'attention.md').read_text())


if __name__ == '__main__':
  cli.run_main(main)
