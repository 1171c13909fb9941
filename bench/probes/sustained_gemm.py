# Probe (issue 21): sustained GEMM ceilings under the board's power limit, with PyTorch's
# cuBLAS on the GPU machine (python3 there has torch): `python3 bench/probes/sustained_gemm.py 6`
# beside `nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active -lms 250`.
# Figures: BENCHMARKS.md, "Where the fp8 step's missing time goes".
# Each shape runs back to back for `seconds`; TFLOP/s from CUDA events: the first five
# 20-GEMM batches and the last half (after the clock has settled).
import sys, time, torch
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
def run(name, fn, flops):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t_end = time.time() + seconds
    times = []
    while time.time() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20): fn()
        e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 20)
    first = sorted(times[:5])[2]
    late = sorted(times[len(times)//2:]); med = late[len(late)//2]
    print(f"{name} [{time.strftime('%H:%M:%S', time.gmtime(t_end - seconds))}-{time.strftime('%H:%M:%S', time.gmtime(t_end))}]: first {flops/first/1e9:.0f} TFLOP/s, sustained (median of the last half) {flops/med/1e9:.0f} TFLOP/s, {med:.3f} ms", flush=True)
torch.manual_seed(0)
for (m, k, n) in [(8192, 8192, 8192), (32768, 2048, 5632), (32768, 5632, 2048)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    run(f"bf16 [{m},{k}]x[{k},{n}]", lambda: torch.matmul(a, b), 2 * m * k * n)
    time.sleep(3)
    a8 = a.to(torch.float8_e4m3fn); b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
    sa = torch.ones(m, 1, device="cuda"); sb = torch.ones(1, n, device="cuda")
    run(f"fp8 rowwise-scaled [{m},{k}]x[{k},{n}]", lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 2 * m * k * n)
    time.sleep(3)
