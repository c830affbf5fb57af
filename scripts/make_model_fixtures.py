#!/usr/bin/env python3
"""Writes the model fixtures of tests/integration/checkpoints/models.rs into tests/fixtures/.

Each file holds the attention weights of a tiny Hugging Face `transformers`
model under the names its `*ForCausalLM` `state_dict` gives them (so, as in
a checkpoint on the hub), the hidden states the model fed its attention and
what the attention returned. The attention is observed inside the whole
model by a forward hook, so the model itself builds the rotary embeddings,
the masks (causal, sliding window, padding), ALiBi and the KV cache; eager
attention, float32. The models are built from local config objects with
seeded random weights: nothing is downloaded. The Rust tests read the files
and need no Python.

    ~/.cache/sdpa-peers/venv/bin/python scripts/make_model_fixtures.py

The configs (repeated in the Rust tests, which cannot read them):

| file               | model    | hidden, heads, kv heads, head dim | what it checks                                   |
|--------------------|----------|-----------------------------------|--------------------------------------------------|
| hf_mistral         | Mistral  | 32, 4, 2, 8                       | RoPE θ = 1e6, sliding_window = 4, cache decode   |
| hf_gpt_neox        | GPT-NeoX | 32, 4, 4, 8                       | fused per-head query_key_value, partial RoPE     |
|                    |          |                                   | (factor 0.5: 4 of 8 features), θ = 1e4, decode   |
| hf_gemma2          | Gemma 2  | 32, 4, 2, 8                       | attn_logit_softcapping = 3, query_pre_attn_scalar|
|                    |          |                                   | = 16 (scale 1/4), layer 0 sliding (4), layer 1   |
|                    |          |                                   | full; RoPE θ = 1e4                               |
| hf_gpt_oss         | gpt-oss  | 32, 4, 2, 8                       | sinks, biases, YaRN RoPE (the default config),   |
|                    |          |                                   | layer 0 sliding (4), layer 1 full                |
| hf_bloom           | BLOOM    | 24, 6, 6, 4                       | ALiBi with 6 heads (not a power of two), fused   |
|                    |          |                                   | per-head query_key_value, right padding          |

Tensors besides the weights, all `[batch, len, hidden]`:

- decode fixtures (Mistral, GPT-NeoX): `input`, `output` (2 sequences of 9
  tokens, whole), `prefill_output` (tokens 0..6 with a fresh cache),
  `step_output` (tokens 6, 7, 8 one at a time against it);
- Gemma 2, gpt-oss: `layer{i}.input`, `layer{i}.output` for layers 0 and 1,
  2 sequences of 9 tokens; gpt-oss also `rope.inv_freq` (the YaRN inverse
  frequencies) and `rope.attention_scaling` (YaRN's factor on cos and sin);
- BLOOM: `input`, `output` (2 sequences of 7 tokens, the second padded
  after 5: attention_mask [1]·5 + [0]·2; the output is the attention's alone,
  without BLOOM's residual) and `alibi`, `build_alibi_tensor`'s
  `[batch·heads, 1, len]` bias.

Each run also checks in Python that the feature under test changes the
output (the cap, the sinks, the ALiBi), so a fixture cannot pass by
accident.
"""

import os
import pathlib
import sys

# Models are built from local configs; nothing may be fetched from the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_fixtures import AttentionRecorder, decode_outputs  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SMALL = dict(vocab_size=16, num_hidden_layers=1, attn_implementation="eager")


def save(name, tensors):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    path = OUT / name
    save_file(tensors, str(path), metadata={
        "torch": torch.__version__, "transformers": transformers.__version__,
        "script": "scripts/make_model_fixtures.py"})
    print(f"{path.name}: {path.stat().st_size} bytes, {len(tensors)} tensors")


def weights(model, prefix):
    """The floating-point tensors of the module at `prefix` in the model's
    state_dict, under their full names."""
    return {k: v for k, v in model.state_dict().items()
            if k.startswith(prefix + ".") and v.is_floating_point()}


def randomize(module, std, **stds):
    """Normal weights of standard deviation `std`, or `stds[name]` for the
    parameters whose name starts with `name` (the default init, 0.02, makes
    every attention nearly uniform)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, next((s for k, s in stds.items() if name.startswith(k)), std))


def changed(a, b, what):
    difference = (a - b).abs().max().item()
    assert difference > 1e-2, f"{what} changes the output by only {difference}"
    print(f"  {what} changes the output by up to {difference:.3f}")


def hf_mistral():
    """Mistral: GQA, RoPE θ = 1e6, a sliding window of 4 < 9 tokens, decoded
    with the DynamicSlidingWindowLayer cache Mistral's config asks for."""
    torch.manual_seed(10)
    config = transformers.MistralConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **SMALL)
    model = transformers.MistralForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    randomize(attention, 0.2)
    x = torch.randn(2, 9, 32)
    tensors = decode_outputs(model.model, attention, x, 6, "")
    save("hf_mistral.safetensors", {**weights(model, "model.layers.0.self_attn"), **tensors})


def hf_gpt_neox():
    """GPT-NeoX (Pythia): query_key_value fused per head as [heads, 3, head_dim],
    RoPE on the first half of each head (partial_rotary_factor 0.5), biases."""
    torch.manual_seed(11)
    config = transformers.GPTNeoXConfig(
        hidden_size=32, num_attention_heads=4, intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}, **SMALL)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    attention = model.gpt_neox.layers[0].attention
    assert attention.rotary_ndims == 4
    randomize(attention, 0.2)
    x = torch.randn(2, 9, 32)
    tensors = decode_outputs(model.gpt_neox, attention, x, 6, "")
    save("hf_gpt_neox.safetensors", {**weights(model, "gpt_neox.layers.0.attention"), **tensors})


def two_layer_outputs(base_model, layers, x):
    """The input and output of each layer's attention in one forward of the
    whole model, and the recorders (with the kwargs the model passed)."""
    recorders = [AttentionRecorder(layer.self_attn) for layer in layers]
    with torch.no_grad():
        base_model(inputs_embeds=x, use_cache=False)
    tensors = {}
    for i, recorder in enumerate(recorders):
        recorder.remove()
        tensors[f"layer{i}.input"] = recorder.inputs[0]
        tensors[f"layer{i}.output"] = recorder.outputs[0]
    return tensors, recorders


def rerun(attention, recorder):
    """The attention's output again, on the recorded call's arguments."""
    kwargs = dict(recorder.kwargs[0])
    kwargs.pop("hidden_states", None)
    with torch.no_grad():
        return attention(recorder.inputs[0], **kwargs)[0]


def hf_gemma2():
    """Gemma 2: scores scaled by query_pre_attn_scalar^-1/2 (not head_dim's),
    capped by attn_logit_softcapping, then masked; layer 0 slides (window 4),
    layer 1 is global. q and k are drawn larger so that most scores exceed
    the cap of 3 in size, where tanh is far from linear."""
    torch.manual_seed(12)
    config = transformers.Gemma2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, sliding_window=4, query_pre_attn_scalar=16,
        attn_logit_softcapping=3.0, **{**SMALL, "num_hidden_layers": 2})
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = transformers.Gemma2ForCausalLM(config).eval()
    layers = model.model.layers
    for layer in layers:
        randomize(layer.self_attn, 0.2, q_proj=0.5, k_proj=0.5)
    x = torch.randn(2, 9, 32)
    tensors, recorders = two_layer_outputs(model.model, layers, x)
    for layer, recorder in zip(layers, recorders):
        attention = layer.self_attn
        assert attention.scaling == 0.25
        attention.attn_logit_softcapping = None
        changed(recorder.outputs[0], rerun(attention, recorder), "the softcap")
        attention.attn_logit_softcapping = 3.0
        assert torch.equal(rerun(attention, recorder), recorder.outputs[0])
    names = {k: v for i in range(2) for k, v in weights(model, f"model.layers.{i}.self_attn").items()}
    save("hf_gemma2.safetensors", {**names, **tensors})


def hf_gpt_oss():
    """gpt-oss: a learned sink logit per head, biases on every projection,
    YaRN rotary embeddings (its config's default: factor 32, θ = 150000),
    layer 0 slides (window 4), layer 1 is global."""
    torch.manual_seed(13)
    config = transformers.GptOssConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
        **{**SMALL, "num_hidden_layers": 2})
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.rope_parameters["rope_type"] == "yarn"
    model = transformers.GptOssForCausalLM(config).eval()
    layers = model.model.layers
    for layer in layers:
        randomize(layer.self_attn, 0.2, sinks=1.0)
    x = torch.randn(2, 9, 32)
    tensors, recorders = two_layer_outputs(model.model, layers, x)
    for layer, recorder in zip(layers, recorders):
        sinks = layer.self_attn.sinks.data.clone()
        layer.self_attn.sinks.data.fill_(-1e9)
        changed(recorder.outputs[0], rerun(layer.self_attn, recorder), "the sinks")
        layer.self_attn.sinks.data.copy_(sinks)
        assert torch.equal(rerun(layer.self_attn, recorder), recorder.outputs[0])
    rotary = model.model.rotary_emb
    tensors["rope.inv_freq"] = rotary.inv_freq
    tensors["rope.attention_scaling"] = torch.tensor([rotary.attention_scaling], dtype=torch.float64)
    names = {k: v for i in range(2) for k, v in weights(model, f"model.layers.{i}.self_attn").items()}
    save("hf_gpt_oss.safetensors", {**names, **tensors})


def hf_bloom():
    """BLOOM: ALiBi from build_alibi_tensor with 6 heads, query_key_value fused
    per head as [heads, 3, head_dim]; the second sequence is padded after 5
    tokens. BLOOM's attention adds the residual to its output; the output
    saved is the attention's alone (rerun with a zero residual)."""
    torch.manual_seed(14)
    config = transformers.BloomConfig(hidden_size=24, n_head=6, **{
        k: v for k, v in SMALL.items() if k != "num_hidden_layers"}, n_layer=1)
    model = transformers.BloomForCausalLM(config).eval()
    attention = model.transformer.h[0].self_attention
    randomize(attention, 0.3, **{"query_key_value.bias": 0.2, "dense.bias": 0.2})
    x = torch.randn(2, 7, 24)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    recorder = AttentionRecorder(attention)
    with torch.no_grad():
        model.transformer(inputs_embeds=x, attention_mask=mask, use_cache=False)
    recorder.remove()
    # BloomBlock passes (hidden_states, residual) by position, the rest by name.
    _, residual = recorder.args[0]
    kwargs = recorder.kwargs[0]
    with torch.no_grad():
        out = attention(recorder.inputs[0], torch.zeros_like(residual), **kwargs)[0]
        no_alibi = attention(recorder.inputs[0], torch.zeros_like(residual),
                             **{**kwargs, "alibi": torch.zeros_like(kwargs["alibi"])})[0]
    assert torch.allclose(out + residual, recorder.outputs[0], atol=1e-6)
    changed(out, no_alibi, "ALiBi")
    save("hf_bloom.safetensors", {**weights(model, "transformer.h.0.self_attention"),
                                  "input": recorder.inputs[0], "output": out,
                                  "alibi": kwargs["alibi"]})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    hf_mistral()
    hf_gpt_neox()
    hf_gemma2()
    hf_gpt_oss()
    hf_bloom()
