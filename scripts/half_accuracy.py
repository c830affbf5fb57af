"""torch's bf16 or f16 SDPA (CPU) against an f64 reference on the same
rounded inputs, as max |err| / max |ref| and ||err|| / ||ref||, on random
normal inputs scaled by SIGMA: the half-precision counterpart of
../shared/peers/py_accuracy.py, printed like
`DTYPE=bf16|f16 cargo run --release --example accuracy`, with the same
floor: the errors of the f64 reference itself rounded to the half type
(the inputs here are torch's random numbers, not the example's, so the
floors differ from the example's cell by cell).
usage: python scripts/half_accuracy.py bf16|f16 (with the peers venv's python)"""
import sys
import torch
import torch.nn.functional as F
dtype_name = sys.argv[1] if len(sys.argv) > 1 else "bf16"
dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype_name]
torch.manual_seed(0)
torch.set_num_threads(1)
print(f"torch {dtype_name} SDPA against f64 on the same {dtype_name} inputs")
print(f"{'N':>5} {'d':>4} {'sigma':>6} {'causal':>6} {'max_rel':>10} {'norm_rel':>10} {'floor_max':>10} {'floor_norm':>10}")
for N, d in ((256, 64), (1024, 64), (1024, 128)):
    for sigma in (1.0, 4.0):
        for causal in (False, True):
            q, k, v = ((torch.randn(1, 8, N, d, dtype=torch.float64) * sigma).to(dtype) for _ in range(3))
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
            err, floor = out - ref, ref.to(dtype).double() - ref
            rel = lambda e: f"{e.abs().max() / ref.abs().max():>10.2e} {e.norm() / ref.norm():>10.2e}"
            print(f"{N:>5} {d:>4} {sigma:>6} {str(causal):>6} {rel(err)} {rel(floor)}")
