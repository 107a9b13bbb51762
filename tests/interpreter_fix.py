"""A fix to Triton's CPU interpreter, applied by interpreted_low_latency.py before its kernels run.

Triton 3.9's interpreter splats a boolean scalar (an int1 value such as `flag != 0`) into an array of the type
its handle carries, int32, so a mask such as `(offs < n) & (flag != 0)` becomes an int32 array that its own
loads and stores reject ("mask has unsupported dtype"). Compiled kernels keep int1, and so did the interpreters
before 3.9. With the fix, a boolean value stays boolean when splatted; every other splat is Triton's own."""
import numpy as np
from triton.runtime import interpreter


def keep_splatted_booleans_boolean() -> None:
    splat = interpreter.InterpreterBuilder.create_splat

    def splat_keeping_booleans(self, ret_ty, arg):
        data = np.asarray(arg.data)
        if data.dtype != np.bool_:
            return splat(self, ret_ty, arg)
        return interpreter.TensorHandle(np.full(ret_ty.shape, data.reshape(-1)[0], dtype=np.bool_), arg.dtype.scalar)

    interpreter.InterpreterBuilder.create_splat = splat_keeping_booleans
