"""Small transformers models with random weights (nothing downloaded), and toy modules."""

import torch
import transformers


def seeded(seed=0):
    torch.manual_seed(seed)


def gpt2(dtype=torch.float32, **overrides):
    seeded()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, **overrides
    )
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


def bert(dtype=torch.float32):
    seeded(1)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config).to(dtype).eval()


def llama(dtype=torch.float32):
    seeded(2)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def t5(dtype=torch.float32, overflow_scale=None):
    """A T5 whose second encoder block's feed-forward output overflows fp16 when scaled."""
    seeded(3)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=2,
        feed_forward_proj="gated-gelu", dropout_rate=0.0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    if overflow_scale is not None:
        with torch.no_grad():
            model.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(overflow_scale)
    return model.to(dtype).eval()


def token_batch(seed, batch=2, length=8, vocab=64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)
