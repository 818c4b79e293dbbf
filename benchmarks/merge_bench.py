"""All-layer merge and restore of one rank-64 q,k,v,o adapter into a 7B-shaped model's weights
(32 layers), one GPU: time against the memory floor (bytes that must move once over the
device-to-device copy bandwidth measured in the same run).

    PYTHONPATH=.:protos python3 benchmarks/merge_bench.py
"""
import torch
from kernels.lora_stack import LoRAStack
from kernels.merge import MergeTarget, merge_weights, restore_weights
targets = []
for layer in range(32):
    for sizes in ((4096, 4096, 4096), (4096,)):
        stack = LoRAStack.empty(1, 4096, sizes, 64, torch.bfloat16, "cuda")
        stack.set_slot(0, {s: (torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16) * .01,
                               torch.randn(n, 64, device="cuda", dtype=torch.bfloat16) * .01) for s, n in enumerate(sizes)}, 2.0)
        w = torch.randn(sum(sizes), 4096, device="cuda", dtype=torch.bfloat16)
        targets.append(MergeTarget(w, torch.empty_like(w), stack))
src = torch.randn(2**29, device="cuda"); dst = torch.empty_like(src)
def t(fn, n=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return sorted(ts)[n // 2]
bw = 2 * src.numel() * 4 / (t(lambda: dst.copy_(src)) / 1e3)
wbytes = sum(x.weight.numel() * 2 for x in targets)
m = t(lambda: merge_weights(targets, 0)); r = t(lambda: restore_weights(targets))
print(f"device {torch.cuda.get_device_name()}, copy {bw/1e12:.2f} TB/s; q,k,v,o weights of a 7B: {wbytes/1e9:.2f} GB")
print(f"merge (read W, write W and backup): {m:.2f} ms, floor {3*wbytes/bw*1e3:.2f} ms, ratio {m/(3*wbytes/bw*1e3):.2f}")
print(f"restore (read backup, write W): {r:.2f} ms, floor {2*wbytes/bw*1e3:.2f} ms, ratio {r/(2*wbytes/bw*1e3):.2f}")
