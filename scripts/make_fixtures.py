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
import pathlib

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

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


def hf_llama_like(name, cls, config_cls, bias):
    """A Llama-family attention with GQA (4 query heads, 2 key/value heads of 8).

    Its RoPE is made the identity by passing cos = 1, sin = 0 as the position
    embeddings, so the whole forward (projections, grouped causal attention,
    o_proj) is comparable until the crate has rotary embeddings."""
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
    save(f"{name}.safetensors", tensors)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch_linear()
    torch_mha()
    hf_gpt2()
    llama = transformers.models.llama.modeling_llama
    qwen2 = transformers.models.qwen2.modeling_qwen2
    hf_llama_like("hf_llama", llama.LlamaAttention, transformers.LlamaConfig, bias=False)
    # Qwen2: biases on q_proj, k_proj and v_proj, none on o_proj.
    hf_llama_like("hf_qwen2", qwen2.Qwen2Attention, transformers.Qwen2Config, bias=True)
