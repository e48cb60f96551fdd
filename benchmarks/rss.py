"""Peak-memory probe: one format, one step, in a fresh interpreter.

Run as ``python -m benchmarks.rss WORKLOAD FORMAT STEP``; prints one JSON line. The probe
loads steps STEP-1 and STEP and a working copy of STEP-1, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), runs encode then decode+apply, and reports how far the peak rose
above the resident size before encoding. That rise is the format's own working memory,
including the blob it produced, without the interpreter or the snapshots it had to hold anyway.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (VmRSS, VmHWM); 0 where there is no /proc. The
    benchmarks that report peak memory read it through here."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _hwm_kb() -> int:
    """Peak RSS of this process's memory map (VmHWM).

    Not ``ru_maxrss``: Linux folds the peak of the pre-exec image into it, and a child of a
    fork() starts with its parent's peak, so it would report the harness's memory, not ours
    (it is the fallback only where there is no /proc).
    """
    return status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0), so that a peak read after it belongs
    to what ran since; False where the kernel does not offer it (peaks then include earlier
    work)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def probe(workload: str, fmt_name: str, step: int) -> dict:
    import torch

    from benchmarks.peers import FORMATS
    from benchmarks.run import THREADS
    from benchmarks.workload import load_step

    torch.set_num_threads(THREADS)

    fmt = FORMATS[fmt_name]
    prev, new = load_step(workload, step - 1), load_step(workload, step)
    target = {k: v.clone() for k, v in prev.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    fmt.encode(prev, new)  # warm-up: imports and first-call allocations are not the format's
    gc.collect()
    reset = reset_peak()
    base_kb = _rss_kb() if reset else _hwm_kb()
    blob = fmt.encode(prev, new)
    fmt.decode_apply(target, blob)
    peak_kb = _hwm_kb()
    exact = all(torch.equal(target[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    return {
        "workload": workload, "format": fmt_name, "step": step,
        "model_bytes": model_bytes, "base_rss_bytes": base_kb * 1024,
        "peak_rss_bytes": peak_kb * 1024, "extra_bytes": max(0, peak_kb - base_kb) * 1024,
        "peak_reset": reset, "exact": exact,
    }


if __name__ == "__main__":
    w, f, s = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(probe(w, f, s)))
