"""Mixture-of-experts layers: routing and the FusedMoE layer (base.py), and one file per storage format of
the experts' weights (unquantised in base.py, int4 and FP8 in quant.py, AWQ/GPTQ in awq_gptq.py, k-bit in
bits.py, GGUF in gguf.py, MXFP4 in mxfp4.py) plus the CPU kernels' repacked form (cpu.py). A format is an
`ExpertMethod`; the checkpoint's QuantConfig picks it.
"""
