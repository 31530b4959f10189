"""How much sm_90a machine code the decode attention kernel runs, per split count, on a machine without a GPU: lowers
build_sink_attention_decode with TileLang, compiles it with nvcc (as tests/lowering_helpers does) and prints ptxas's
registers and spills and the size of the kernel's .text section, read from the cubin with cuobjdump, and each
warpgroup's loop from the SASS with nvdisasm.

Why: a 64-key block of the kernel cost ~6.8 µs on the H200 where its loads, dequantisation, shared-memory traffic
and MMAs need ~1.5 µs each at most; the unrolled build was 149 KB of code with a ~79 KB producer loop beside the math
warpgroups' loops on each SM sub-partition, and the one-body loops (the kernel's only form since) ran it 1.35-1.57x
faster on an H100 (docs/hopper-sessions.md, the twenty-third session).

cuobjdump / nvdisasm come with a CUDA toolkit, or from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: their
bin/ folder on PATH, or CUDA_BIN=<folder>).

    python tools/kernel_code_size.py                     # 1 and 2 splits
    python tools/kernel_code_size.py --splits 1 5 10 --probe no_load
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _tool(name: str) -> str | None:
    folder = os.environ.get("CUDA_BIN")
    return str(Path(folder) / name) if folder else shutil.which(name)


def _role_loops(sass: str) -> list[float]:
    """KB of each warpgroup role's largest loop: the roles start at their setmaxnreg (USETMAXREG) and end where the
    next starts, the last one at the kernel's last EXIT; a loop is a backward branch inside one role (the mbarrier
    retry stubs after the last EXIT branch back into the code and are not loops)."""
    at = lambda line: int(re.search(r"/\*([0-9a-f]+)\*/", line).group(1), 16)
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    labels = {}
    for prev, ln in zip(sass.splitlines(), sass.splitlines()[1:]):
        m = re.match(r"^\.(L_x_\d+):", prev)
        if m and re.search(r"/\*[0-9a-f]{4,}\*/", ln):
            labels[m.group(1)] = at(ln)
    starts = [at(ln) for ln in lines if "USETMAXREG" in ln]
    exits = [at(ln) for ln in lines if re.search(r"\bEXIT\b", ln)]
    out = []
    for i, s0 in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else max(exits)
        best = 0
        for ln in lines:
            m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", ln)
            if m and s0 <= at(ln) <= end and s0 <= labels.get(m.group(1), -1) < at(ln):
                best = max(best, at(ln) - labels[m.group(1)])
        out.append(best / 1024)
    return out


def report(splits: int, probe: str = "") -> str:
    from lowering_helpers import lower_source
    from tilelang import env

    from deepinfer.kernels.tilelang.attention_decode_kernel import build_sink_attention_decode

    src = lower_source(build_sink_attention_decode(splits=splits, arch="sm_90a", probe=probe), "sm_90a")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(src)
        res = subprocess.run([_tool("nvcc"), "-std=c++20", "-O3", "-cubin", "-gencode",
                              "arch=compute_90a,code=sm_90a", "--ptxas-options=-v", f"-I{env.TILELANG_TEMPLATE_PATH}",
                              f"-I{env.CUTLASS_INCLUDE_DIR}", "-o", str(cubin), str(cu)],
                             capture_output=True, text=True)
        if res.returncode:
            return f"nvcc failed: {res.stderr[-500:]}"
        log = res.stdout + res.stderr
        regs = re.search(r"Used (\d+) registers", log).group(1)
        spill = re.search(r"(\d+) bytes spill stores", log).group(1)
        line = f"{regs} registers, {spill} B spill stores"
        objdump, disasm = _tool("cuobjdump"), _tool("nvdisasm")
        if objdump:
            elf = subprocess.run([objdump, "-elf", str(cubin)], capture_output=True, text=True).stdout
            row = next(r.split() for r in elf.splitlines() if "PROGBITS" in r and ".text." in r)
            text = int(row[2], 16)  # section header row: index, offset, size, ...
            line += f", .text {text:,} B"
        if disasm:
            sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True).stdout
            line += ", loops (producer / WG1 / WG0) " + " / ".join(f"{kb:.1f} KB" for kb in _role_loops(sass))
        return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--probe", default="", help="a timing probe (attention_decode_kernel.PROBES; default none)")
    a = ap.parse_args()
    if not _tool("nvcc"):
        raise SystemExit("kernel_code_size: nvcc not found (install a CUDA toolkit, or set CUDA_BIN=<its bin folder>)")
    for s in a.splits:
        print(f"splits {s:>2}{'  probe ' + a.probe if a.probe else ''}: {report(s, a.probe)}", flush=True)


if __name__ == "__main__":
    main()
