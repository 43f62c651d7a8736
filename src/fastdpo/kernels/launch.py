"""What every op's launcher shares: whether the kernels serve a tensor, the launch itself with less host work than
Triton's dispatch, and block arithmetic.

No kernel depends on the number of tokens: that count is not specialised on (`do_not_specialize`), so a run builds
each kernel once per width and dtype, however its micro-batch lengths vary. Outside CUDA the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, which the tests use); `available(t)` says whether they serve a tensor."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None  # the CPU wheel of torch brings none: the torch path

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_failed: list[str] = []  # why the kernels could not be built here (then nothing uses them)


def available(t: torch.Tensor) -> bool:
    """The kernels serve `t`: Triton is installed, and `t` lives on CUDA (or on the CPU under the interpreter)."""
    return HAVE_TRITON and not _failed and t.dtype in DTYPES and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def turn_off(why: str) -> None:
    """Record that the kernels could not be built here (`why`): from then on `available` says no."""
    _failed.append(why)


def why_off() -> str | None:
    """Why the kernels could not be built here (the first failure), or None."""
    return _failed[0] if _failed else None


_LAUNCH_FORM = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                "launch_metadata,")
_knobs = None  # Triton's settings module, once direct launches are known to be possible


@functools.cache
def _direct_launches() -> bool:
    """Whether compiled kernels can be launched here as Triton's own dispatch launches them (its `JITFunction.run`
    ends with that call, in the form `launch` repeats): checked once, on Triton's source. Otherwise every launch
    goes through Triton's dispatch."""
    global _knobs
    if INTERPRET or not HAVE_TRITON:
        return False
    try:
        import inspect

        from triton import knobs
        from triton.runtime.jit import JITFunction

        if _LAUNCH_FORM not in " ".join(inspect.getsource(JITFunction.run).split()):
            return False
    except Exception:  # noqa: BLE001 - no source to check (or another Triton): its dispatch
        return False
    _knobs = knobs
    return True


def _arg_key(v) -> object:
    """What Triton specialises a kernel argument on, or more (over-keying only adds entries that share a kernel):
    a tensor's dtype and 16-byte alignment, an int's equality to 1, divisibility by 16 and width, a float's type."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "b", v
    if isinstance(v, int):
        return v == 1, v % 16 == 0, 0 if -2**31 <= v < 2**31 else 1 if -2**63 <= v < 2**63 else 2
    if isinstance(v, float):
        return float
    raise TypeError(type(v))


def _constants(kernel, args: tuple, constexprs: dict) -> tuple | None:
    """The kernel's parameters after the positional `args`, in its own order, when `constexprs` names exactly those
    (then every argument of the launch is known); else None."""
    names = list(getattr(kernel, "arg_names", ()))
    rest = names[len(args):]
    if len(names) < len(args) or sorted(rest) != sorted(constexprs):
        return None
    return tuple(constexprs[n] for n in rest)


_compiled: dict[tuple, tuple] = {}


def launch(kernel, grid: tuple[int, ...], *args, num_warps: int = 4, **constexprs) -> None:
    """`kernel[grid](*args, num_warps=num_warps, **constexprs)` with less host work per call. Triton's dispatch
    binds the arguments, computes its cache key, reads its settings and looks up the stream: about 15 µs of Python
    per launch, measured on an H200's host, and a training step makes hundreds of these launches. The first call
    with a given specialisation (`_arg_key` of each argument, the constants, the warps, the device) goes through
    Triton, which compiles or loads the kernel; later calls hand every argument straight to the compiled kernel's
    launcher, on the current stream, as Triton's dispatch does after its lookup."""
    if not _direct_launches():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, num_warps, tuple(constexprs.items()), *map(_arg_key, args))
    except TypeError:  # an argument kind the key does not know: Triton's dispatch
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    hit = _compiled.get(key)
    if hit is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        constants = _constants(kernel, args, constexprs)
        if constants is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                        "launch_metadata")):
            _compiled[key] = compiled, constants
        return
    compiled, constants = hit
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    stream = torch._C._cuda_getCurrentRawStream(device)
    every = (*args, *constants)
    hooked = enter is not None and getattr(enter, "calls", True)  # a profiler's hooks want the launch's metadata
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, compiled.launch_metadata(grid, stream, *every) if hooked else None, enter,
                 leave, *every)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def device_programs(device_index: int) -> int:
    """Programs enough to keep every SM of a CUDA device busy (four per SM; 8 without CUDA): how many a kernel that
    sums spans of rows splits its rows into."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count * 4


@functools.cache
def has_out_dtype() -> bool:
    """Whether this torch's mm and addmm take `out_dtype` (bf16/fp16 inputs, a float32 result on CUDA): the ops'
    weight gradients are then written by the GEMM in float32."""
    return hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out")
