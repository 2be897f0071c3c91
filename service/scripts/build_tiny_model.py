"""Builds a tiny Qwen2-architecture model for the engine tests, with no hub access.

Run with the engine venv's interpreter (it has torch, transformers and tokenizers):
    ~/.cache/ironserve/vllm-venv/bin/python service/scripts/build_tiny_model.py OUT_DIR
Idempotent: an existing complete build with the same recipe version is left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

RECIPE_VERSION = "4"
SEED = 1234
STAMP = ".ironserve-tiny-model"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's own ChatML template, so prompts go through the chat template rather than hard-coded tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Inference servers answer questions about models, tokens, latency and cost.",
    "A GPU has memory, utilisation, temperature and power draw.",
    "What is the capital of France? Paris is the capital of France.",
    "Hello, how are you today? I am fine, thank you.",
] * 20


def build(out_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        # head_dim 64: vLLM's CPU attention kernels reject small head sizes such as 16.
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # Room for a request that generates for half a minute: this CPU decodes the model at about 600 tokens/s, and
        # the disconnect tests must close a client while its request is unfinished even when a busy 2-core host
        # delivers the first chunks seconds late.
        max_position_embeddings=16384,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        torch_dtype="bfloat16",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)

    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / STAMP).write_text(json.dumps({"recipe": RECIPE_VERSION, "seed": SEED}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)


def is_built(out_dir: Path) -> bool:
    stamp = out_dir / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == RECIPE_VERSION


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    out_dir: Path = args.out_dir.resolve()
    if is_built(out_dir):
        print(f"tiny model ready: {out_dir}")
        return 0
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build(out_dir)
    print(f"tiny model built: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
