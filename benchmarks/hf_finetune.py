r"""The HF arm of benchmarks/finetune_vs_hf.py, in a process of its own that imports what an
HF user's script would (torch, transformers) and nothing of ours, since the race times it as a
whole process: --task sst2, BertForSequenceClassification fine-tuned on
<data_dir>/SST-2/{train,dev}.tsv, prints one line {"epoch_seconds": [...], "accuracy": a,
"threads": n}; --task ner, BertForTokenClassification on <data_dir>/{train,dev}.txt (CoNLL
format: a word and its tag per line), each word's tag at its first piece (-100 elsewhere, the
token-classification example's), prints {"epoch_seconds": [...], "tags": [[...], ...],
"threads": n}: dev's predicted tags, a word cut off by max_seq_length tagged O.

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


def read_conll(data_dir: str, split: str):
  """[(words, tags)] of <data_dir>/<split>.txt."""
  sentences, words, tags = [], [], []
  with open(os.path.join(data_dir, f'{split}.txt'), encoding='utf-8') as f:
    for line in f:
      columns = line.split()
      if not columns or columns[0] == '-DOCSTART-':
        if words:
          sentences.append((words, tags))
          words, tags = [], []
      else:
        words.append(columns[0])
        tags.append(columns[-1])
  if words:
    sentences.append((words, tags))
  return sentences


NER_LABELS = ['O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC', 'I-MISC']


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model_dir', required=True, help='an HF checkpoint directory')
  p.add_argument('--data_dir', required=True, help='holds SST-2/train.tsv and SST-2/dev.tsv')
  p.add_argument('--task', default='sst2', choices=('sst2', 'ner'))
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
  ner = args.task == 'ner'
  if ner:
    model = transformers.BertForTokenClassification.from_pretrained(
        args.model_dir, num_labels=len(NER_LABELS))
    collate = transformers.DataCollatorForTokenClassification(tokenizer)
  else:
    model = transformers.BertForSequenceClassification.from_pretrained(args.model_dir,
                                                                       num_labels=2)
    collate = transformers.DataCollatorWithPadding(tokenizer)
  model = model.float().to(device)  # float32 whatever the stored copy's dtype, as ours

  def dataset(split):
    if ner:  # each word's tag at its first piece, -100 (no loss) at the others
      sentences = read_conll(args.data_dir, split)
      enc = tokenizer([w for w, _ in sentences], is_split_into_words=True, truncation=True,
                      max_length=args.max_seq_length)
      rows = []
      for i, (_, tags) in enumerate(sentences):
        words = enc.word_ids(i)
        labels = [NER_LABELS.index(tags[w]) if w is not None and (p == 0 or words[p - 1] != w)
                  else -100 for p, w in enumerate(words)]
        rows.append(dict({k: v[i] for k, v in enc.items()}, labels=labels))
      return rows
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
  epoch_seconds, epoch_losses = [], []
  for _ in range(args.epochs):
    model.train()
    start, losses = time.perf_counter(), []
    for batch in loader:
      loss = model(**batch.to(device)).loss
      losses.append(loss.detach())
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      optimizer.step()
      scheduler.step()
      optimizer.zero_grad()
    if device == 'cuda':
      torch.cuda.synchronize()
    epoch_seconds.append(time.perf_counter() - start)
    epoch_losses.append(float(torch.stack(losses).mean()))  # (after the timing)
  model.eval()
  correct, tags = 0, []
  with torch.no_grad():
    for batch in torch.utils.data.DataLoader(dev, batch_size=64, collate_fn=collate):
      labels = batch.pop('labels').to(device)
      best = model(**batch.to(device)).logits.argmax(-1)
      if ner:  # the tag at each first piece (labels != -100), in the words' order
        tags += [[NER_LABELS[int(t)] for t in b[l != -100]] for b, l in zip(best, labels)]
      else:
        correct += int((best == labels).sum())
  if ner:
    sentences = read_conll(args.data_dir, 'dev')
    tags = [t + ['O'] * (len(w) - len(t)) for t, (w, _) in zip(tags, sentences)]  # (cut off)
    print(json.dumps({'epoch_seconds': epoch_seconds, 'epoch_losses': epoch_losses,
                      'tags': tags, 'threads': torch.get_num_threads()}))
  else:
    print(json.dumps({'epoch_seconds': epoch_seconds, 'epoch_losses': epoch_losses,
                      'accuracy': correct / len(dev), 'threads': torch.get_num_threads()}))


if __name__ == '__main__':
  main()
