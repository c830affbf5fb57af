#!/usr/bin/env python3
"""Writes the checkpoint fixtures of tests/integration/checkpoints/ into tests/fixtures/.

Each file holds a module's weights, saved with `safetensors` under the names
its framework gives them, next to inputs and the outputs torch or Hugging Face
`transformers` computes from them. The models are built from local config
objects with seeded random weights: nothing is downloaded. The Rust tests read
the files and need no Python.

    ~/.cache/sdpa-peers/venv/bin/python scripts/make_fixtures.py

Run it again only to change the fixtures; the outputs depend on the torch and
transformers versions only through rounding (the tests allow 1e-5 in f32).
"""

import math
import os
import pathlib

# Models are built from local configs; nothing may be fetched from the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def save(name, tensors):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    path = OUT / name
    save_file(tensors, str(path), metadata={
        "torch": torch.__version__, "transformers": transformers.__version__,
        "script": "scripts/make_fixtures.py"})
    print(f"{path.name}: {path.stat().st_size} bytes, {len(tensors)} tensors")


def prefixed(prefix, module):
    # Persistent tensors only, as a checkpoint holds them.
    return {f"{prefix}.{k}": v for k, v in module.state_dict().items()}


class AttentionRecorder:
    """The hidden states an attention module is called with and the tensor it
    returns, call by call, taken by a forward hook inside a whole model (so
    the model builds the position embeddings, the mask and the cache)."""

    def __init__(self, module):
        self.inputs, self.outputs, self.args, self.kwargs = [], [], [], []
        self.handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.inputs.append(hidden.detach().clone())
        self.outputs.append(output[0].detach().clone())
        self.args.append(args)
        self.kwargs.append(kwargs)

    def remove(self):
        self.handle.remove()


def decode_outputs(base_model, attention, x, prompt, prefix):
    """What `attention` (a module inside the one-layer `base_model`, a
    transformers `*Model` taking `inputs_embeds`) computes on `x` whole, then
    on its first `prompt` tokens with a fresh cache, then on each later token
    alone against that cache: `{prefix}input` (the attention's input for the
    whole sequence), `{prefix}output`, `{prefix}prefill_output` and
    `{prefix}step_output` (the single-token calls, concatenated)."""
    recorder = AttentionRecorder(attention)
    with torch.no_grad():
        base_model(inputs_embeds=x, use_cache=False)
        cache = base_model(inputs_embeds=x[:, :prompt], use_cache=True).cache
        for t in range(prompt, x.shape[1]):
            cache = base_model(inputs_embeds=x[:, t:t + 1], cache=cache, use_cache=True).cache
    recorder.remove()
    full_input = recorder.inputs[0]
    # The norm before the attention is per token: each call's input is a
    # slice of the whole sequence's, so one input serves every call.
    assert torch.equal(torch.cat(recorder.inputs[1:], dim=1), full_input)
    steps = torch.cat(recorder.outputs[2:], dim=1)
    # The cached path is the full forward's, up to rounding.
    assert torch.allclose(steps, recorder.outputs[0][:, prompt:], atol=1e-5)
    return {f"{prefix}input": full_input, f"{prefix}output": recorder.outputs[0],
            f"{prefix}prefill_output": recorder.outputs[1], f"{prefix}step_output": steps}


def torch_linear():
    """Three square nn.Linear(8, 8): the transpose trap. Single head, no bias."""
    torch.manual_seed(1)
    q, k, v = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
    x = torch.randn(5, 8)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q(x)[None], k(x)[None], v(x)[None])[0]
    tensors = {"q.weight": q.weight, "k.weight": k.weight, "v.weight": v.weight,
               "input": x, "output": out,
               # For the dtype error: a tensor the loader does not read yet.
               "half.weight": q.weight.to(torch.bfloat16)}
    save("torch_linear.safetensors", tensors)


def torch_mha():
    """nn.MultiheadAttention(16, 4) with biases, batch_first, self-attention."""
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(16, 4, bias=True, batch_first=True).eval()
    with torch.no_grad():
        # torch initialises the biases to zero; make them count.
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
        x = torch.randn(2, 5, 16)
        out, _ = mha(x, x, x, need_weights=False)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
        out_causal, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
        # torch's key_padding_mask: True = ignore (the opposite of a keep mask).
        padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
        out_padded, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    save("torch_mha.safetensors", {**prefixed("mha", mha), "input": x, "output": out,
                                   "output_causal": out_causal, "output_padded": out_padded})


def hf_gpt2():
    """transformers' GPT2Attention (Conv1D c_attn/c_proj), in f64, causal."""
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_embd=16, n_head=4, n_positions=16, n_layer=1,
                                     attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = "eager"
    attn = transformers.models.gpt2.modeling_gpt2.GPT2Attention(config, layer_idx=0)
    attn = attn.double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(2, 6, 16, dtype=torch.float64)
        mask = torch.full((6, 6), -math.inf, dtype=torch.float64).triu(1)[None, None]
        out = attn(x, attention_mask=mask)[0]
        # The same by hand: GPT-2's attention is causal, scale 1/sqrt(head_dim).
        q, k, v = attn.c_attn(x).split(16, dim=2)
        heads = lambda t: t.view(2, 6, 4, 4).transpose(1, 2)
        manual = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        manual = attn.c_proj(manual.transpose(1, 2).reshape(2, 6, 16))
        assert torch.allclose(out, manual, atol=1e-12), (out - manual).abs().max()
    tensors = {k: v for k, v in prefixed("attn", attn).items() if v.is_floating_point()}
    save("hf_gpt2.safetensors", {**tensors, "input": x, "output": out})


def hf_llama_like(name, cls, config_cls, model_cls, bias, rope_theta):
    """A Llama-family attention with GQA (4 query heads, 2 key/value heads of 8).

    `output` was run with cos = 1, sin = 0 as the position embeddings, which
    makes its RoPE the identity: the projections and the grouped causal
    attention alone. The `rope.` tensors are the same attention, weights and
    all, inside a one-layer `model_cls` (whose RMSNorm makes the attention's
    input) with real rotary embeddings of base `rope_theta` over the whole
    head: 2 sequences of 9 tokens, whole (`rope.output`), then the first 6
    with a fresh `DynamicCache` (`rope.prefill_output`) and tokens 6, 7, 8
    one at a time against it (`rope.step_output`)."""
    torch.manual_seed(4)
    kwargs = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, num_hidden_layers=1, attention_dropout=0.0)
    if name == "hf_llama":
        kwargs["attention_bias"] = bias
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    attn = cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
        x = torch.randn(1, 5, 32)
        cos, sin = torch.ones(1, 5, 8), torch.zeros(1, 5, 8)
        mask = torch.full((5, 5), -math.inf).triu(1)[None, None]
        out = attn(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
        tensors = {**prefixed("attn", attn), "input": x, "output": out,
                   "q": attn.q_proj(x), "k": attn.k_proj(x), "v": attn.v_proj(x),
                   "o": attn.o_proj(x)}  # o_proj of the input: its width is heads·head_dim too
    rope_config = config_cls(**kwargs, vocab_size=16, attn_implementation="eager",
                             rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    model = model_cls(rope_config).eval()
    model.layers[0].self_attn.load_state_dict(attn.state_dict())
    x = torch.randn(2, 9, 32)
    tensors.update(decode_outputs(model, model.layers[0].self_attn, x, 6, "rope."))
    save(f"{name}.safetensors", tensors)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch_linear()
    torch_mha()
    hf_gpt2()
    llama = transformers.models.llama.modeling_llama
    qwen2 = transformers.models.qwen2.modeling_qwen2
    hf_llama_like("hf_llama", llama.LlamaAttention, transformers.LlamaConfig, llama.LlamaModel,
                  bias=False, rope_theta=500000.0)
    # Qwen2: biases on q_proj, k_proj and v_proj, none on o_proj.
    hf_llama_like("hf_qwen2", qwen2.Qwen2Attention, transformers.Qwen2Config, qwen2.Qwen2Model,
                  bias=True, rope_theta=1000000.0)
