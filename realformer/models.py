"""The public model API, which tests, analysis tools and notebooks build on:

    from realformer import models
    model = models.build(config.model)        # encoder + MLM and NSP heads (head='pretraining')
    variables = model.init(rng, batch, deterministic=True)
    out = model.apply(variables, batch, deterministic=True, capture_attention=True)
    out.hidden      [B, T, D]      final hidden states
    out.attention   one [B, H, T, T] array of attention probabilities per layer (when asked)

`batch` holds int32 [B, T] arrays input_ids, segment_ids, attention_mask (1 = real token).
Ids are not checked inside the model (it is traced): input_ids must lie in [0, vocab_size)
(an id in [vocab_size, padded_vocab_size) embeds an untrained padding row of the table, one
past the table gives NaN rows, a negative one wraps) and segment_ids in
[0, type_vocab_size) (one past it embeds no token type); the programs check their data.
Other heads: models.build(config.model, head='encoder' | 'classification' (num_labels=k) |
'span' | 'token_classification' (num_labels=k)); models.build(config.model,
next_sentence=False): MLM alone (config.objective=mlm).
A head of one's own (a fine-tuning kind's build): models.Encoder(spec, name='encoder') and
the head on its output, returning (the encoder's output, *the head's outputs), as
encoder.py's BertForQuestionAnswering does; models.MlmHead is the tied MLM head (a
pretraining objective of one's own: BertForPretraining shows its use). The modules themselves live in
realformer/model/ (encoder.py, attention.py, spec.py).
"""

from realformer.model.encoder import Block
from realformer.model.encoder import build
from realformer.model.encoder import Encoder
from realformer.model.encoder import EncoderOutput
from realformer.model.encoder import HEADS
from realformer.model.encoder import MlmHead
from realformer.model.encoder import PretrainingOutput

__all__ = ['HEADS', 'Block', 'Encoder', 'EncoderOutput', 'MlmHead', 'PretrainingOutput',
           'build']
