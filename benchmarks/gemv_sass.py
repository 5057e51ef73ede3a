"""The one-row kernel's instructions without a GPU: compile `_gemv_kernel` for sm_90 (Hopper) with
the installed Triton's ptxas and count the SASS instructions of its loop over K, by opcode.

The GEMV at one row is bound by its instructions (Nsight Compute), so their count per code is what
a change to it should lower. The counts depend on the Triton version: the H200 image has 3.6
(`pip install --no-deps --target DIR triton==3.6.0`, then `PYTHONPATH=DIR`). Arguments are
specialized as the engine's Llama-8B layers would be (pointers and sizes divisible by 16).

    .venv/bin/python -m benchmarks.gemv_sass --block-n 16 --block-k 2048 --warps 4
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagellm.ops.triton import matmul as triton_matmul

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*fp16", "zero_ptr": "*u8", "offset_ptr": "*fp16",
            "out_ptr": "*bf16"}


def compile_gemv(block_n: int, block_k: int, warps: int, stages: int, group: int, prefetch: bool = False,
                 half: bool = False, thread_runs: bool = False) -> bytes:
    """The cubin of the 4-bit kernel with per-group zero points (GPTQ / AWQ / rtn's layout)."""
    fn = triton_matmul._gemv_kernel
    names = fn.arg_names
    constants = {"GROUP": group, "ZERO": -1, "OFFSET": False, "PACKED": True, "PER_GROUP": True,
                 "BLOCK_N": block_n, "BLOCK_K": block_k, "PREFETCH": prefetch, "DENSE": False, "PDL": False,
                 "HALF": half, "THREAD_RUNS": thread_runs}
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "i32") for n in names}
    divisible = [*POINTERS, "N", "K", "stride_wn", "stride_sn", "stride_zn"]
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    return kernel.asm["cubin"]


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body (the loop over K)."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]+)\*/\s+(.*?);", sass)]
    branches = [(at, int(m.group(1), 16)) for at, text in code
                if (m := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < at]
    end, start = max(branches, key=lambda b: b[0] - b[1])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                               for at, text in code if start <= at <= end)


def main(argv: list[str] | None = None) -> collections.Counter:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-n", type=int, default=16)
    p.add_argument("--block-k", type=int, default=2048)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--prefetch", action="store_true", help="the variant loading words a tile ahead")
    p.add_argument("--half", action="store_true", help="the variant multiplying in float16 pairs")
    p.add_argument("--thread-runs", action="store_true", help="with --half, each thread making its own runs' pairs")
    p.add_argument("--dump", action="store_true", help="print the whole SASS")
    args = p.parse_args(argv)
    if args.thread_runs and not args.half:
        p.error("--thread-runs is a way of the float16 products: give --half too")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compile_gemv(args.block_n, args.block_k, args.warps, args.stages, args.group, args.prefetch, args.half,
                             args.thread_runs))
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    if args.dump:
        print(sass)
    ops = loop_opcodes(sass)
    codes = args.block_n * args.block_k // (32 * args.warps)  # a thread's codes each time round
    total = sum(ops.values())
    print(f"triton {triton.__version__}: loop of {total} instructions for {codes} codes a thread "
          f"({total / codes:.2f} a code)")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common()))
    return ops


if __name__ == "__main__":
    main()
