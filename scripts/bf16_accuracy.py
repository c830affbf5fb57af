"""torch's bf16 SDPA (CPU) against an f64 reference on the same bf16-rounded
inputs, as max |err| / max |ref| and ||err|| / ||ref||, on random normal
inputs scaled by SIGMA: the bf16 counterpart of ../shared/peers/py_accuracy.py,
printed like `DTYPE=bf16 cargo run --release --example accuracy`.
usage: python scripts/bf16_accuracy.py (with the peers venv's python)"""
import torch
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
print("torch bf16 SDPA against f64 on the same bf16 inputs")
print(f"{'N':>5} {'d':>4} {'sigma':>6} {'causal':>6} {'max_rel':>10} {'norm_rel':>10}")
for N, d in ((256, 64), (1024, 64), (1024, 128)):
    for sigma in (1.0, 4.0):
        for causal in (False, True):
            q, k, v = ((torch.randn(1, 8, N, d, dtype=torch.float64) * sigma).bfloat16() for _ in range(3))
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
            err = out - ref
            print(f"{N:>5} {d:>4} {sigma:>6} {str(causal):>6} {err.abs().max() / ref.abs().max():>10.2e} {err.norm() / ref.norm():>10.2e}")
