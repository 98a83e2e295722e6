"""The compute kernels of agentbox: Triton kernels for the GPU and C kernels for x86-64 CPUs, each with its torch
reference twin beside it and a test comparing the two. Imported as `agentbox.kernels`.

Where this folder lives: under agentbox/. It sat at the top of the repository (mapped here by setup.py) until
transformers 5.25 began importing the PyPI package `kernels`, which a top-level folder of that name shadows
whenever the checkout is on `sys.path`. pyproject.toml ships the C sources with it (package-data `*.c`, `*.h`).

- GPU (Triton): paged attention (paged_decode.py, prefix_extend.py, store_kv.py; twin: attention_ref.py),
  dequant-GEMMs (w4a16.py, w8a16.py, w8a8_block.py, wbits.py; formats and twins: dequant.py) and the grouped
  MoE GEMM (fused_moe.py, fused_moe_quant.py). They import Triton through _triton.py / _quant_triton.py, so a
  module imports where Triton is absent; on CPU their tests run under Triton's interpreter
  (`TRITON_INTERPRET=1`: fp32 and fp16 only, small shapes; tests/kernels, tests/quant_kernels).
- CPU (C, one library built with the system `cc` on first use and loaded with ctypes by cpu_gemv.py): 4- and
  8-bit GEMV (cpu_gemv.c, cpu_gemv.h; twins in cpu_gemv.py), k-bit weights (cpu_bits.c's matmul, cpu_bits_dequant.c,
  their layout in cpu_bits_layout.h; cpu_bits.py) and the fused decode layers (cpu_decode.c, with cpu_moe.c's
  linears of either form and routed experts; the Qwen3.5 hybrid's and the fp16 matmul in cpu_hybrid.c, twin in
  cpu_f16.py and the torch layers; its many-row form on AMX bf16 tiles in cpu_f16_amx.c, its own small library).
  Attention over the paged cache (cpu_attention.c, its vectors and register tiles in cpu_attention_vec.h and
  cpu_attention_tiles.h, its own small library; twin and loader in cpu_attention.py). docs/cpu-kernels.md has the
  numbers.
"""
