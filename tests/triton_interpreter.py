"""Fixes to Triton's CPU interpreter (TRITON_INTERPRET=1), so the kernels compute there what they compute on the GPU.

conftest.py applies them once, before any test runs a kernel; compiled kernels never go through
the interpreter, so nothing changes on the GPU.
"""

from __future__ import annotations

import triton.language as tl


def fix_triton_interpreter() -> None:
    """Four fixes to Triton 3.6's interpreter (TRITON_INTERPRET=1, how CI runs these kernels on CPU).

    - It keeps scalars as 1-element arrays and takes int() of them for loop bounds, which NumPy
      2.4 refuses (triton-lang/triton#9171, fixed after 3.6).
    - Its tl.dot multiplies bfloat16 operands as their raw uint16 storage; widened to float32
      first, the products are exact, as on the GPU's tensor cores.
    - It casts float32 to bfloat16 by truncation; the GPU rounds to nearest even.
    - Its casts to float8 e4m3 (an fp8 KV cache) round wrongly (31.125 -> 16); the GPU rounds to
      nearest even, as torch's cast does, which the interpreter now calls.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of other triton versions
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None and not getattr(patch_tensor, "_tokenspeed_fixed", False):

        def patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patch_lang_tensor._tokenspeed_fixed = True
        interpreter._patch_lang_tensor = patch_lang_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is not None and not getattr(create_dot, "_tokenspeed_fixed", False):

        def widen(handle):
            if handle.dtype == tl.bfloat16:
                wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
                return interpreter.TensorHandle(wide, tl.float32)
            return handle

        def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot_bf16._tokenspeed_fixed = True
        builder.create_dot = create_dot_bf16

    cast_impl = getattr(builder, "cast_impl", None)
    if cast_impl is not None and not getattr(cast_impl, "_tokenspeed_fixed", False):

        def cast_impl_rounded(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                bits = src.data.astype(np.float32).view(np.uint32)
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
                rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
                return interpreter.TensorHandle(rounded, tl.bfloat16)
            return cast_impl(self, src, dst_type)

        cast_impl_rounded._tokenspeed_fixed = True
        builder.cast_impl = cast_impl_rounded

    fp_to_fp = getattr(builder, "create_fp_to_fp", None)
    if fp_to_fp is not None and not getattr(fp_to_fp, "_tokenspeed_fixed", False):

        def fp_to_fp_rounded(self, src, dst_type, rounding_mode):
            if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16):
                import torch as _torch

                values = src.data
                if src.dtype.scalar == tl.bfloat16:  # stored as its raw uint16 bits
                    values = (values.astype(np.uint32) << 16).view(np.float32)
                wide = _torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
                return interpreter.TensorHandle(wide.to(_torch.float8_e4m3fn).view(_torch.uint8).numpy(), tl.float8e4nv)
            return fp_to_fp(self, src, dst_type, rounding_mode)

        fp_to_fp_rounded._tokenspeed_fixed = True
        builder.create_fp_to_fp = fp_to_fp_rounded
