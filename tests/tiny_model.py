"""Build a tiny but real Hugging Face model directory in a test: a byte-level BPE tokenizer
trained on a few sentences and a random-weight Llama. Nothing is downloaded."""

from __future__ import annotations

import json
import pathlib

CORPUS = [
    "Once upon a time there was a little robot who loved to read stories.",
    "The quick brown fox jumps over the lazy dog. Über café naïve résumé — 日本語 テキスト 🙂",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "She said: hello world! The sun was shining and the birds were singing.",
] * 20

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(out: pathlib.Path, vocab_size: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML, "model_max_length": 512}))


def build_model(out: pathlib.Path, max_positions: int = 512, seed: int = 0) -> pathlib.Path:
    """A tokenizer + random LlamaForCausalLM saved as a HF model directory."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    build_tokenizer(out)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1).save_pretrained(out)
    return out
