"""Read and write Hugging Face Llama checkpoints without ``transformers``.

A Hugging Face Llama directory holds ``config.json`` (``LlamaConfig`` fields) and the
weights as ``model.safetensors``, or as shards listed in ``model.safetensors.index.json``.
Tensor names map one to one onto ``model.Llama``'s (Meta's naming)::

    model.embed_tokens.weight                     tok_embeddings.weight
    model.layers.{i}.input_layernorm.weight       layers.{i}.attention_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj     layers.{i}.attention.w{q,k,v,o}
    model.layers.{i}.post_attention_layernorm     layers.{i}.ffn_norm
    model.layers.{i}.mlp.{gate,down,up}_proj      layers.{i}.feed_forward.w{1,2,3}
    model.norm.weight                             norm.weight
    lm_head.weight                                output.weight (absent when tied)

No tensor is permuted: ``model.py`` applies rotary embeddings in Hugging Face's
rotate-half convention, which is what Hugging Face's q/k projection weights expect.

Typical use::

    model = load_hf_llama_model("Llama-3.2-1B", device="cuda", dtype=torch.bfloat16)
    save_hf_llama(model, model.config, "out/hf")

With FSDP2, load the full state dict with ``load_hf_llama`` (on rank 0 only, if memory
is short), build the model on ``meta``, ``fully_shard`` it, ``to_empty`` it and hand the
state dict to ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` with
``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``. To save from FSDP2,
gather a full state dict first (``get_model_state_dict`` with ``full_state_dict=True,
cpu_offload=True``) and pass it to ``save_hf_llama`` on one rank.

Config files written by ``transformers`` 4.x (``rope_theta``, ``rope_scaling``) and 5.x
(``rope_parameters``) are both read; files are written in the 4.x layout, which both read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from model import Llama, LlamaConfig, LlamaConfigError, RopeScaling
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFCheckpointError",
    "HFCheckpointNotFoundError",
    "HFConfigError",
    "HFTensorError",
    "config_from_hf",
    "config_to_hf",
    "hf_name",
    "load_hf_llama",
    "load_hf_llama_model",
    "our_name",
    "save_hf_llama",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(Exception):
    """Base class of the errors raised while reading or writing a checkpoint."""


class HFCheckpointNotFoundError(HFCheckpointError, FileNotFoundError):
    """A directory, config or weight file is missing."""


class HFConfigError(HFCheckpointError, ValueError):
    """``config.json`` is unreadable or describes a model this code does not implement."""


class HFTensorError(HFCheckpointError, ValueError):
    """A tensor is missing, unexpected, duplicated or has the wrong shape."""


# --------------------------------------------------------------------------- names

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_PER_LAYER_FROM_HF = {hf: ours for ours, hf in _PER_LAYER.items()}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Non-parameter buffers that older transformers versions saved; they carry no weights.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_name(name: str) -> str:
    """Hugging Face name of one of ``Llama``'s state-dict entries."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _OUR_LAYER.fullmatch(name)
    if match and match.group(2) in _PER_LAYER:
        return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
    raise KeyError(f"{name!r} is not a Llama parameter name")


def our_name(name: str) -> str | None:
    """``Llama`` name for a Hugging Face tensor name; None for ignorable buffers."""
    if _HF_IGNORED.fullmatch(name):
        return None
    if name in _TOP_LEVEL_FROM_HF:
        return _TOP_LEVEL_FROM_HF[name]
    match = _HF_LAYER.fullmatch(name)
    if match and match.group(2) in _PER_LAYER_FROM_HF:
        return f"layers.{match.group(1)}.{_PER_LAYER_FROM_HF[match.group(2)]}"
    raise KeyError(f"{name!r} is not a Hugging Face Llama tensor name")


def _expected_shapes(config: LlamaConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Llama(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


# --------------------------------------------------------------------------- config

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def config_from_hf(hf: Mapping[str, Any], *, source: str = CONFIG_FILE) -> LlamaConfig:
    """``LlamaConfig`` from the fields of a Hugging Face ``config.json``."""

    def fail(field: str, message: str) -> HFConfigError:
        return HFConfigError(f"{source}: {field}: {message}")

    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise fail("model_type", f"expected 'llama', got {model_type!r}")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if field not in hf:
            raise fail(field, "missing")
    if hf.get("hidden_act", "silu") != "silu":
        raise fail("hidden_act", f"only 'silu' is implemented, got {hf['hidden_act']!r}")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise fail(field, "biases are not implemented")
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != hf["hidden_size"]:
        raise fail(
            "head_dim",
            f"{head_dim} x {n_heads} heads != hidden_size "
            f"{hf['hidden_size']}; only head_dim = hidden_size / heads is implemented",
        )

    # transformers 5 nests rope_theta and the scaling in rope_parameters.
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        rope_scaling = None
    elif rope_type == "llama3":
        try:
            rope_scaling = RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_seq_len=rope["original_max_position_embeddings"],
            )
        except KeyError as exc:
            raise fail("rope_scaling", f"llama3 scaling without {exc.args[0]!r}") from None
        except LlamaConfigError as exc:
            raise fail("rope_scaling", str(exc)) from None
    else:
        raise fail("rope_scaling", f"rope_type {rope_type!r} is not implemented (only 'default' and 'llama3')")
    try:
        return LlamaConfig(
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            vocab_size=hf["vocab_size"],
            hidden_dim=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
        )
    except LlamaConfigError as exc:
        raise HFConfigError(f"{source}: {exc}") from exc


def config_to_hf(config: LlamaConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Hugging Face ``config.json`` fields for ``config`` (weights stored as ``dtype``)."""
    scaling = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        },
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "use_cache": True,
    }


# --------------------------------------------------------------------------- load


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise HFCheckpointNotFoundError(f"{path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFConfigError(f"{path}: not valid JSON ({exc})") from exc


def _weight_files(directory: Path) -> list[Path]:
    index_path = directory / INDEX_FILE
    if index_path.exists():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFConfigError(f"{index_path}: has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise HFCheckpointNotFoundError(f"{file}: listed in {index_path} but missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFCheckpointNotFoundError(
            f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file "
            "(PyTorch .bin checkpoints are not supported)"
        )
    return files


def load_hf_llama(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and ``Llama`` state dict of the Hugging Face checkpoint in ``path``.

    Tensors are read straight onto ``device`` and cast to ``dtype`` (None keeps the
    stored dtype). Every tensor the config calls for must be present with its shape;
    ``lm_head.weight`` is ignored when the embeddings are tied.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise HFCheckpointNotFoundError(f"{directory}: not a directory")
    config_path = directory / CONFIG_FILE
    config = config_from_hf(_read_json(config_path), source=str(config_path))
    expected = _expected_shapes(config)
    state_dict: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        with safe_open(file, framework="pt", device=str(device)) as reader:
            for key in reader.keys():
                try:
                    name = our_name(key)
                except KeyError:
                    raise HFTensorError(f"{file}: unexpected tensor {key!r}") from None
                if name is None or (name == "output.weight" and config.tie_embeddings):
                    continue
                if name in state_dict:
                    raise HFTensorError(f"{file}: tensor {key!r} appears in two files")
                shape = tuple(reader.get_slice(key).get_shape())
                if shape != tuple(expected[name]):
                    raise HFTensorError(
                        f"{file}: tensor {key!r} has shape {shape}, {config_path} implies {tuple(expected[name])}"
                    )
                tensor = reader.get_tensor(key)
                state_dict[name] = tensor if dtype is None else tensor.to(dtype)
    missing = [hf_name(name) for name in expected if name not in state_dict]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise HFTensorError(f"{directory}: missing tensor(s) {shown}")
    return config, state_dict


def load_hf_llama_model(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """A ``Llama`` holding the checkpoint in ``path``, without a throw-away init."""
    config, state_dict = load_hf_llama(path, device=device, dtype=dtype)
    with torch.device("meta"):
        model = Llama(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model


# --------------------------------------------------------------------------- save


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _is_sharded(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    write(tmp)
    os.replace(tmp, target)


def save_hf_llama(
    model: nn.Module | Mapping[str, torch.Tensor],
    config: LlamaConfig,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``model`` (a ``Llama`` or its full state dict) as a Hugging Face checkpoint.

    Writes ``config.json`` and ``model.safetensors``, or, with ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    A directory that already holds a checkpoint is refused unless ``overwrite``, which
    first removes its ``config.json``, index and ``*.safetensors``. Returns the paths
    written.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be positive, got {max_shard_bytes}")
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    expected = _expected_shapes(config)
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unexpected or missing:
        raise HFTensorError(f"state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    for name in expected:  # canonical order: embeddings, layer by layer, norm, head
        tensor = state[name]
        if _is_sharded(tensor):
            raise HFTensorError(
                f"{name}: is a sharded DTensor; gather a full state dict first "
                "(get_model_state_dict with full_state_dict=True)"
            )
        if tensor.shape != expected[name]:
            raise HFTensorError(
                f"{name}: shape {tuple(tensor.shape)} does not match the config's {tuple(expected[name])}"
            )
        tensors[hf_name(name)] = tensor.detach().to("cpu").contiguous()

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    existing = [p for p in directory.iterdir() if p.name in (CONFIG_FILE, INDEX_FILE) or p.suffix == ".safetensors"]
    if existing and not overwrite:
        raise HFCheckpointError(
            f"{directory}: already holds a checkpoint ({existing[0].name}); pass overwrite=True to replace it"
        )
    for stale in existing:
        stale.unlink()

    dtype = state["tok_embeddings.weight"].dtype
    metadata = {"format": "pt"}
    written: list[Path] = []
    if max_shard_bytes is None:
        target = directory / SINGLE_FILE
        _write_atomic(target, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        written.append(target)
    else:
        shards = _shards(tensors, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for number, shard in enumerate(shards, start=1):
            target = directory / f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            _write_atomic(target, lambda tmp, shard=shard: save_file(shard, tmp, metadata=metadata))
            weight_map.update(dict.fromkeys(shard, target.name))
            written.append(target)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        target = directory / INDEX_FILE
        _write_atomic(target, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
        written.append(target)
    target = directory / CONFIG_FILE
    hf_config = json.dumps(config_to_hf(config, dtype=dtype), indent=2) + "\n"
    _write_atomic(target, lambda tmp: tmp.write_text(hf_config))
    written.append(target)
    return written
