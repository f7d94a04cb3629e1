"""Load Hugging Face checkpoint directories (config.json + safetensors, single file or sharded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import parse_drafter_config, parse_target_config
from .drafter import Gemma4MTPDrafter
from .layers import to_dtype
from .target import Gemma4Target


def _read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"path: no config.json in {path}")
    return json.loads(cfg.read_text())


def _read_tensors(path: Path, keep) -> dict[str, torch.Tensor]:
    """The tensors whose names `keep(name)` maps to a new name (None drops them)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no .safetensors files in {path}")
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                new = keep(key)
                if new is not None:
                    out[new] = f.get_tensor(key)
    return out


def _load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    expected = set(module.state_dict().keys())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint does not match the model (missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]})")
    module.load_state_dict(tensors, strict=True)


def _finish(module, dtype, device):
    module.to(device=device)
    if dtype is not None:
        to_dtype(module, dtype)
    return module.eval()


def load_target(path, *, dtype: torch.dtype | None = None, device="cpu", num_blocks: int = 1024,
                block_size: int = 16) -> Gemma4Target:
    """A Gemma 4 text target (any family) from a Gemma4ForCausalLM or Gemma4ForConditionalGeneration
    directory (the text tower; vision and audio weights are skipped).

    dtype None keeps the checkpoint's dtype. The paged caches hold num_blocks blocks of block_size
    positions per attention type."""
    path = Path(path)
    config, prefix = parse_target_config(_read_config(path))
    model = Gemma4Target(config, num_blocks=num_blocks, block_size=block_size)

    # checkpoints may carry K/V weights for KV-shared layers; those layers never use them (as in HF)
    unused = {f"layers.{i}.self_attn.{name}." for i in range(config.first_kv_shared_layer, config.num_layers)
              for name in ("k_proj", "v_proj", "k_norm", "v_norm")}

    def keep(key):
        if key.startswith(prefix):
            key = key[len(prefix):]
            return None if key[:key.rfind(".") + 1] in unused else key
        if key == "lm_head.weight":
            return None if config.tie_word_embeddings else key
        return None  # vision / audio towers of multimodal checkpoints

    tensors = _read_tensors(path, keep)
    _load_into(model, tensors, f"target {path}")
    return _finish(model, dtype, device)


def load_drafter(path, *, dtype: torch.dtype | None = None, device="cpu", backend: str = "auto"
                 ) -> Gemma4MTPDrafter:
    """An MTP drafter from a Gemma4AssistantForCausalLM directory; `backend` goes to every op call."""
    path = Path(path)
    config = parse_drafter_config(_read_config(path))
    model = Gemma4MTPDrafter(config, backend=backend)

    def keep(key):
        if key.startswith("model."):
            return key[len("model."):]
        if key.startswith("masked_embedding."):
            return key[len("masked_embedding."):] if config.use_ordered_embeddings else None
        if key == "lm_head.weight":
            return None if config.text.tie_word_embeddings else key
        return key

    tensors = _read_tensors(path, keep)
    _load_into(model, tensors, f"drafter {path}")
    return _finish(model, dtype, device)
