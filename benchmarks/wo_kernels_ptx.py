"""What the one-row GEMV's main loop compiles to on sm_90, without a GPU (Triton's ahead-of-time compiler).

    pip install triton==3.6.0 --target /tmp/tsite && PYTHONPATH=/tmp/tsite:$PWD python benchmarks/wo_kernels_ptx.py

Per bit width and a few autotuning configurations: the barriers (``bar.sync``) and shared-memory loads inside
the K loop, and the layout conversions in the Triton GPU IR. This is how triton_gemv.py [Note: no barriers] was
found: version 2 converted each strided ``x`` vector through shared memory, 11 barriers per iteration, which no
device call had time to profile. Counts, not times: the device still decides (benchmarks/wo_kernels.py).
"""

from __future__ import annotations

SIGNATURE = {"xt_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "N": "i32",
             "total_words": "i32", "BITS": "constexpr", "GROUP": "constexpr", "GROUPS": "constexpr",
             "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr", "GPI": "constexpr"}


def main() -> None:
    import triton  # not on the CPU wheel CI installs: imported here so the module imports without it
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_zero.inference import triton_gemv

    print("| bits | BLOCK_N | GPI | warps | loop bar.sync | loop ld.shared | loop lines | convert_layout (IR) |")
    print("|---|---|---|---|---|---|---|---|")
    for bits in (8, 4):
        for block_n, gpi, warps in ((2, 8, 2), (4, 16, 4), (8, 16, 4)):
            consts = {"BITS": bits, "GROUP": 128, "GROUPS": 32, "HAS_BIAS": False, "BLOCK_N": block_n, "GPI": gpi}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
            src = ASTSource(fn=triton_gemv._gemv_kernel.fn, signature=SIGNATURE, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": 3})
            ptx = compiled.asm["ptx"]
            start = ptx.index("Inner Loop Header")
            loop = ptx[start:ptx.index("$L__BB0_1;", start)]
            print(f"| {bits} | {block_n} | {gpi} | {warps} | {loop.count('bar.sync')} | {loop.count('ld.shared')} | "
                  f"{loop.count(chr(10))} | {compiled.asm['ttgir'].count('convert_layout')} |")


if __name__ == "__main__":
    main()
