"""A random-weight Llama of a named shape, built locally (no model hub), for the GPU device check.

    python -m bench.gpu_model DIR --shape 1b          # ~1B parameters (Llama-3.2-1B's body)
    python -m bench.gpu_model DIR --shape llama3-8b   # Llama-3-8B's shape: compare with ../shared/perf directly
    python -m bench.gpu_model DIR --shape tiny        # the CPU tests' model, for a dry run

The tokenizer is the tiny model's locally trained byte-level BPE, so the vocabulary is small (about
a thousand tokens, not Llama-3's 128k): the embedding and LM head are a rounding error, and a shape's
parameter count is its transformer body's. Weights are drawn on the GPU when there is one (seconds,
where a CPU takes minutes for 8B) and saved in bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """The dimensions of a Llama decoder."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_body_params(self) -> int:
        """Parameters of the decoder layers (attention and MLP projections), embeddings excluded."""
        kv_dim = self.num_key_value_heads * self.head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * (attention + mlp)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in bf16 (keys and values, every layer)."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


SHAPES = {
    # Llama-3.2-1B's decoder: 0.97B parameters in its layers.
    "1b": Shape(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8),
    # Meta-Llama-3-8B, the model of ../shared/perf's fitted rows: 6.98B in its layers, 128 KiB of KV a token.
    "llama3-8b": Shape(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
    # services/node_agent/engines/vllm/tiny_model.py's: for dry runs on a CPU.
    "tiny": Shape(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}

# The shape the perf rows were measured on.
REFERENCE_SHAPE = SHAPES["llama3-8b"]


def build_model(directory: Path, shape_name: str, max_position_embeddings: int = 8192, seed: int = 0) -> Path:
    """Write a random-weight Llama of the shape (config, bf16 safetensors, tokenizer) to directory,
    unless one is there; a baton-shape.json beside it names the shape."""
    directory = Path(directory)
    shape = SHAPES[shape_name]
    marker = directory / "baton-shape.json"
    if marker.exists() and json.loads(marker.read_text()).get("shape") == shape_name:
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.node_agent.engines.vllm.tiny_model import build_tokenizer

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        num_tokens = build_tokenizer(staging, 1024)
        config = LlamaConfig(**asdict(shape), vocab_size=num_tokens, max_position_embeddings=max_position_embeddings,
                             bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
        torch.manual_seed(seed)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(staging))
        del model
        (staging / "baton-shape.json").write_text(json.dumps({"shape": shape_name, **asdict(shape)}))
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the model (its name is the served name)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the decoder's dimensions")
    parser.add_argument("--max-position-embeddings", type=int, default=8192, help="longest context it declares")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    print(f"{build_model(args.directory, args.shape, args.max_position_embeddings)}: {args.shape}, "
          f"{shape.num_body_params / 1e9:.2f}B parameters in its layers")


if __name__ == "__main__":
    main()
