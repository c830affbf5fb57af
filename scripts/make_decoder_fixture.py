#!/usr/bin/env python3
"""Writes tests/fixtures/tiny_llama_decoder.safetensors for examples/decoder.rs.

A two-layer Llama-style decoder (`LlamaForCausalLM`: GQA with 4 query heads
and 2 key/value heads of 8, RoPE with theta 10000, RMSNorm, SwiGLU MLP, an
untied LM head) built from a local config with seeded random weights (no
hub download), its whole state_dict saved under Hugging Face's names, with a
prompt and what Hugging Face's greedy `generate` (with its KV cache) makes of
it: the new token ids and each step's logits. The example loads the file,
decodes the same prompt with `sdpa`'s layers and `KvCache`, and checks that
it produces the same tokens and logits; it needs no Python.

    ~/.cache/sdpa-peers/venv/bin/python scripts/make_decoder_fixture.py
"""

import pathlib

import torch
import transformers
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
NEW_TOKENS = 16


def main():
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Larger than the default 0.02 so each step's argmax is decisive.
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
        prompt = torch.tensor([[3, 17, 42, 8, 91, 5, 60]])
        generated = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    new_ids = generated.sequences[0, prompt.shape[1]:]
    logits = torch.stack([step[0] for step in generated.logits])
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    # Token ids as f32 (exact below 2^24): the crate's Checkpoint reads floats.
    tensors["prompt_ids"] = prompt[0].to(torch.float32)
    tensors["generated_ids"] = new_ids.to(torch.float32)
    tensors["generated_logits"] = logits.contiguous()
    path = OUT / "tiny_llama_decoder.safetensors"
    save_file(tensors, str(path), metadata={
        "torch": torch.__version__, "transformers": transformers.__version__,
        "script": "scripts/make_decoder_fixture.py", "rope_theta": "10000.0",
        "rms_norm_eps": "1e-5", "heads": "4", "kv_heads": "2", "head_dim": "8"})
    print(f"{path.name}: {path.stat().st_size} bytes; generated {new_ids.tolist()}")
    top2 = logits.topk(2, dim=-1).values
    print("smallest top-1/top-2 logit gap:", float((top2[:, 0] - top2[:, 1]).min()))


if __name__ == "__main__":
    main()
