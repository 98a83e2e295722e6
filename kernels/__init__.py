"""GPU kernels (Triton), imported as `agentbox.kernels` (pyproject maps this folder there).

One file per kernel; its torch reference twin lives beside it, and a test compares them (on CPU under
Triton's interpreter, `TRITON_INTERPRET=1`: fp32/fp16 only, small shapes).
"""
