"""Peak resident memory of the LM head's loss, forward and backward, on the CPU: the full float32
logits (``F.cross_entropy``) against moe_ep's chunked loss, at the README's sizes (float32, 4096
tokens, V=32000, H 256, 1024 and 4096). Each measurement runs in its own process, since the peak
resident size only grows: ``.venv/bin/python scripts/head_memory.py``."""

import resource
import subprocess
import sys

import torch
import torch.nn.functional as F

TOKENS, VOCAB = 4096, 32000


def measure(mode: str, hidden: int) -> float:
    """MiB by which the process's peak resident size grows over one forward and backward."""
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    hidden_TH = torch.randn(TOKENS, hidden, requires_grad=True)
    weight_VH = (torch.randn(VOCAB, hidden) * 0.02).requires_grad_()
    target_T = torch.randint(0, VOCAB, (TOKENS,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "full":
        loss = F.cross_entropy(hidden_TH @ weight_VH.T, target_T, reduction="sum")
    else:
        loss, _ = linear_cross_entropy(hidden_TH, weight_VH, target_T)
    loss.backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss is in KiB


def main() -> None:
    if len(sys.argv) == 3:
        print(f"{measure(sys.argv[1], int(sys.argv[2])):.0f}")
        return
    print(f"float32, {TOKENS} tokens, V={VOCAB}: peak resident growth of the head's forward and backward")
    for hidden in (256, 1024, 4096):
        full, chunked = (float(subprocess.run([sys.executable, __file__, mode, str(hidden)], check=True,
                                              capture_output=True, text=True).stdout) for mode in ("full", "chunked"))
        print(f"  H={hidden:5d}: full logits {full:6.0f} MiB, chunked loss {chunked:5.0f} MiB ({full / chunked:.1f}x less)")


if __name__ == "__main__":
    main()
