r"""The HF arm of benchmarks/finetune_vs_hf.py: BertForSequenceClassification fine-tuned on
<data_dir>/SST-2/{train,dev}.tsv in a process of its own that imports what an HF user's script
would (torch, transformers) and nothing of ours, since the race times it as a whole process.
Prints one line, {"epoch_seconds": [...], "accuracy": a, "threads": n}.

  python benchmarks/hf_finetune.py --model_dir DIR --data_dir DIR --epochs 3 [--group_by_length]
"""

import argparse
import json
import os
import time

import torch
import transformers


def read_split(data_dir: str, split: str):
  with open(os.path.join(data_dir, 'SST-2', f'{split}.tsv'), encoding='utf-8') as f:
    rows = [line.rstrip('\n').split('\t') for line in f][1:]
  return [s for s, _ in rows], [int(y) for _, y in rows]


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model_dir', required=True, help='an HF checkpoint directory')
  p.add_argument('--data_dir', required=True, help='holds SST-2/train.tsv and SST-2/dev.tsv')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--batch_size', type=int, default=32)
  p.add_argument('--epochs', type=int, default=3)
  p.add_argument('--learning_rate', type=float, default=1e-4)
  p.add_argument('--max_seq_length', type=int, default=64)
  p.add_argument('--group_by_length', action='store_true',
                 help="batches of similar lengths (transformers' LengthGroupedSampler, the "
                      "Trainer's group_by_length): less padding, as our length buckets")
  args = p.parse_args()
  torch.manual_seed(args.seed)
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  # float32 matmuls in TF32 on a GPU, as jax's default precision computes ours ('high': torch's
  # default keeps them in full float32, which would race ours at another precision)
  torch.set_float32_matmul_precision('high')
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  model = transformers.BertForSequenceClassification.from_pretrained(args.model_dir,
                                                                     num_labels=2)
  model = model.float().to(device)  # float32 whatever the stored copy's dtype, as ours
  collate = transformers.DataCollatorWithPadding(tokenizer)

  def dataset(split):
    sentences, labels = read_split(args.data_dir, split)
    enc = tokenizer(sentences, truncation=True, max_length=args.max_seq_length)
    return [dict({k: v[i] for k, v in enc.items()}, labels=labels[i])
            for i in range(len(labels))]

  train, dev = dataset('train'), dataset('dev')
  generator = torch.Generator().manual_seed(args.seed)
  order = (dict(sampler=transformers.trainer_pt_utils.LengthGroupedSampler(
      args.batch_size, dataset=train, lengths=[len(x['input_ids']) for x in train],
      generator=generator)) if args.group_by_length else dict(shuffle=True, generator=generator))
  loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, collate_fn=collate,
                                       drop_last=True, **order)
  no_decay = lambda name: name.endswith('bias') or 'LayerNorm' in name
  groups = [{'params': [p for n, p in model.named_parameters() if not no_decay(n)],
             'weight_decay': 0.01},
            {'params': [p for n, p in model.named_parameters() if no_decay(n)],
             'weight_decay': 0.0}]
  optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, eps=1e-6)
  num_steps = len(loader) * args.epochs
  scheduler = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * num_steps),
                                                           num_steps)
  epoch_seconds = []
  for _ in range(args.epochs):
    model.train()
    start = time.perf_counter()
    for batch in loader:
      loss = model(**batch.to(device)).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      optimizer.step()
      scheduler.step()
      optimizer.zero_grad()
    if device == 'cuda':
      torch.cuda.synchronize()
    epoch_seconds.append(time.perf_counter() - start)
  model.eval()
  correct = 0
  with torch.no_grad():
    for batch in torch.utils.data.DataLoader(dev, batch_size=64, collate_fn=collate):
      labels = batch.pop('labels').to(device)
      correct += int((model(**batch.to(device)).logits.argmax(-1) == labels).sum())
  print(json.dumps({'epoch_seconds': epoch_seconds, 'accuracy': correct / len(dev),
                    'threads': torch.get_num_threads()}))


if __name__ == '__main__':
  main()
