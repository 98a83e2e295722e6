"""Compiles the quantised grouped-GEMM and dense dequant-GEMM kernels to cubin for sm_80 and sm_90 without a
GPU (Triton's front end, LLVM and the ptxas its wheel ships): catches what the interpreter lets through
(types, constexpr branches, fp8 support per architecture). Run in a process without TRITON_INTERPRET
(the flag is read when a kernel is decorated); prints one line per kernel, exits 1 on any failure.
Usage: python tests/quant_kernels/cubin_compile.py"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from agentbox.kernels import fused_moe
from agentbox.kernels._quant_triton import WeightFormat, dequant_gemm_kernel

POINTERS = {  # format: (codes, scales) pointer types
    WeightFormat.INT4: ("*i32", "*bf16"),
    WeightFormat.FP8: ("*u8", "*fp32"),
    WeightFormat.FP8_NATIVE: ("*u8", "*fp32"),
    WeightFormat.MXFP4: ("*u8", "*u8"),
}


def compile_for(fn: triton.JITFunction, pointers: dict[str, str], constexprs: dict[str, object], arch: int) -> int:
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    keys = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget("cuda", arch, 32))
    return len(kernel.asm["cubin"])


# k-bit grouped GEMM (GGUF experts): (bits, has offset, BLOCK_K = the group's size where it is 16)
BITS_JOBS = ((5, True, 32), (6, False, 16), (8, False, 32))


def main() -> int:
    jobs = []
    grouped = dict(ROW_DIV=8, MUL_WEIGHT=True, BLOCK_M=fused_moe.BLOCK_M, BLOCK_N=fused_moe.BLOCK_N)
    for fmt, (codes, scales) in POINTERS.items():
        arch = 90 if fmt is WeightFormat.FP8_NATIVE else 80  # Triton has e4m3 from sm_89 on
        ptrs = dict(a_ptr="*bf16", b_ptr=codes, h_ptr=codes, s_ptr=scales, o_ptr=scales, perm_ptr="*i64",
                    c_ptr="*bf16", pairs_ptr="*i64", block_expert_ptr="*i64", weight_ptr="*fp32")
        consts = dict(grouped, FORMAT=fmt.value, HAS_PERM=fmt is WeightFormat.INT4, BITS=0, HAS_OFFSET=True,
                      BLOCK_K=fused_moe.BLOCK_K)
        jobs.append((f"grouped gemm {fmt.name}", fused_moe._grouped_gemm_kernel, ptrs, consts, arch))
    for bits, has_offset, block_k in BITS_JOBS:
        ptrs = dict(a_ptr="*bf16", b_ptr="*i32", h_ptr="*i32", s_ptr="*bf16", o_ptr="*bf16", perm_ptr="*i64",
                    c_ptr="*bf16", pairs_ptr="*i64", block_expert_ptr="*i64", weight_ptr="*fp32")
        consts = dict(grouped, FORMAT=WeightFormat.INT4.value, HAS_PERM=False, BITS=bits, HAS_OFFSET=has_offset,
                      BLOCK_K=block_k)
        jobs.append((f"grouped gemm {bits}-bit", fused_moe._grouped_gemm_kernel, ptrs, consts, 80))
    # the dense dequant-GEMM (w4a16, w8a16 and wbits launch it)
    dense = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, BITS=0, HAS_OFFSET=True)
    jobs.append(("w4a16", dequant_gemm_kernel, dict(x_ptr="*bf16", w_ptr="*i32", h_ptr="*i32", s_ptr="*bf16",
                 o_ptr="*bf16", out_ptr="*bf16"), dict(dense, FORMAT=WeightFormat.INT4.value), 80))
    jobs.append(("w8a16", dequant_gemm_kernel, dict(x_ptr="*bf16", w_ptr="*u8", h_ptr="*u8", s_ptr="*fp32",
                 o_ptr="*fp32", out_ptr="*bf16"), dict(dense, FORMAT=WeightFormat.FP8.value, HAS_OFFSET=False), 80))
    failed = 0
    for name, fn, ptrs, consts, arch in jobs:
        try:
            print(f"{name} sm_{arch}: {compile_for(fn, ptrs, consts, arch)} B of cubin")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"{name} sm_{arch}: FAILED {e.__cause__ or e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
