import os, sys, time, torch
sys.path.insert(0, "tests")
from conftest import generator, randn
from test_triton import paired_modules, module_outputs_and_grads
dev = os.environ.get("DEV", "cpu")
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
import os
from rnnkern.triton import ops as triton_ops
triton_ops.PATH = os.environ.get("P", "auto")
for cell, H in [(a, int(b)) for a, b in (s.split(":") for s in sys.argv[1:])]:
    T, B, I = int(os.environ.get("T", 33)), 17, 40
    dtype = torch.float16
    torch.manual_seed(H)
    ref64, _ = paired_modules(cell, I, H, torch.float64, dev)
    theirs, ours = paired_modules(cell, I, H, dtype, dev)
    theirs.load_state_dict(ref64.state_dict()); ours.load_state_dict(ref64.state_dict())
    g = generator("gpu-parity", cell, H)
    x = randn(g, T, B, I).to(dev); h0 = randn(g, 1, B, H, scale=0.5).to(dev)
    hx64 = (h0, randn(g, 1, B, H, scale=0.5).to(dev)) if cell == "lstm" else h0
    cot = [randn(g, T, B, H).to(dev), randn(g, 1, B, H).to(dev)] + ([randn(g, 1, B, H).to(dev)] if cell == "lstm" else [])
    def run(m, dt):
        xx = x.detach().to(dt).requires_grad_()
        hx = (tuple(h.detach().to(dt).requires_grad_() for h in hx64) if cell == "lstm" else hx64.detach().to(dt).requires_grad_())
        o, gr = module_outputs_and_grads(m, xx, hx, [c.to(dt) for c in cot])
        return list(o) + list(gr)
    t = time.time()
    want = run(ref64, torch.float64); lp = run(theirs, dtype); got = run(ours, dtype)
    lp16 = run(theirs, dtype) if False else None
    for i, (a, b, w) in enumerate(zip(got, lp, want)):
        print(cell, H, i, "ours %.3e" % (a.double() - w).norm().item(), "torch16 %.3e" % (b.double() - w).norm().item())
    print("time", time.time() - t)
