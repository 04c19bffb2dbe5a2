"""A tiny random-weight Llama and a byte-level BPE tokenizer, made locally (no model hub needed).

Tests and `baton up --engine vllm` on a machine without a GPU serve it with the vllm engine:
the weights are random, so its text is gibberish, but every part of the engine (paged KV cache,
prefix caching, batching, KV events) is the real one.

    python -m services.node_agent.engines.vllm.tiny_model DIR
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Special tokens first, so that their ids are fixed: 0 begins, 1 ends a sequence.
BOS, EOS = "<s>", "</s>"
_WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are not have which one "
    "you all were we when there can had their more if will each about how up out them then she many some "
    "so these would other into has her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number great tell "
    "token cache block node router scheduler engine prefill decode batch prompt stream model kernel"
).split()


def _corpus(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Deterministic English-like lines to learn merges from."""
    rng = random.Random(seed)
    for _ in range(num_lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice((".", ",", "?", "!"))


def build_tokenizer(directory: Path, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer into directory; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(str(directory))
    return len(fast)


def build_tiny_model(directory: Path, vocab_size: int = 1024, seed: int = 0, hidden_size: int = 256,
                     num_layers: int = 4) -> Path:
    """Write the model (config, bf16 weights, tokenizer) to directory unless it is there already; a
    larger hidden_size or num_layers makes a slower model with the same tokenizer."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its destination and renamed into place: a reader never sees half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        num_tokens = build_tokenizer(staging, vocab_size)
        config = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=num_tokens, max_position_embeddings=4096,
                             bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(staging))
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the model (its name is the model's name)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary to learn, at most")
    args = parser.parse_args()
    print(build_tiny_model(args.directory, args.vocab_size))


if __name__ == "__main__":
    main()
