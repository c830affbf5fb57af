#!/usr/bin/env python3
"""Rotary position embedding fixtures from Hugging Face `transformers`.

Writes small `.npy` files under `tests/fixtures/rope/`, read by
`tests/integration/rope.rs` (which needs no Python). Run from the
repository root with torch and transformers installed:

    python scripts/make_rope_fixtures.py

Only library functions are used, on models' rotary modules built from local
configs: no hub downloads, no weights.

Each case `NAME` writes, all in `[batch, heads, len, d]` order, C order,
little-endian:

- `NAME_q.npy`, `NAME_k.npy`: the inputs, float32 (`<f4`)
- `NAME_positions.npy`: `position_ids`, int64 (`<i8`), `[batch, len]`
- `NAME_q_out.npy`, `NAME_k_out.npy`: Hugging Face's result in float32, with
  the cos/sin its rotary module computes (in float32)
- `NAME_q_out_f64.npy`, `NAME_k_out_f64.npy`: the same Hugging Face
  `apply_rotary_pos_emb` on the inputs in float64, with cos/sin computed in
  float64 from the same formula (the exact rotation, to 1e-15)

The cases (layout, rotary_dim, theta are repeated in the Rust test):

| case            | model module   | layout      | d  | rotary_dim | theta   |
|-----------------|----------------|-------------|----|------------|---------|
| llama           | Llama (GQA)    | half-split  | 16 | 16         | 10000   |
| llama3_theta    | Llama          | half-split  | 32 | 32         | 500000  |
| neox_partial    | GPT-NeoX       | half-split  | 32 | 8          | 10000   |
| gptj_partial    | GPT-J          | interleaved | 16 | 8          | 10000   |
"""

import os

import numpy as np
import torch
from transformers import GPTJConfig, GPTNeoXConfig, LlamaConfig
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.gptj import modeling_gptj as gptj
from transformers.models.llama import modeling_llama as llama

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "rope")


def save(name, array):
    array = np.ascontiguousarray(array)
    assert array.dtype in (np.float32, np.float64, np.int64)
    np.save(os.path.join(OUT, name + ".npy"), array.astype(array.dtype.newbyteorder("<")))


def half_split_cos_sin_f64(positions, rotary_dim, theta):
    """cos, sin `[batch, len, rotary_dim]` as Hugging Face lays them out for rotate_half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def save_case(name, q, k, positions, q_out, k_out, q_out_f64, k_out_f64):
    save(name + "_q", q.numpy())
    save(name + "_k", k.numpy())
    save(name + "_positions", positions.numpy().astype(np.int64))
    save(name + "_q_out", q_out.detach().numpy())
    save(name + "_k_out", k_out.detach().numpy())
    save(name + "_q_out_f64", q_out_f64.detach().numpy())
    save(name + "_k_out_f64", k_out_f64.detach().numpy())
    print(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {positions.tolist()}")


def llama_case(name, heads, kv_heads, head_dim, theta, positions):
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=128,
        rope_theta=theta,
    )
    rotary = llama.LlamaRotaryEmbedding(config=config)
    expected = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    assert torch.allclose(rotary.inv_freq.double(), expected, rtol=1e-6), "theta not taken"
    batch, length = positions.shape
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float32)
    k = torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float32)
    cos, sin = rotary(q, positions)
    q_out, k_out = llama.apply_rotary_pos_emb(q, k, cos, sin)
    cos64, sin64 = half_split_cos_sin_f64(positions, head_dim, theta)
    q64, k64 = llama.apply_rotary_pos_emb(q.double(), k.double(), cos64, sin64)
    save_case(name, q, k, positions, q_out, k_out, q64, k64)


def neox_case(name, heads, head_dim, partial_rotary_factor, theta, positions):
    config = GPTNeoXConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": partial_rotary_factor,
        },
    )
    rotary = neox.GPTNeoXRotaryEmbedding(config=config)
    rotary_dim = int(head_dim * partial_rotary_factor)
    assert rotary.inv_freq.shape[0] * 2 == rotary_dim, rotary.inv_freq.shape
    batch, length = positions.shape
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float32)
    k = torch.randn(batch, heads, length, head_dim, dtype=torch.float32)
    cos, sin = rotary(q, positions)
    assert cos.shape[-1] == rotary_dim
    q_out, k_out = neox.apply_rotary_pos_emb(q, k, cos, sin)
    cos64, sin64 = half_split_cos_sin_f64(positions, rotary_dim, theta)
    q64, k64 = neox.apply_rotary_pos_emb(q.double(), k.double(), cos64, sin64)
    save_case(name, q, k, positions, q_out, k_out, q64, k64)


def gptj_case(name, heads, head_dim, rotary_dim, positions):
    config = GPTJConfig(n_embd=heads * head_dim, n_head=heads, rotary_dim=rotary_dim, n_positions=128)
    rotary = gptj.GPTJRotaryEmbedding(config)
    batch, length = positions.shape
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float32)
    k = torch.randn(batch, heads, length, head_dim, dtype=torch.float32)

    def rotate(x, sin, cos):
        # GPT-J works on [batch, len, heads, d], rotating the first rotary_dim features.
        x = x.transpose(1, 2)
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        x = torch.cat([gptj.apply_rotary_pos_emb(x_rot, sin, cos), x_pass], dim=-1)
        return x.transpose(1, 2)

    sin, cos = rotary(q, positions)
    q_out, k_out = rotate(q, sin, cos), rotate(k, sin, cos)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions[..., None].to(torch.float64) * inv_freq
    sin64, cos64 = freqs.sin(), freqs.cos()
    q64, k64 = rotate(q.double(), sin64, cos64), rotate(k.double(), sin64, cos64)
    save_case(name, q, k, positions, q_out, k_out, q64, k64)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(20261201)
    # Item 0 from position 0 (a prompt), item 1 from 9 (a KV-cache offset).
    llama_case("llama", 4, 2, 16, 10000.0, torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]]))
    # Scattered positions shared by both items, a large theta.
    llama_case("llama3_theta", 2, 1, 32, 500000.0, torch.tensor([[3, 17, 40, 41], [3, 17, 40, 41]]))
    neox_case("neox_partial", 2, 32, 0.25, 10000.0, torch.tensor([[5, 6, 7], [0, 20, 63]]))
    gptj_case("gptj_partial", 3, 16, 8, torch.tensor([[0, 1, 2, 3], [30, 31, 32, 33]]))


if __name__ == "__main__":
    main()
