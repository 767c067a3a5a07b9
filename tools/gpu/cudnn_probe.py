"""Which call orders give the fused attention's cuDNN backward a wrong gradient: each case in a fresh process (PyTorch's
cuDNN graph cache is per process), DiT-shaped q, k, v (views of one (B, L, 3, H, D) projection), bf16.

    PYTHONPATH=. python tools/gpu/cudnn_probe.py            # all cases, one line each
"""

import os
import subprocess
import sys
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = {
    "fused": "the fused attention alone",
    "sdpa": "SDPA's cuDNN forward + backward alone",
    "sdpa>fused": "SDPA's cuDNN forward + backward, then the fused attention at the same shapes",
    "sdpa(dO q-order)>fused": "the same with SDPA's dO laid out in q's order",
    "fused>sdpa": "the fused attention, then SDPA's cuDNN forward + backward",
    "sdpa>fused(fa2)": "SDPA's cuDNN, then the fused attention with FLM_ATTN_BACKWARD=torch_fa2",
    "sdpa>sdpa(dO q-order)": "SDPA's cuDNN twice, dO contiguous and then in q's order (PyTorch's own cache alone)",
    "sdpa(dO q-order)>sdpa": "the same the other way round",
    "flmsdpa>fused": "flm's sdpa backend (cuDNN) with dO contiguous, then the fused attention: its GradInQOrder should fix it",
    "flmsdpa>flmsdpa(dO q-order)": "flm's sdpa backend twice, dO contiguous and then in q's order",
}


def grads(qkv, g, run):
    qkv = qkv.detach().clone().requires_grad_()
    o = run(*qkv.permute(2, 0, 3, 1, 4))
    (o * g).sum().backward()
    return o, qkv.grad.permute(2, 0, 3, 1, 4)


def errors(got, qkv, g):
    from tests.attention.reference import grads64, rel_err

    return " ".join(f"{n}={rel_err(a, r):.2e}" for n, a, r in zip("qkv", got, grads64(*qkv.permute(2, 0, 3, 1, 4), g)))


def case(name):
    import flm.attention as fa

    torch.manual_seed(0)
    b, n, h, d = 4, 196, 6, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda").to(torch.bfloat16)
    g = torch.randn(b, h, n, d, device="cuda").to(torch.bfloat16)
    g_q = g.transpose(1, 2).contiguous().transpose(1, 2)

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def fused(q, k, v):
        return fa.attention(q, k, v, backend="triton_jvp")

    def flm_sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return fa.attention(q, k, v, backend="sdpa")

    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in name.split(">"):
            if "sdpa" in step:
                o, gr = grads(qkv, g_q if "q-order" in step else g, flm_sdpa if step.startswith("flm") else sdpa)
                out.append(f"{step} O strides {tuple(o.stride())}: {errors(gr, qkv, g)}")
            else:
                if "fa2" in step:
                    os.environ["FLM_ATTN_BACKWARD"] = "torch_fa2"
                o, gr = grads(qkv, g, fused)
                out.append(f"fused O strides {tuple(o.stride())}: {errors(gr, qkv, g)}")
    for w in caught:
        out.append(f"warning: {str(w.message)[:160]}")
    print(f"{name:24s} | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case(sys.argv[1])
    else:
        print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
        for name in CASES:
            subprocess.run([sys.executable, __file__, name], timeout=120)
