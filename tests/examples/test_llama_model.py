"""The Llama example's model, its Hugging Face checkpoint I/O and its default corpus."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "llama_finetune"
if str(EXAMPLE_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_DIR))

import corpus  # noqa: E402
import hf_checkpoint as hfc  # noqa: E402
from model import (  # noqa: E402
    IGNORE_INDEX,
    Llama,
    LlamaConfig,
    LlamaConfigError,
    RMSNorm,
    RopeScaling,
    apply_rotary_embedding,
    rotary_tables,
    token_cross_entropy,
)

SMALL = LlamaConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=258,
    hidden_dim=160,
    rope_theta=10_000.0,
    max_seq_len=64,
)


def small(**overrides: object) -> LlamaConfig:
    return dataclasses.replace(SMALL, **overrides)


def make_model(config: LlamaConfig = SMALL, seed: int = 0) -> Llama:
    model = Llama(config)
    model.init_weights(seed)
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def tokens(batch: int, seq: int, vocab: int = 258, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- model


@pytest.mark.parametrize("tie", [True, False])
def test_forward_shapes_and_parameter_names(tie: bool) -> None:
    config = small(tie_embeddings=tie)
    model = make_model(config)
    output = model(tokens(3, 17))
    assert output.logits.shape == (3, 17, 258)
    assert output.logits.dtype == torch.float32
    assert output.loss is None
    names = set(model.state_dict())
    assert ("output.weight" in names) is not tie
    assert model.state_dict()["layers.1.attention.wk.weight"].shape == (2 * 16, 64)
    assert model.state_dict()["layers.1.feed_forward.w1.weight"].shape == (160, 64)
    assert len(model.layers) == 2
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_grouped_query_attention_matches_repeated_kv_reference() -> None:
    config = small(n_heads=8, n_kv_heads=2)
    attention = make_model(config).layers[0].attention
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_tables(config, 9)
    with torch.no_grad():
        got = attention(x, cos, sin)
        q = attention.wq(x).view(2, 9, 8, 8).transpose(1, 2)
        k = attention.wk(x).view(2, 9, 2, 8).transpose(1, 2)
        v = attention.wv(x).view(2, 9, 2, 8).transpose(1, 2)
        q, k = apply_rotary_embedding(q, cos, sin), apply_rotary_embedding(k, cos, sin)
        # Query heads 0-3 share kv head 0, heads 4-7 share kv head 1.
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, 64)
        expected = attention.wo(ref)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    model = make_model()
    ids = tokens(2, 20)
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 258
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(before[:, :12], after[:, :12], atol=1e-6, rtol=0)
    assert (before[:, 12:] - after[:, 12:]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_normalises_in_float32_with_eps(dtype: torch.dtype) -> None:
    norm = RMSNorm(4, eps=1e-2)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[0.1, -0.2, 0.05, 0.3]], dtype=dtype)
    x64 = x.double()
    normalised = x64 / torch.sqrt(x64.pow(2).mean() + 1e-2)  # eps is not negligible here
    expected = norm.weight.double() * normalised.to(dtype).double()
    got = norm(x)
    assert got.dtype == torch.float32  # float32 weight times the normalised input
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)


def test_rotary_embedding_uses_the_rotate_half_convention() -> None:
    config = small(dim=16, n_heads=4, n_kv_heads=4, rope_theta=100.0)  # head_dim 4
    cos, sin = rotary_tables(config, 4)
    a, b, c, d = 0.3, -1.2, 0.7, 2.0
    x = torch.tensor([a, b, c, d]).expand(4, 4)
    got = apply_rotary_embedding(x, cos, sin)
    for pos in range(4):
        t0, t1 = pos * 1.0, pos * 100.0 ** (-2 / 4)  # frequencies theta^(-2j/head_dim)
        # Dimension j pairs with j + head_dim/2 (not with j + 1 as in interleaved RoPE).
        expected = [
            a * math.cos(t0) - c * math.sin(t0),
            b * math.cos(t1) - d * math.sin(t1),
            c * math.cos(t0) + a * math.sin(t0),
            d * math.cos(t1) + b * math.sin(t1),
        ]
        torch.testing.assert_close(got[pos], torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies() -> None:
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
    base = small(dim=128, n_heads=2, n_kv_heads=2, rope_theta=500_000.0)  # head_dim 64
    scaled = dataclasses.replace(base, rope_scaling=scaling)

    def frequencies(config: LlamaConfig) -> torch.Tensor:
        cos, sin = rotary_tables(config, 2, dtype=torch.float64)
        return torch.atan2(sin[1, :32], cos[1, :32])  # angle at position 1

    plain, got = frequencies(base), frequencies(scaled)
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 64 / 4, wavelength > 64 / 1
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    torch.testing.assert_close(got[high], plain[high], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[low], plain[low] / 8, rtol=1e-5, atol=0)
    assert torch.all(got[medium] < plain[medium]) and torch.all(got[medium] > plain[medium] / 8)
    # Interpolation weight s = (64 / wavelength - 1) / (4 - 1), as Llama 3.1 defines it.
    s = (64 / wavelength[medium] - 1) / 3
    expected = (1 - s) * plain[medium] / 8 + s * plain[medium]
    torch.testing.assert_close(got[medium], expected, rtol=1e-5, atol=0)


def test_loss_is_summed_over_labelled_tokens_only() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 0, 6, 5]])
    loss_sum, count = token_cross_entropy(logits, labels)
    log_probs = logits.log_softmax(-1)
    expected = -sum(log_probs[b, t, labels[b, t]] for b in range(2) for t in range(5) if labels[b, t] != IGNORE_INDEX)
    assert count.item() == 7
    assert count.dtype == torch.int64 and loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        loss_sum / count, F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    )

    all_ignored = torch.full((2, 5), IGNORE_INDEX)
    empty_sum, empty_count = token_cross_entropy(logits, all_ignored)
    assert empty_sum.item() == 0.0 and empty_count.item() == 0

    with pytest.raises(ValueError, match="labels shape"):
        token_cross_entropy(logits, labels[:, :4])


def test_forward_with_labels_returns_the_summed_loss_of_its_logits() -> None:
    model = make_model()
    ids = tokens(2, 16)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    output = model(ids, labels=labels)
    assert output.loss is not None
    assert output.loss.num_tokens.item() == 30
    torch.testing.assert_close(output.loss.loss_sum, token_cross_entropy(output.logits, labels).loss_sum)


def test_a_few_optimizer_steps_reduce_the_loss() -> None:
    torch.manual_seed(0)
    model = make_model().train()
    ids = tokens(4, 32, seed=3)
    labels = ids.roll(-1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss_sum, count = model(ids, labels=labels).loss
        loss = loss_sum / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(258), abs=0.3)  # near-uniform at init
    assert losses[-1] < losses[0] - 1.0, losses


def test_init_weights_is_deterministic_and_meta_friendly() -> None:
    config = small(tie_embeddings=False)
    first, second = Llama(config), Llama(config)
    first.init_weights(seed=7)
    second.init_weights(seed=7)
    with torch.device("meta"):
        lazy = Llama(config)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=7)
    other = Llama(config)
    other.init_weights(seed=8)
    reference = first.state_dict()
    for state in (second.state_dict(), lazy.state_dict()):
        assert state.keys() == reference.keys()
        for name, tensor in state.items():
            assert torch.equal(tensor, reference[name]), name
    assert not torch.equal(
        other.state_dict()["layers.0.attention.wq.weight"], reference["layers.0.attention.wq.weight"]
    )
    assert torch.equal(reference["layers.0.ffn_norm.weight"], torch.ones(64))
    wq_std = reference["layers.0.attention.wq.weight"].std().item()
    wo_std = reference["layers.0.attention.wo.weight"].std().item()
    assert wq_std == pytest.approx(0.02, rel=0.1)
    assert wo_std == pytest.approx(0.02 / math.sqrt(4), rel=0.1)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama3.2-1b", 1_235_814_400),
        ("llama3-8b", 8_030_261_248),
        ("llama3.1-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_presets_have_the_published_parameter_counts(name: str, params: int) -> None:
    config = LlamaConfig.from_name(name)
    with torch.device("meta"):
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == params == config.num_params()
    assert config.vocab_size == 128_256


def test_tiny_preset_has_a_few_million_parameters() -> None:
    config = LlamaConfig.from_name("tiny")
    count = sum(p.numel() for p in Llama(config).parameters())
    assert 1_000_000 < count < 10_000_000
    assert config.vocab_size == 258 and config.max_seq_len == 256
    assert config.n_kv_heads < config.n_heads


@pytest.mark.parametrize(
    ("name", "params"), [("llama-25m", 24_258_048), ("llama-125m", 125_260_032), ("llama-300m", 304_393_216)]
)
def test_cpu_scaling_presets_lie_between_tiny_and_1b(name: str, params: int) -> None:
    config = LlamaConfig.from_name(name)
    with torch.device("meta"):
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == params == config.num_params()
    assert config.vocab_size == 258  # the byte tokenizer: the parameters sit in the blocks
    assert config.n_kv_heads < config.n_heads


def test_forward_rejects_sequences_longer_than_max_seq_len() -> None:
    with pytest.raises(ValueError, match="max_seq_len 64"):
        make_model()(tokens(1, 65))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dim": 62}, "dim"),  # not divisible by n_heads=4
        ({"n_kv_heads": 3}, "n_kv_heads"),  # does not divide n_heads=4
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"hidden_dim": 1.5}, "hidden_dim"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"dim": 24, "n_heads": 8, "n_kv_heads": 8}, "n_heads"),  # odd head_dim 3
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
        ({"rope_scaling": {"factor": 8}}, "rope_scaling"),
    ],
)
def test_config_validation_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(LlamaConfigError, match=rf"^{field}: ") as info:
        small(**overrides)
    assert info.value.field == field


def test_rope_scaling_validation_and_unknown_preset() -> None:
    with pytest.raises(LlamaConfigError, match="^high_freq_factor: "):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_seq_len=8192)
    with pytest.raises(LlamaConfigError, match="unknown preset 'llama9'.*tiny"):
        LlamaConfig.from_name("llama9")
    assert LlamaConfig.from_name("tiny", n_layers=2).n_layers == 2


# --------------------------------------------------------------------------- HF checkpoints

# Hugging Face's names for one layer, written out independently of hf_checkpoint's table.
HF_LAYER_0 = {
    "model.layers.0.input_layernorm.weight": "layers.0.attention_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "layers.0.attention.wq.weight",
    "model.layers.0.self_attn.k_proj.weight": "layers.0.attention.wk.weight",
    "model.layers.0.self_attn.v_proj.weight": "layers.0.attention.wv.weight",
    "model.layers.0.self_attn.o_proj.weight": "layers.0.attention.wo.weight",
    "model.layers.0.post_attention_layernorm.weight": "layers.0.ffn_norm.weight",
    "model.layers.0.mlp.gate_proj.weight": "layers.0.feed_forward.w1.weight",
    "model.layers.0.mlp.up_proj.weight": "layers.0.feed_forward.w3.weight",
    "model.layers.0.mlp.down_proj.weight": "layers.0.feed_forward.w2.weight",
}


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names, built from HF_LAYER_0's pattern."""
    state = model.state_dict()
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(len(model.layers)):
        for hf, ours in HF_LAYER_0.items():
            out[hf.replace(".0.", f".{i}.")] = state[ours.replace(".0.", f".{i}.")]
    return {name: tensor.contiguous() for name, tensor in out.items()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_save_then_load_reproduces_logits_exactly(tmp_path: Path, tie: bool, max_shard_bytes: int | None) -> None:
    config = small(
        tie_embeddings=tie,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16),
    )
    model = make_model(config, seed=4)
    ids = tokens(2, 24, seed=5)
    with torch.no_grad():
        saved_logits = model(ids).logits
    written = hfc.save_hf_llama(model, config, tmp_path / "hf", max_shard_bytes=max_shard_bytes)

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert hf_config["model_type"] == "llama"
    assert (hf_config["hidden_size"], hf_config["num_key_value_heads"]) == (64, 2)
    assert hf_config["tie_word_embeddings"] is tie
    assert hf_config["rope_scaling"]["rope_type"] == "llama3"
    stored: dict[str, torch.Tensor] = {}
    for path in written:
        if path.suffix == ".safetensors":
            stored.update(load_file(path))
    assert stored.keys() == hf_state_dict(model).keys()
    if max_shard_bytes is None:
        assert [p.name for p in written] == ["model.safetensors", "config.json"]
    else:
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        shard_names = {p.name for p in written if p.suffix == ".safetensors"}
        assert len(shard_names) > 1 and set(index["weight_map"].values()) == shard_names

    loaded = hfc.load_hf_llama_model(tmp_path / "hf")
    assert loaded.config == config
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved_logits)


def test_tiny_preset_round_trips_through_hf_layout(tmp_path: Path) -> None:
    config = LlamaConfig.from_name("tiny")
    model = Llama(config)
    model.init_weights(seed=11)
    ids = tokens(1, config.max_seq_len, seed=12)
    with torch.no_grad():
        saved_logits = model(ids).logits
    hfc.save_hf_llama(model, config, tmp_path)
    loaded_config, state = hfc.load_hf_llama(tmp_path)
    assert loaded_config == config
    with torch.device("meta"):
        loaded = Llama(loaded_config)
    loaded.load_state_dict(state, assign=True)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved_logits)


def test_hand_built_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = make_model(small(tie_embeddings=False), seed=6)
    tensors = hf_state_dict(model)
    names = sorted(tensors)
    shards = {f"part-{i}.safetensors": names[i::3] for i in range(3)}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {key: file for file, keys in shards.items() for key in keys}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 258,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "max_position_embeddings": 64,
                "tie_word_embeddings": False,
            }
        )
    )
    config, state = hfc.load_hf_llama(tmp_path, dtype=torch.bfloat16)
    assert config == small(tie_embeddings=False)
    assert state.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_tied_checkpoint_ignores_lm_head_and_old_rotary_buffers(tmp_path: Path) -> None:
    model = make_model(small(tie_embeddings=True))
    tensors = hf_state_dict(model)
    tensors["lm_head.weight"] = torch.zeros(258, 64)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hfc.config_to_hf(model.config)))
    _, state = hfc.load_hf_llama(tmp_path)
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state["tok_embeddings.weight"], model.tok_embeddings.weight)


def test_config_from_transformers_5_rope_parameters() -> None:
    # The layout transformers 5 writes for Llama 3.2 1B.
    hf = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert hfc.config_from_hf(hf) == LlamaConfig.from_name("llama3.2-1b")
    assert hfc.config_from_hf(hfc.config_to_hf(LlamaConfig.from_name("llama3.2-1b"))) == LlamaConfig.from_name(
        "llama3.2-1b"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type: expected 'llama'"),
        ({"attention_bias": True}, "attention_bias: biases are not implemented"),
        ({"hidden_act": "gelu"}, "hidden_act: only 'silu'"),
        ({"head_dim": 32}, "head_dim: 32 x 4 heads != hidden_size 64"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "without 'low_freq_factor'"),
        ({"num_key_value_heads": 3}, "n_kv_heads: must divide n_heads"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_or_invalid_config_is_rejected(change: dict, message: str) -> None:
    hf = hfc.config_to_hf(SMALL)
    hf.update(change)
    if change.get("hidden_size", 0) is None:
        del hf["hidden_size"]
        message = "hidden_size: missing"
    with pytest.raises(hfc.HFConfigError, match=f"^cfg.json: .*{message}"):
        hfc.config_from_hf(hf, source="cfg.json")


def test_load_errors_name_the_path_and_tensor(tmp_path: Path) -> None:
    with pytest.raises(hfc.HFCheckpointNotFoundError, match="not a directory"):
        hfc.load_hf_llama(tmp_path / "absent")
    with pytest.raises(hfc.HFCheckpointNotFoundError, match="config.json: no such file"):
        hfc.load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hfc.HFConfigError, match="config.json: not valid JSON"):
        hfc.load_hf_llama(tmp_path)

    model = make_model(small(tie_embeddings=False))
    (tmp_path / "config.json").write_text(json.dumps(hfc.config_to_hf(model.config)))
    with pytest.raises(hfc.HFCheckpointNotFoundError, match="no model.safetensors"):
        hfc.load_hf_llama(tmp_path)

    tensors = hf_state_dict(model)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hfc.HFTensorError) as info:
        hfc.load_hf_llama(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(info.value)
    assert "'model.layers.1.self_attn.k_proj.weight' has shape (64, 64)" in str(info.value)
    assert "implies (32, 64)" in str(info.value)

    tensors = hf_state_dict(model)
    del tensors["lm_head.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hfc.HFTensorError, match="missing tensor.*model.layers.1.mlp.up_proj.weight, lm_head.weight"):
        hfc.load_hf_llama(tmp_path)

    tensors = hf_state_dict(model)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hfc.HFTensorError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        hfc.load_hf_llama(tmp_path)

    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(
        hfc.HFCheckpointNotFoundError, match="00001-of-00002.safetensors: listed in .*index.json but missing"
    ):
        hfc.load_hf_llama(tmp_path)


def test_save_refuses_mismatches_and_existing_checkpoints(tmp_path: Path) -> None:
    model = make_model(small(tie_embeddings=True))
    with pytest.raises(hfc.HFTensorError, match="missing \\['output.weight'\\]"):
        hfc.save_hf_llama(model, small(tie_embeddings=False), tmp_path / "a")
    with pytest.raises(hfc.HFTensorError, match="tok_embeddings.weight: shape \\(258, 64\\)"):
        hfc.save_hf_llama(model.state_dict(), small(tie_embeddings=True, vocab_size=300), tmp_path / "a")

    hfc.save_hf_llama(model, model.config, tmp_path / "b", max_shard_bytes=40_000)
    with pytest.raises(hfc.HFCheckpointError, match="already holds a checkpoint"):
        hfc.save_hf_llama(model, model.config, tmp_path / "b")
    written = hfc.save_hf_llama(model, model.config, tmp_path / "b", overwrite=True)
    assert (
        sorted(os.listdir(tmp_path / "b")) == sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    )  # old shards and index removed


def test_hf_name_mapping_round_trips_every_parameter() -> None:
    model_names = Llama(small(tie_embeddings=False)).state_dict().keys()
    for name in model_names:
        assert hfc.our_name(hfc.hf_name(name)) == name
    for hf, ours in HF_LAYER_0.items():
        assert hfc.hf_name(ours) == hf
    assert hfc.hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(KeyError):
        hfc.hf_name("layers.0.attention.wz.weight")


# --------------------------------------------------------------------------- corpus


def test_default_corpus_is_real_text_written_once(tmp_path: Path) -> None:
    paths = corpus.write_default_corpus(tmp_path / "corpus")
    assert paths == [tmp_path / "corpus" / corpus.CORPUS_FILE]
    documents = [json.loads(line)["text"] for line in paths[0].read_text("utf-8").splitlines()]
    assert documents == corpus.default_corpus_documents()
    assert len(documents) > 50
    assert sum(len(doc.encode()) for doc in documents) > 300_000
    assert any(doc.startswith('The "assert" statement') for doc in documents)

    os.utime(paths[0], ns=(1_000_000_000, 1_000_000_000))
    assert corpus.write_default_corpus(tmp_path / "corpus") == paths
    assert paths[0].stat().st_mtime_ns == 1_000_000_000  # same text: not rewritten

    paths[0].write_text('{"text": "stale"}\n')
    corpus.write_default_corpus(tmp_path / "corpus")
    assert json.loads(paths[0].read_text("utf-8").splitlines()[0])["text"] == documents[0]
