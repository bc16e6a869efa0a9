r"""The peer's learning curve on our batches: transformers' BertForPreTraining, trained in
PyTorch on exactly the batches a train.py run saw, beside that run's own eval MLM loss.

  python train.py --workdir /tmp/curve --config.train.num_steps=1500 \
      --config.optimizer.warmup_steps=300 --config.train.eval_every_steps=500
  python benchmarks/hf_pretraining_curve.py --workdir /tmp/curve

The HF model gets the run's sizes, vocabulary, dropout, batch, AdamW settings (no decay on
biases and LayerNorm weights, global-norm clipping, eps), linear warm-up and decay, and reads
the run's prepared shards through our pipeline with the run's seed: the same examples and
masks, step by step, and the same held-out batches at each evaluation. Only the initial
weights and the dropout draws differ, so the two curves should agree within seed noise
(tests/test_train.py pins single steps exactly, without dropout). Post-LN runs only.
Results: BENCHMARKS.md ("Fine-tuning: pretrained vs random initialisation").
"""

import argparse
import os
import sys
import time

import ml_collections
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import pipeline  # pylint: disable=g-import-not-at-top
from data import tokenizer as tokenizer_lib
from realformer.train import checkpoints
from realformer.train import metrics_jsonl
from realformer.train import train_lib


def hf_model(model_config, transformers):
  if model_config.variant != 'postln':
    raise SystemExit(f'--workdir trained {model_config.variant!r}; HF BERT is Post-LN only')
  return transformers.BertForPreTraining(transformers.BertConfig(
      vocab_size=model_config.vocab_size, hidden_size=model_config.hidden_size,
      num_hidden_layers=model_config.num_layers, num_attention_heads=model_config.num_heads,
      intermediate_size=model_config.mlp_dim, max_position_embeddings=model_config.max_len,
      type_vocab_size=model_config.type_vocab_size, layer_norm_eps=model_config.layer_norm_eps,
      initializer_range=model_config.initializer_range,
      hidden_dropout_prob=model_config.dropout_rate,
      attention_probs_dropout_prob=model_config.attention_dropout_rate))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', required=True, help='a finished or running train.py workdir')
  p.add_argument('--steps', type=int, default=0, help='stop early (0: the run\'s num_steps)')
  p.add_argument('--threads', type=int, default=os.cpu_count())
  args = p.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)
  c = ml_collections.ConfigDict(checkpoints.read_config(args.workdir))
  tc, opt = c.train, c.optimizer
  warmup = train_lib.warmup_steps(opt, tc.num_steps)
  if opt.schedule != 'linear' or c.data.sources == 'synthetic' or not tc.eval_steps:
    raise SystemExit(f'{args.workdir}: needs a run with the linear schedule, real data and '
                     f'held-out evaluation (it has optimizer.schedule={opt.schedule!r}, '
                     f'data.sources={c.data.sources!r}, train.eval_steps={tc.eval_steps})')
  tokenizer = tokenizer_lib.load_for_config(c.data)
  prepared = c.data.prepared_dir or os.path.join(args.workdir, 'data')
  batches = lambda split: pipeline.make_pretraining_iterator(
      c.data, tokenizer, prepared, split=split, global_batch_size=tc.batch_size, seed=c.seed)
  torch.manual_seed(c.seed)
  model = hf_model(c.model, transformers)
  no_decay = lambda name: name.endswith('bias') or 'LayerNorm' in name
  named = list(model.named_parameters())
  optimizer = torch.optim.AdamW(
      [{'params': [q for n, q in named if not no_decay(n)], 'weight_decay': opt.weight_decay},
       {'params': [q for n, q in named if no_decay(n)], 'weight_decay': 0.0}],
      lr=opt.learning_rate, betas=(opt.b1, opt.b2), eps=opt.eps)
  schedule = transformers.get_linear_schedule_with_warmup(optimizer, warmup,
                                                          tc.num_steps)
  vocab = c.model.vocab_size
  long = lambda x: torch.tensor(x, dtype=torch.long)

  def losses(b):
    out = model(input_ids=long(b['input_ids']), token_type_ids=long(b['segment_ids']),
                attention_mask=long(b['attention_mask']))
    pos = long(b['masked_lm_positions'])
    logits = torch.gather(out.prediction_logits, 1, pos[..., None].expand(-1, -1, vocab))
    w = torch.tensor(b['masked_lm_weights'])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                           long(b['masked_lm_ids']).flatten(), reduction='none')
    mlm = (ce * w.flatten()).sum() / w.sum()
    nsp = torch.nn.functional.cross_entropy(out.seq_relationship_logits,
                                            long(b['next_sentence_labels']))
    return mlm, nsp, w.sum()

  ours = metrics_jsonl.read_jsonl(os.path.join(args.workdir, 'metrics.jsonl'), 'eval')
  steps = args.steps or tc.num_steps
  print(f'# {args.workdir}: {c.model.variant} {c.model.num_layers}x{c.model.hidden_size}, '
        f'batch {tc.batch_size}, lr {opt.learning_rate}, warm-up {warmup} of '
        f'{tc.num_steps} steps, dropout {c.model.dropout_rate}')
  print('| step | ours eval MLM loss | HF eval MLM loss | HF eval NSP loss |\n|---|---|---|---|')
  train, start = batches('train'), time.time()
  for step in range(1, steps + 1):
    model.train()
    optimizer.zero_grad()
    mlm, nsp, _ = losses(next(train))
    (mlm + nsp).backward()
    if opt.clip_norm:
      torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_norm)
    optimizer.step()
    schedule.step()
    if step % tc.eval_every_steps == 0 or step == steps:
      model.eval()
      held_out, total = batches('eval'), np.zeros(3)
      with torch.no_grad():
        for _ in range(tc.eval_steps):
          m, n, w = losses(next(held_out))
          total += [float(m) * float(w), float(n), float(w)]
      mine = ours.get(step, {}).get('mlm_loss', float('nan'))
      print(f'| {step} | {mine:.3f} | {total[0] / total[2]:.3f} | '
            f'{total[1] / tc.eval_steps:.3f} |', flush=True)
  print(f'# HF: {time.time() - start:.0f} s for {steps} steps')


if __name__ == '__main__':
  main()
