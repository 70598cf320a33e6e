"""Small transformers models with random weights (nothing downloaded), and toy modules."""

import torch
import transformers


def seeded(seed=0):
    torch.manual_seed(seed)


def gpt2(dtype=torch.float32, **overrides):
    seeded()
    config = transformers.GPT2Config(**dict(dict(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2),
                                            **overrides))
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


_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)


def _seq2seq(seed):
    return {"input_ids": token_batch(seed), "decoder_input_ids": token_batch(seed + 10)}


# name -> (model factory, batch factory): more model classes for the compatibility sweep
MORE_MODELS = {
    "bart": (lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)), _seq2seq),
    "gpt_neo": (lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64)), lambda s: {"input_ids": token_batch(s)}),
    "mistral": (lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_SMALL, num_key_value_heads=1)),
                lambda s: {"input_ids": token_batch(s)}),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=32)), lambda s: {"input_ids": token_batch(s)}),
    "distilbert": (lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)),
        lambda s: {"input_ids": token_batch(s)}),
    "albert": (lambda: transformers.AlbertModel(transformers.AlbertConfig(  # one layer shared by all depths
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64)), lambda s: {"input_ids": token_batch(s)}),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64)),
        lambda s: {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(s))}),
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2,
                                                                             n_head=2)),
              lambda s: {"input_ids": token_batch(s)}),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_SMALL, num_key_value_heads=1)),
              lambda s: {"input_ids": token_batch(s)}),
    "mt5": (lambda: transformers.MT5ForConditionalGeneration(transformers.MT5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        decoder_start_token_id=0)), _seq2seq),
}
